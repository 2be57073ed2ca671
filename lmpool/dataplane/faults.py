"""Injected faults for transfer plans, so tests can break a real worker at an exact point.

``LMPOOL_TRANSFER_FAULTS`` (a JSON list, inherited by the pool's workers) names per fault a
rank, an order kind, a point (``before`` the worker acts, ``after`` it acted, ``during`` an
execute's bytes in flight) and an action (``raise``: the order fails; ``drop``: the order or
its answer is lost; ``kill``: the worker SIGKILLs itself); ``mark`` names a file to append
to as it fires.

Invariants: a fault fires at most ``times`` times, only in the incarnation (``epoch``) it
names; with the variable unset ``FaultPlan.hit`` is one lookup returning ``None``; nothing
outside tests sets it.
"""

from __future__ import annotations

import os
import signal

import msgspec

ENV = "LMPOOL_TRANSFER_FAULTS"
ORDERS = ("prepare_source", "prepare_dest", "execute_send", "execute_recv", "publish", "finalize")
POINTS = ("before", "after", "during")
ACTIONS = ("raise", "drop", "kill")


class InjectedFault(RuntimeError):
    """A failure a test asked for (see the module docstring)."""


class Fault(msgspec.Struct, forbid_unknown_fields=True):
    rank: int
    order: str
    point: str
    action: str
    epoch: int = 1
    times: int = 1
    mark: str = ""  # a file to append "<order> <point>" to as the fault fires

    def __post_init__(self) -> None:
        for name, value, allowed in (("order", self.order, ORDERS), ("point", self.point, POINTS),
                                     ("action", self.action, ACTIONS)):
            if value not in allowed:
                raise ValueError(f"fault {name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.point == "during" and not self.order.startswith("execute_"):
            raise ValueError(f"point 'during' needs an execute order, not {self.order!r}")
        if self.times < 1:
            raise ValueError(f"fault times must be >= 1, got {self.times}")


def encode(faults: list[Fault]) -> str:
    """The environment value that injects ``faults``."""
    return msgspec.json.encode(faults).decode()


class FaultPlan:
    """The faults of one worker incarnation."""

    def __init__(self, rank: int, epoch: int, faults: list[Fault]) -> None:
        self._left: dict[tuple[str, str], list[Fault]] = {}
        for f in faults:
            if f.rank == rank and f.epoch == epoch:
                self._left.setdefault((f.order, f.point), []).append(msgspec.structs.replace(f))

    @classmethod
    def from_env(cls, rank: int, epoch: int, environ=os.environ) -> FaultPlan:
        raw = environ.get(ENV)
        if not raw:
            return cls(rank, epoch, [])
        try:
            faults = msgspec.json.decode(raw, type=list[Fault])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ValueError(f"{ENV} is not a valid fault list: {e}") from e
        return cls(rank, epoch, faults)

    def hit(self, order: str, point: str) -> str | None:
        """Consume and return the action due at this point (``kill`` never returns)."""
        due = self._left.get((order, point))
        if not due:
            return None
        fault = due[0]
        fault.times -= 1
        if fault.times == 0:
            due.pop(0)
        if fault.mark:
            with open(fault.mark, "a") as f:
                f.write(f"{order} {point}\n")
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "raise":
            raise InjectedFault(f"injected at {point} {order}")
        return fault.action
