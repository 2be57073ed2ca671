"""``lmpool top [POOL]``: a live view of one pool, like ``top`` for a server.

One row per rank (queue, KV blocks as a used/reclaimable/free bar, prefix hit rate,
the decode step its running batch takes by the control plane's fit of its step time,
tokens/s with a sparkline, blocks in flight and leases, heartbeat age, worker pid and
epoch) under a header with the control plane's route-decision latency, route queries/s and
the pool's uptime. It draws with curses, so it works in any terminal, over SSH too; with a
non-UTF-8 terminal (or ``--ascii``) bars and sparklines use ASCII. ``--once`` prints one
plain-text frame and exits, for scripts.

Keys: ``q`` quits, ``s`` cycles the sort column (``1``-``6`` pick one), ``p`` pauses.

Exit status: 0 when the pool was alive; 1, with a message saying why, when there is no
such pool or it is dead (a dead pool stays on screen, marked DEAD, until ``q``).
"""

from __future__ import annotations

import argparse
import curses
import locale
import os
import sys
import time
from datetime import datetime

import posix_ipc

from lmpool.protocol.state_board import PUBLISH_INTERVAL_S
from lmpool_ipc import RingCorruptError
from lmpool_tools.monitor import STALE_S, PoolMonitor, PoolNotFound, PoolView, RankView, find_pool

UNICODE_GLYPHS = {"used": "█", "reclaimable": "▒", "free": "·", "spark": "▁▂▃▄▅▆▇█"}
ASCII_GLYPHS = {"used": "#", "reclaimable": "+", "free": ".", "spark": "_.-:=+*#"}

# (title, key, largest first?)
SORTS = [
    ("rank", lambda r: r.row.rank, False),
    ("waiting", lambda r: r.row.num_waiting, True),
    ("running", lambda r: r.row.num_running, True),
    ("kv used", lambda r: r.row.blocks_used, True),
    ("hit%", lambda r: r.hit_rate or 0.0, True),
    ("tok/s", lambda r: r.tokens_per_s, True),
]

# Column titles and widths around the two stretchy columns (the KV bar and the trend).
LEFT = [("RANK", 4), ("PID", 8), ("EPOCH", 5), ("STATE", 5), ("BEAT", 6), ("WAIT", 5), ("RUN", 5)]
RIGHT = [("USED", 6), ("RECL", 6), ("FREE", 6), ("HIT%", 6), ("STEP", 7), ("XFER", 5), ("LEASE", 5), ("TOK/S", 8)]
MIN_BAR = 10


def bar(used: int, reclaimable: int, free: int, width: int, glyphs: dict) -> str:
    total = used + reclaimable + free
    if total == 0 or width <= 0:
        return glyphs["free"] * max(width, 0)
    n_used = round(width * used / total)
    n_recl = round(width * (used + reclaimable) / total) - n_used
    return glyphs["used"] * n_used + glyphs["reclaimable"] * n_recl + glyphs["free"] * (width - n_used - n_recl)


def sparkline(values, width: int, glyphs: dict) -> str:
    values = list(values)[-width:] if width > 0 else []
    top = max(values, default=0.0)
    levels = glyphs["spark"]
    if top <= 0:
        return levels[0] * len(values)
    return "".join(levels[min(len(levels) - 1, int(v / top * len(levels)))] for v in values)


def duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def frame(
    view: PoolView, width: int, sort: int = 0, paused: bool = False, glyphs: dict = UNICODE_GLYPHS, keys: bool = True
) -> list[tuple[str, str]]:
    """The screen as (text, style) lines, style one of "title", "dead", "header", "row",
    "dead-row", "plain"; each line fits ``width``. ``keys``: show the key help line."""
    state = view.state
    status = {"alive": "ALIVE", "starting": "STARTING", "dead": "DEAD"}[view.verdict]
    title = f"lmpool top  pool {view.pool_id}  {status}"
    if paused:
        title += "  (paused)"
    lines = []
    if state is None:
        lines.append((f"{title}  owner {view.owner_pid}  waiting for the control plane's first publish", "title"))
    else:
        alive = sum(r.alive for r in view.ranks)
        end = state.published_at if view.verdict == "dead" else time.time()
        lines.append((
            f"{title}  owner {state.owner_pid}  control {state.control_pid}  ranks {alive}/{state.world_size} alive"
            f"  up {duration(end - state.started_at)}  {datetime.now():%H:%M:%S}",
            "title",
        ))
        trend_width = max(0, min(30, width - 110))  # what the line's ~110 other characters leave
        lines.append((
            f"route p50 {state.route_p50_us:.1f} us  p99 {state.route_p99_us:.1f} us  {view.route_qps:.1f} q/s"
            f" ({state.route_queries} total)   tokens/s {view.tokens_per_s:.1f} "
            f"{sparkline(view.trend, trend_width, glyphs)}  prefix hit {percent(view.hit_rate)}"
            f"  updated {view.age_s:.1f} s ago",
            "plain",
        ))
    if view.verdict == "dead":
        lines.append((f"DEAD: {view.reason}", "dead"))
    elif keys:
        picks = " ".join(f"{i + 1}:{s[0]}" for i, s in enumerate(SORTS))
        lines.append((f"sort by {SORTS[sort][0]}   keys: s next sort, {picks}, p pause, q quit", "plain"))
    if state is None:
        return [(text[: width - 1], style) for text, style in lines]

    fixed = sum(w + 1 for _, w in LEFT + RIGHT)
    stretch = max(width - 1 - fixed - 2, MIN_BAR)
    bar_width = max(MIN_BAR, min(40, stretch // 2))
    trend_width = max(0, stretch - bar_width - 1)
    header = " ".join(f"{t:>{w}}" for t, w in LEFT)
    header += " " + f"{'KV used/reclaimable/free':<{bar_width + 2}}"
    header += " " + " ".join(f"{t:>{w}}" for t, w in RIGHT) + " TREND"
    lines.append((header, "header"))
    _, key, largest_first = SORTS[sort]
    for rv in sorted(view.ranks, key=key, reverse=largest_first):
        lines.append((row_text(rv, bar_width, trend_width, glyphs), "row" if rv.alive else "dead-row"))
    lines.append((
        f"KV: {glyphs['used']} used  {glyphs['reclaimable']} reclaimable (cached, unreferenced)  "
        f"{glyphs['free']} free    STEP: its batch's decode step (fitted)    XFER: blocks in flight to the rank",
        "plain",
    ))
    return [(text[: width - 1], style) for text, style in lines]


def row_text(rv: RankView, bar_width: int, trend_width: int, glyphs: dict) -> str:
    r = rv.row
    beat = f"{r.heartbeat_age_s:.1f}s" if rv.alive and r.heartbeat_age_s >= 0 else "-"

    def now(value):  # a dead rank's present figures are its last report: stale, not shown
        return value if rv.alive else "-"

    left = [r.rank, r.pid, r.epoch, "alive" if rv.alive else "dead", beat, now(r.num_waiting), now(r.num_running)]
    right = [now(r.blocks_used), now(r.blocks_reclaimable), now(r.blocks_free), percent(rv.hit_rate),
             now(f"{r.step_ms:.1f}ms"), now(r.blocks_in_flight), now(r.leases), f"{rv.tokens_per_s:.1f}"]
    text = " ".join(f"{v:>{w}}" for v, (_, w) in zip(left, LEFT))
    blocks = (r.blocks_used, r.blocks_reclaimable, r.blocks_free) if rv.alive else (0, 0, 0)
    text += " [" + bar(*blocks, bar_width, glyphs) + "]"
    text += " " + " ".join(f"{v:>{w}}" for v, (_, w) in zip(right, RIGHT))
    return text + " " + sparkline(rv.trend, trend_width, glyphs)


# ---- the live screen ---------------------------------------------------------------------


def live(monitor: PoolMonitor, interval: float, glyphs: dict) -> PoolView:
    """Run the curses screen until ``q``; return the last view."""
    # Size the screen by the terminal, not by LINES/COLUMNS in the environment: those are
    # often stale exports (GNU readline sets them in every process that loads it), and
    # ncurses would believe them over the terminal.
    os.environ.pop("LINES", None)
    os.environ.pop("COLUMNS", None)
    return curses.wrapper(_screen, monitor, interval, glyphs)


def _screen(scr, monitor: PoolMonitor, interval: float, glyphs: dict) -> PoolView:
    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide the cursor
    styles = {"title": curses.A_BOLD, "header": curses.A_REVERSE, "dead": curses.A_BOLD, "dead-row": curses.A_DIM}
    if curses.has_colors():
        curses.use_default_colors()
        curses.init_pair(1, curses.COLOR_RED, -1)
        styles["dead"] |= curses.color_pair(1)
        styles["dead-row"] = curses.color_pair(1)
    scr.timeout(int(interval * 1000))
    sort, paused = 0, False
    view = monitor.sample()
    while True:
        if not paused:
            view = monitor.sample()
        height, width = scr.getmaxyx()
        scr.erase()
        for y, (text, style) in enumerate(frame(view, width, sort, paused, glyphs)[:height]):
            try:
                scr.addstr(y, 0, text, styles.get(style, curses.A_NORMAL))
            except curses.error:
                pass  # the bottom-right cell of a tiny terminal
        scr.refresh()
        key = scr.getch()  # waits up to ``interval``: the refresh rate
        if key in (ord("q"), ord("Q")):
            return view
        if key == ord("s"):
            sort = (sort + 1) % len(SORTS)
        elif ord("1") <= key < ord("1") + len(SORTS):
            sort = key - ord("1")
        elif key == ord("p"):
            paused = not paused


# ---- command line --------------------------------------------------------------------------


def once(monitor: PoolMonitor, glyphs: dict) -> PoolView:
    """A view over two publishes (rates need two), or the first view if no second one comes."""
    first = monitor.sample()
    deadline = time.monotonic() + STALE_S + PUBLISH_INTERVAL_S
    view = first
    while view.verdict != "dead" and time.monotonic() < deadline:
        time.sleep(PUBLISH_INTERVAL_S / 4)  # bounded poll for the next publish
        view = monitor.sample()
        if first.state is not None and view.state is not None and view.state.monotonic != first.state.monotonic:
            break
    for text, _ in frame(view, 200, glyphs=glyphs, keys=False):
        print(text)
    return view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmpool top", description="Watch an LMPool pool live.")
    parser.add_argument("pool", nargs="?", help="pool id or a unique prefix of it (default: the one running pool)")
    parser.add_argument("--once", action="store_true", help="print one plain-text frame and exit")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes (default 0.5)")
    parser.add_argument("--ascii", action="store_true", help="draw bars and sparklines with ASCII only")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        pool_id, board = find_pool(args.pool)
        monitor = PoolMonitor(pool_id, board)
    except PoolNotFound as e:
        print(f"lmpool top: {e}", file=sys.stderr)
        return 1
    except (PermissionError, posix_ipc.PermissionsError):
        print(f"lmpool top: pool {args.pool} belongs to another user", file=sys.stderr)
        return 1
    except (RingCorruptError, ValueError, OSError, posix_ipc.Error) as e:  # planted, or gone meanwhile
        print(f"lmpool top: pool {args.pool} has no readable state board: {e}", file=sys.stderr)
        return 1
    try:
        if args.once:
            utf8 = "utf" in (sys.stdout.encoding or "").lower()
            view = once(monitor, ASCII_GLYPHS if args.ascii or not utf8 else UNICODE_GLYPHS)
        else:
            view = monitor.sample()
            if view.verdict != "dead":
                locale.setlocale(locale.LC_ALL, "")
                utf8 = "utf" in locale.getpreferredencoding(False).lower()
                view = live(monitor, args.interval, ASCII_GLYPHS if args.ascii or not utf8 else UNICODE_GLYPHS)
    finally:
        monitor.close()
    if view.verdict == "dead":
        print(f"lmpool top: pool {pool_id} is dead: {view.reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
