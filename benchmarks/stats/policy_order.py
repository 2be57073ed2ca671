"""The order in which a repetition runs its policies.

``williams`` (the default) takes row ``rep`` of a Williams design, so position and carry-over
(whatever one run leaves behind: a hot GPU, a busy host) are balanced across repetitions;
``fixed`` runs the policies as listed in every repetition, and is only for reproducing old
results. Invariant: every order is a permutation of the policies given.
"""

from __future__ import annotations

from typing import TypeVar

ORDERS = ("williams", "fixed")
T = TypeVar("T")


def run_order(policies: list[T], rep: int) -> list[T]:
    """The order of ``policies`` in repetition ``rep``: a row of a Williams design. With n
    policies, each block of n repetitions (from a multiple of n) runs every policy once in
    every position; for even n it also runs every policy right after every other one once,
    for odd n two blocks do (one of shifted rows, one mirrored: each ordered pair twice).
    A plain rotation balanced positions but kept every policy behind the same neighbour in
    every repetition, so whatever one run leaves behind always fell on the same next
    policy; the transfer benchmark's rotation biased its default path so
    (results/kv_transfer_NOTES.md)."""
    n = len(policies)
    if n == 0:
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...: consecutive steps take every nonzero shift
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    if n % 2 and (rep // n) % 2:
        first.reverse()
    return [policies[(k + rep) % n] for k in first]


def policy_order(policies: list[T], rep: int, order: str) -> list[T]:
    if order == "fixed":
        return list(policies)
    if order == "williams":
        return run_order(policies, rep)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def balanced_repetitions(n_policies: int) -> int:
    """Repetitions of one complete design: every policy in every position, every ordered
    pair back to back equally often (n for even n, 2n for odd n; 1 for a single policy)."""
    if n_policies <= 1:
        return 1
    return n_policies if n_policies % 2 == 0 else 2 * n_policies
