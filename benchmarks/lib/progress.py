"""Progress bars for the benchmarks that run longer than a few seconds.

``bar(total, desc, unit)`` is a tqdm bar on stderr (stdout keeps the results a benchmark prints;
``write`` prints a line there without breaking the bar),
redrawn at most twice a second on a terminal and every ten seconds into a log, or a bar that
draws nothing when the run asked for none (``--no-progress``). A bar's updates cost a counter
and a clock read, so a timed loop may update one per step.
"""

from __future__ import annotations

import sys


class NoBar:
    """What a bar offers, drawing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str, file=None) -> None:
        """A line printed above the bar (tqdm's ``write``; here, just printed)."""
        print(text, file=file or sys.stdout, flush=True)

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc) -> None:
        pass


def bar(total: int, desc: str, unit: str = "it", enabled: bool = True):
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 10.0)


def add_argument(parser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
