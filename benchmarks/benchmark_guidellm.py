"""A running ``lmpool serve`` under GuideLLM (vLLM's own load generator), profile by profile.

GuideLLM is run as its users run it, from its command line (it pins its own torch, so it lives
in a virtual environment of its own: ``python -m venv gl && gl/bin/pip install guidellm``);
this script only chooses the profiles, collects each run's JSON report and keeps, per profile,
what a reader compares: requests completed / errored / incomplete, and the medians of TTFT,
inter-token latency, request latency and output tokens/s. Synthetic text prompts of
``--prompt-tokens`` tokens with ``--output-tokens`` to generate, ``--requests`` per profile.

    lmpool serve DIR --world-size 2 --device cpu --port 8000 &
    python -m benchmarks.benchmark_guidellm --url http://127.0.0.1:8000 --guidellm gl/bin/guidellm \\
        --profiles concurrent:4,poisson:6 --json guidellm.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.lib.revision import git_record

# GuideLLM's profile kinds and the field that takes the number after the colon.
PROFILE_FIELDS = {"concurrent": "streams", "poisson": "rate", "constant": "rate", "synchronous": None}
KEPT = ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency", "output_tokens_per_second")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--guidellm", default="guidellm", help="GuideLLM's command (its virtual environment's)")
    p.add_argument("--profiles", default="concurrent:4,poisson:6",
                   help="comma-separated KIND[:N]: concurrent:STREAMS, poisson:RATE, constant:RATE, synchronous")
    p.add_argument("--requests", type=int, default=48, help="requests per profile")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--json", help="write the summary here")
    return p.parse_args(argv)


def profile_arg(spec: str) -> str:
    """``concurrent:4`` -> GuideLLM's ``kind=concurrent,streams=4``."""
    kind, _, number = spec.partition(":")
    if kind not in PROFILE_FIELDS:
        raise SystemExit(f"unknown profile {kind!r}; choose from {', '.join(PROFILE_FIELDS)}")
    field = PROFILE_FIELDS[kind]
    if (field is None) != (not number):
        raise SystemExit(f"profile {kind!r} takes {'no number' if field is None else field + ' after a colon'}")
    return f"kind={kind}" + (f",{field}={number}" if field else "")


def run_profile(args: argparse.Namespace, spec: str, report: Path) -> dict:
    """One GuideLLM run; its report's totals and medians."""
    command = [args.guidellm, "run", "--backend", f"kind=openai_http,target={args.url}",
               "--profile", profile_arg(spec), "--constraint", f"kind=max_requests,count={args.requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    return {"profile": spec, "requests": metrics["request_totals"],
            **{name: metrics[name]["successful"]["median"] for name in KEPT}}


def guidellm_version(command: str) -> str:
    return subprocess.run([command, "--version"], check=True, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for i, spec in enumerate(args.profiles.split(",")):
            rows.append(run_profile(args, spec, Path(tmp) / f"report{i}.json"))
            print(json.dumps(rows[-1]), flush=True)
    data = {"benchmark": "guidellm", "url": args.url, "guidellm": guidellm_version(args.guidellm),
            "requests_per_profile": args.requests, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "revision": git_record(), "profiles": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
