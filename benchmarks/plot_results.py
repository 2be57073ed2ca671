"""Draw every figure of the evaluation from its JSON files, and nothing else.

    python -m benchmarks.plot_results                       # every benchmarks/results/eval_*.json
    python -m benchmarks.plot_results path/to/run.json ...  # chosen files

For each ``kv_routing`` JSON, ``<name>.png``: headline metrics per locality level, one bar
per policy. For each ``e2e`` or ``hot_context`` JSON, ``<name>_<workload>.png`` per workload: headline
metrics, the last phase's TTFT, transfer counters (with the refusals: foreground
requests refused, admission-gate refusals, background candidates refused by any gate)
and requests per rank, one bar per policy. Bars are means over completed repetitions;
error bars are the two-sided 95% Student-t intervals stored in the JSON, or computed
the same way from the runs' counters (none with a single repetition). A suite that
stopped early says so in the title. Figures are written next to their JSON; the JSON
is the only input, so they regenerate exactly.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import matplotlib
from PIL import Image

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


from benchmarks.stats.student_t import confidence_interval

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# A figure's colours, at most: the policies' and the axes'. A palette PNG is about a third of the
# full-colour one, and the figures travel with every device call's copy of the tree.
PALETTE_COLORS = 128
HEADLINE = (
    ("throughput_tok_s", "throughput (output tok/s)"),
    ("ttft_mean_ms", "mean TTFT (ms)"),
    ("ttft_p99_ms", "p99 TTFT (ms)"),
    ("e2e_mean_ms", "mean E2E latency (ms)"),
    ("tpot_mean_ms", "mean TPOT (ms)"),
    ("dp_tok_reuse", "DP tok reuse"),
)
# The pool's ``transfers`` counters drawn per run; a dict counter (refusals per gate) is summed.
TRANSFERS = ("plans_committed", "blocks_copied", "blocks_moved", "lease_routed", "foreground_refused",
             "admission_refused", "placement_refused")


def _policies(data: dict) -> list[str]:
    return list(data["policies"])


def _bars(ax, groups: list[str], policies: list[str], cell) -> None:
    """Grouped bars: ``cell(group, policy)`` gives a summary entry (or None)."""
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        xs, ys, errs = [], [], []
        for g, group in enumerate(groups):
            entry = cell(group, policy)
            if entry is None:
                continue
            xs.append(g + (i - (len(policies) - 1) / 2) * width)
            ys.append(entry["mean"])
            errs.append(entry["half_width"])
        # A single repetition has no interval: no error bar rather than a zero-width one.
        yerr = [e or 0.0 for e in errs] if any(e is not None for e in errs) else None
        ax.bar(xs, ys, width, yerr=yerr, capsize=2, label=policy)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def _title(data: dict) -> str:
    meta = data["metadata"]
    cfg, model = meta["config"], meta["model"]
    name = model.get("preset") or model["name"]
    reps = len({r["rep"] for r in data["runs"] if r["status"] == "ok"})
    gpus = meta["hardware"].get("gpus")
    where = gpus[0].split(",")[0] if gpus else f"{meta['hardware']['machine']} CPU"
    text = (f"{data['benchmark']}: {name}, {cfg['world_size']} replicas on {where}, {cfg['block_size']}-token blocks, "
            f"{_setting_text(cfg)}, scale {cfg['scale']:g}, "
            + (f"{reps} reps, 95% t-CI" if reps > 1 else "1 rep (no CI)"))
    missing = [f"{p} ({s['status']})" for p, s in data["policies"].items() if s["status"] != "ok"]
    if data.get("stopped_early"):
        text += f"\nstopped early: {data['stopped_early']}"
    return text + (f"\nnot run: {', '.join(missing)}" if missing else "")


def _setting_text(cfg: dict) -> str:
    """Budget, arrivals and order, as every headline states them (older results: no order recorded)."""
    order = f"{cfg['order']} order" if cfg.get("order") else "order not recorded"
    if cfg.get("sweep"):
        return "sweep " + " ".join(cfg["sweep"]) + f", {order}"
    arrival = "closed loop" if cfg.get("arrival", "window") == "window" else f"Poisson {cfg['rate']:g}/s"
    return (f"{cfg['num_kv_blocks']} blocks/worker, window {cfg.get('window', 16) or 'unlimited'}, {arrival}, "
            f"{order}")


def _level(workload: str) -> int:
    name = workload.split("@", 1)[0]
    return int(name.split("_")[1][:-1]) if name.startswith("locality_") else 0


def plot_routing(data: dict, out: Path) -> list[Path]:
    summary = data.get("summary", {})
    levels = sorted(summary, key=_level)
    policies = [p for p in _policies(data) if any(p in summary[w] for w in levels)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    # Locality levels by their length ("3x"); a --trace file's workload by its own name.
    groups = {w.removeprefix("locality_"): w for w in levels}
    for ax, (metric, label) in zip(axes.flat, HEADLINE):
        _bars(ax, list(groups), policies, lambda g, p, m=metric: summary.get(groups[g], {}).get(p, {}).get(m))
        ax.set_title(label)
        ax.set_xlabel("shared-prefix length" if all(w.startswith("locality_") for w in levels) else "workload")
    _legend(fig, axes.flat[0])
    profile = data["metadata"]["dataset_profile"]
    shares = ", ".join(f"{w.removeprefix('locality_')}: {100 * profile[w]['trace_req_share']:.2f}% req / "
                       f"{100 * profile[w]['trace_tok_share']:.2f}% tok" for w in levels if w in profile)
    fig.suptitle(_title(data) + f"\ntrace share {shares}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = out.with_suffix(".png")
    save(fig, path)
    return [path]


def _last_phase(profile: dict) -> str | None:
    phases = list(profile.get("phases", {}))
    return phases[-1] if len(phases) > 1 else None


def plot_e2e(data: dict, out: Path) -> list[Path]:
    summary = data.get("summary", {})
    paths = []
    for workload, by_policy in sorted(summary.items()):
        policies = [p for p in _policies(data) if p in by_policy]
        profile = data["metadata"]["dataset_profile"].get(workload, {})
        fig, axes = plt.subplots(2, 4, figsize=(19, 8))
        panels = list(HEADLINE[:2]) + list(HEADLINE[3:])
        phase = _last_phase(profile)
        if phase:
            panels.append((f"{phase}/ttft_mean_ms", f"mean TTFT, {phase} phase (ms)"))
        for ax, (metric, label) in zip(axes.flat, panels):
            _bars(ax, [""], policies, lambda g, p, m=metric: by_policy.get(p, {}).get(m))
            ax.set_xticks([])
            ax.set_title(label)
        _legend(fig, axes.flat[0])
        ax = axes.flat[len(panels)]
        _bars(ax, list(TRANSFERS), policies, lambda g, p: _counter(data, workload, p, g))
        counted = [(_counter(data, workload, p, g) or {}).get("mean") for p in policies for g in TRANSFERS]
        if not any(counted):
            ax.text(0.5, 0.5, "none reported" if all(c is None for c in counted) else "all zero",
                    transform=ax.transAxes, ha="center")
        ax.set_title("transfers and refusals per run")
        ax.set_xticks(range(len(TRANSFERS)), [t.replace("_", "\n", 1) for t in TRANSFERS])
        ax.tick_params(axis="x", labelsize=6)
        ax = axes.flat[len(panels) + 1]
        _rank_load(ax, data, workload, policies)
        for extra in axes.flat[len(panels) + 2:]:
            extra.axis("off")
        share = ""
        if profile:
            share = (f"trace share {100 * profile['trace_req_share']:.2f}% req / "
                     f"{100 * profile['trace_tok_share']:.2f}% tok")
        fig.suptitle(f"{workload} - {_title(data)}\n{share}", fontsize=10)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        path = out.with_name(f"{out.stem}_{workload}.png")
        save(fig, path)
        paths.append(path)
    return paths


def _counter(data: dict, workload: str, policy: str, key: str) -> dict | None:
    """A ``transfers`` counter over the policy's completed runs, as a summary entry; None
    where no run reported it (never read as zero)."""
    values = []
    for run in data["runs"]:
        if run["workload"] != workload or run["policy"] != policy or run["status"] != "ok":
            continue
        value = (run.get("transfers") or {}).get(key)
        if value is not None:
            values.append(sum(value.values()) if isinstance(value, dict) else value)
    return confidence_interval(values) if values else None


def save(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` as a palette PNG (``PALETTE_COLORS``), and close it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110)
    plt.close(fig)
    buffer.seek(0)
    compact(Image.open(buffer)).save(path, optimize=True)


def compact(image: Image.Image) -> Image.Image:
    """``image`` as a palette image of at most ``PALETTE_COLORS`` colours."""
    return image.convert("RGB").quantize(colors=PALETTE_COLORS, method=Image.Quantize.MEDIANCUT)


def _legend(fig, ax) -> None:
    """One legend for the whole figure, below the panels, where it hides no bar."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)


def _rank_load(ax, data: dict, workload: str, policies: list[str]) -> None:
    """Requests served per rank, averaged over completed repetitions, stacked per policy."""
    world = data["metadata"]["config"]["world_size"]
    bottoms = [0.0] * len(policies)
    for rank in range(world):
        heights = []
        for policy in policies:
            counts = [r["metrics"]["rank_requests"][rank] for r in data["runs"]
                      if r["workload"] == workload and r["policy"] == policy and r["status"] == "ok"]
            heights.append(sum(counts) / len(counts) if counts else 0.0)
        ax.bar(range(len(policies)), heights, bottom=bottoms, label=f"rank {rank}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(policies)), policies, rotation=30, ha="right", fontsize=7)
    ax.set_title("requests per rank")
    ax.legend(fontsize=7)


def plot_file(path: Path) -> list[Path]:
    data = json.loads(path.read_text())
    kind = data.get("benchmark")
    if kind == "kv_routing":
        return plot_routing(data, path)
    if kind in ("e2e", "hot_context"):
        return plot_e2e(data, path)
    raise ValueError(f"{path}: not an evaluation JSON (benchmark {kind!r})")


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="evaluation JSON files (default: results/eval_*.json)")
    args = ap.parse_args(argv)
    files = args.files or sorted(RESULTS_DIR.glob("eval_*.json"))
    if not files:
        raise SystemExit("no evaluation JSON found")
    written = []
    for f in files:
        for p in plot_file(f):
            print(f"saved figure: {p}")
            written.append(p)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
