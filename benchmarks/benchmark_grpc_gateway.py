"""smg in front of the same ``lmpool serve`` hosts over gRPC (it reads their KV events and loads)
and over HTTP (it routes by a prefix tree of the text it has routed itself), side by side.

The hosts start once (``--hosts``, each a pool of ``--world-size`` replicas with ``--grpc-port``),
and so do two gateways in front of them: ``smg launch --policy cache_aware`` with smg's defaults,
one given the hosts' ``grpc://`` URLs, one their ``http://`` URLs. Each repetition runs both
gateways in an order that alternates (ABBA over repetitions), each on documents of its own: every
document is first read on one host directly (host ``d % hosts``, never through a gateway, so only
KV events can tell a gateway where it is), and once the gRPC gateway has applied those blocks
from the hosts' streams (both modes wait the same), every question on every document is sent at
once through the gateway under test as a streamed completion (greedy, ``ignore_eos``).

Reported per run: requests/s and output tokens/s over the burst, TTFT (request sent to the first
chunk) and end-to-end time, the hosts' cached and computed prompt tokens over the burst (their
``lmpool:prefix_cache_hits`` and ``lmpool:prompt_tokens`` counters), the branches of smg's
cache-aware decision that routed the burst (``smg_cache_aware_policy_branch_total``), and the gRPC
gateway's stored blocks per host before the documents, once read and after the burst; then per
mode the mean, and the gRPC / HTTP ratios with the paired 95 % interval over repetitions.

    python -m benchmarks.benchmark_grpc_gateway --model DIR --device cuda --dtype bfloat16 --mps \\
        --json grpc_gateway.json

Invariants: every process started here (hosts, gateways, the MPS daemon) is stopped before the
run returns or raises; a request that fails is counted, never dropped from the record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.lib.prometheus import series_sum
from benchmarks.lib.revision import git_record
from benchmarks.peers.eval_gateway import free_port, smg_path, smg_version, spawn, stop_processes, wait_until
from benchmarks.stats.student_t import confidence_interval, mean, percentile
from lmpool.tokenizer import encode_prompt, load_tokenizer

SERVED_NAME = "model"
MODES = ("grpc", "http")
SMG_FLAGS = ("--policy", "cache_aware")  # smg's defaults for everything else that routes
WORDS = ("harbour tide lantern keeper ledger ship anchor rope sail gull storm coast reef beacon chart "
         "compass mast deck hull cargo port wind wave shore cliff lamp night watch signal bell").split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3 checkpoint directory with its tokenizer")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2, help="replicas per host")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per replica")
    p.add_argument("--mps", action="store_true", help="an MPS daemon: each replica gets 1/(hosts x world) of the SMs")
    p.add_argument("--documents", type=int, default=8, help="documents a repetition reads, per mode")
    p.add_argument("--document-tokens", type=int, default=4096)
    p.add_argument("--questions", type=int, default=16, help="questions per document")
    p.add_argument("--question-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=4, help="repetitions (even: the order balances)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one burst may take")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smg-flag", action="append", default=[], metavar="FLAG",
                   help="a flag for both gateways beyond smg's defaults (repeat; e.g. --smg-flag=--kv-index=chain)")
    p.add_argument("--logs", help="keep the hosts' and gateways' logs in this folder (default: discarded)")
    return p.parse_args(argv)


# -- the processes ---------------------------------------------------------------------------

class Fleet:
    """The hosts and the two gateways; ``stop`` ends every process (the gateways first)."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args, self.logs = args, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.http_urls: list[str] = []
        self.grpc_urls: list[str] = []
        self.gateways: dict[str, str] = {}
        self.gateway_metrics: dict[str, str] = {}

    def start_hosts(self) -> None:
        a = self.args
        for h in range(a.hosts):
            port, grpc_port = free_port(), free_port()
            cmd = [sys.executable, "-m", "lmpool.cli", "serve", a.model, "--port", str(port), "--grpc-port",
                   str(grpc_port), "--device", a.device, "--world-size", str(a.world_size), "--block-size",
                   str(a.block_size), "--num-kv-blocks", str(a.num_kv_blocks), "--served-model-name", SERVED_NAME,
                   "--max-model-len", str(a.document_tokens + 2 * a.question_tokens + a.max_tokens + a.block_size),
                   "--log-level", "warning", *(["--dtype", a.dtype] if a.dtype else [])]
            self.procs[f"host-{h}"] = spawn(cmd, self.logs / f"host-{h}.log")
            self.http_urls.append(f"http://127.0.0.1:{port}")
            self.grpc_urls.append(f"grpc://127.0.0.1:{grpc_port}")

    def start_gateways(self) -> None:
        for mode, workers in (("grpc", self.grpc_urls), ("http", self.http_urls)):
            port, metrics_port = free_port(), free_port()
            cmd = [smg_path(), "launch", *SMG_FLAGS, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                   *workers, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                   "--log-level", "warn", *self.args.smg_flag]
            self.procs[f"smg-{mode}"] = spawn(cmd, self.logs / f"smg-{mode}.log")
            self.gateways[mode] = f"http://127.0.0.1:{port}"
            self.gateway_metrics[mode] = f"http://127.0.0.1:{metrics_port}/metrics"

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with {p.returncode}: {tail}")

    def stop(self) -> dict:
        codes: dict[str, int] = {}
        for kind in ("smg", "host"):
            names = [n for n in self.procs if n.startswith(kind)]
            codes.update(zip(names, stop_processes([self.procs[n] for n in names])))
        return codes


async def start(fleet: Fleet, http: httpx.AsyncClient) -> None:
    fleet.start_hosts()

    async def hosts_healthy() -> bool:
        return all([(await http.get(f"{u}/health")).status_code == 200 for u in fleet.http_urls])

    await wait_until(hosts_healthy, fleet, fleet.args.start_timeout, "the hosts' health")
    fleet.start_gateways()
    for mode, url in fleet.gateways.items():
        async def registered(url=url) -> bool:
            ready = (await http.get(f"{url}/readiness")).json()
            return ready.get("healthy_workers") == len(fleet.http_urls)

        await wait_until(registered, fleet, fleet.args.start_timeout, f"the {mode} gateway's registration")


# -- reading counters ------------------------------------------------------------------------

async def host_counters(http: httpx.AsyncClient, fleet: Fleet) -> list[dict[str, float]]:
    out = []
    for url in fleet.http_urls:
        page = (await http.get(f"{url}/metrics")).text
        out.append({"prompt": series_sum(page, "lmpool:prompt_tokens_total"),
                    "cached": series_sum(page, "lmpool:prefix_cache_hits_total")})
    return out


async def gateway_page(http: httpx.AsyncClient, fleet: Fleet, mode: str) -> str:
    return (await http.get(fleet.gateway_metrics[mode])).text


def branches(page: str) -> dict[str, float]:
    """Requests by the branch of smg's cache-aware decision that routed them (every branch it names)."""
    out: dict[str, float] = {}
    for labels, value in re.findall(r'^smg_cache_aware_policy_branch_total\{([^}]*)\} (\S+)$', page, re.M):
        branch = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("branch", "?")
        out[branch] = out.get(branch, 0.0) + float(value)
    return out


# -- the workload ----------------------------------------------------------------------------

def text_of(tokenizer, rng: random.Random, tokens: int) -> str:
    """Random words cut to ``tokens`` tokens of ``tokenizer``."""
    words = " ".join(rng.choice(WORDS) for _ in range(tokens))
    return tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:tokens])


def workload(args, tokenizer, rep: int, mode: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The documents of one run and its questions ``(document, prompt)``, shuffled."""
    rng = random.Random(f"{args.seed}/{rep}/{mode}")
    docs = [f"Document {rep}-{mode}-{d}. " + text_of(tokenizer, rng, args.document_tokens)
            for d in range(args.documents)]
    questions = [(d, f"{doc}\nQuestion {q}: {text_of(tokenizer, rng, args.question_tokens)}")
                 for d, doc in enumerate(docs) for q in range(args.questions)]
    rng.shuffle(questions)
    return docs, questions


async def read_directly(http: httpx.AsyncClient, fleet: Fleet, docs: list[str]) -> list[int]:
    """Each document read on host ``d % hosts`` (not through a gateway); its prompt tokens."""
    async def one(d: int, doc: str) -> int:
        body = {"model": SERVED_NAME, "prompt": doc, "max_tokens": 1, "temperature": 0}
        out = (await http.post(f"{fleet.http_urls[d % len(fleet.http_urls)]}/v1/completions", json=body)).json()
        return out["usage"]["prompt_tokens"]

    return list(await asyncio.gather(*(one(d, doc) for d, doc in enumerate(docs))))


async def events_applied(http: httpx.AsyncClient, fleet: Fleet, before: list[float], blocks: list[int]) -> None:
    """Wait until the gRPC gateway has applied at least ``blocks[h]`` new stored blocks from host h."""
    async def applied() -> bool:
        page = await gateway_page(http, fleet, "grpc")
        return all(series_sum(page, "smg_kv_event_blocks_total", worker=url, op="stored") >= b0 + n
                   for url, b0, n in zip(fleet.grpc_urls, before, blocks))

    await wait_until(applied, fleet, 120.0, "the gRPC gateway's reading of the hosts' KV events")


async def stored_blocks(http: httpx.AsyncClient, fleet: Fleet) -> list[float]:
    page = await gateway_page(http, fleet, "grpc")
    return [series_sum(page, "smg_kv_event_blocks_total", worker=url, op="stored") for url in fleet.grpc_urls]


async def stream_one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion through a gateway: TTFT, end-to-end time, chunks with text."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    first, chunks, error = None, 0, None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or []
                    if choices and choices[0].get("text"):
                        first = first if first is not None else time.perf_counter() - sent
                        chunks += 1
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"ttft_s": first, "e2e_s": time.perf_counter() - sent, "chunks": chunks, "error": error}


# -- one run ---------------------------------------------------------------------------------

async def run_one(args, fleet: Fleet, http: httpx.AsyncClient, tokenizer, rep: int, mode: str) -> dict:
    docs, questions = workload(args, tokenizer, rep, mode)
    before_blocks = await stored_blocks(http, fleet)
    doc_tokens = await read_directly(http, fleet, docs)
    per_host = [sum(t // args.block_size for d, t in enumerate(doc_tokens) if d % args.hosts == h)
                for h in range(args.hosts)]
    await events_applied(http, fleet, before_blocks, per_host)
    applied = await stored_blocks(http, fleet)
    counters, page = await host_counters(http, fleet), await gateway_page(http, fleet, mode)
    started = time.perf_counter()
    async with asyncio.timeout(args.run_timeout):
        rows = await asyncio.gather(*(stream_one(http, fleet.gateways[mode], prompt, args.max_tokens)
                                      for _, prompt in questions))
    wall = time.perf_counter() - started
    sent = sum(len(encode_prompt(tokenizer, prompt)) for (_, prompt), r in zip(questions, rows) if r["error"] is None)
    after, complete = await counters_after(http, fleet, counters, sent)
    row = summarize_run(args, rep, mode, rows, wall, counters, after,
                        branches(await gateway_page(http, fleet, mode)), branches(page), doc_tokens)
    row["counters_complete"] = complete
    # The gRPC gateway's stored blocks per host: before the documents, once it had read them, after the burst.
    row["gateway_stored_blocks"] = {"before": before_blocks, "read": applied, "after": await stored_blocks(http, fleet),
                                    "expected": per_host}
    return row


async def counters_after(http: httpx.AsyncClient, fleet: Fleet, before: list[dict], sent: int) -> tuple[list, bool]:
    """The hosts' counters once they count the ``sent`` prompt tokens of a burst (a host's
    counters follow its replicas' reports, which trail their tokens); False if they never do."""
    latest = before

    async def counted() -> bool:
        nonlocal latest
        latest = await host_counters(http, fleet)
        return sum(a["prompt"] - b["prompt"] for a, b in zip(latest, before)) >= sent

    try:
        await wait_until(counted, fleet, 60.0, "the hosts' counters of the burst's prompt tokens")
    except TimeoutError:
        return latest, False
    return latest, True


async def warm_up(http: httpx.AsyncClient, fleet: Fleet, args) -> None:
    """A few untimed requests through each gateway (its first connections and tokenizer loads)."""
    for url in fleet.gateways.values():
        rows = await asyncio.gather(*(stream_one(http, url, f"Warm-up {i}: the keeper lit the lamp.", 4)
                                      for i in range(2 * args.hosts)))
        failed = [r["error"] for r in rows if r["error"] is not None or r["ttft_s"] is None]
        if failed:
            raise RuntimeError(f"the warm-up through {url} failed: {failed[:3]}")


def summarize_run(args, rep, mode, rows, wall, before, after, branches_after, branches_before, doc_tokens) -> dict:
    ok = [r for r in rows if r["error"] is None and r["ttft_s"] is not None]
    prompt = [a["prompt"] - b["prompt"] for a, b in zip(after, before)]
    cached = [a["cached"] - b["cached"] for a, b in zip(after, before)]
    ttft = [r["ttft_s"] for r in ok]
    return {
        "rep": rep, "mode": mode, "requests": len(rows), "failed": len(rows) - len(ok),
        "errors": sorted({r["error"] for r in rows if r["error"]})[:5],
        "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": len(ok) * args.max_tokens / wall,
        "ttft_mean_s": mean(ttft) if ttft else None, "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "e2e_mean_s": mean([r["e2e_s"] for r in ok]) if ok else None,
        "prompt_tokens_by_host": prompt, "cached_tokens_by_host": cached,
        "cached_fraction": sum(cached) / max(1.0, sum(prompt)),
        "document_tokens": doc_tokens,
        "gateway_branches": {b: n - branches_before.get(b, 0.0) for b, n in branches_after.items()
                                  if n > branches_before.get(b, 0.0)},
    }


# -- the whole run ---------------------------------------------------------------------------

def order(rep: int) -> tuple[str, ...]:
    """ABBA: the gRPC gateway first on repetitions 0, 3, 4, 7 ..."""
    return MODES if rep % 4 in (0, 3) else MODES[::-1]


def compare(runs: list[dict]) -> dict:
    """Per mode the mean of each metric; gRPC over HTTP as paired ratios with a 95 % interval."""
    metrics = ("requests_per_s", "output_tokens_per_s", "ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "cached_fraction")
    by = {(r["rep"], r["mode"]): r for r in runs}
    reps = sorted({r["rep"] for r in runs if all((r["rep"], m) in by for m in MODES)})
    out: dict = {"modes": {}, "grpc_over_http": {}}
    for mode in MODES:
        out["modes"][mode] = {m: mean([by[(k, mode)][m] for k in reps]) for m in metrics
                              if all(by[(k, mode)][m] is not None for k in reps)} if reps else {}
    for m in metrics:
        pairs = [(by[(k, "grpc")][m], by[(k, "http")][m]) for k in reps]
        if pairs and all(g is not None and h for g, h in pairs):
            out["grpc_over_http"][m] = confidence_interval([g / h for g, h in pairs])
    return out


async def run(args) -> dict:
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: smg's gRPC mode tokenizes with the host's")
    result: dict = {"benchmark": "grpc_gateway", "git": git_record(), "python": platform.python_version(),
                    "settings": {k: v for k, v in vars(args).items() if k != "json"},
                    "gateway": {"binary": smg_path(), "version": smg_version(), "flags": [*SMG_FLAGS, *args.smg_flag]},
                    "runs": []}
    with tempfile.TemporaryDirectory(prefix="lmpool-grpc-bench-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(args, logs)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(args.run_timeout, connect=30)) as http:
                t = time.perf_counter()
                await start(fleet, http)
                result["start_s"] = time.perf_counter() - t
                await warm_up(http, fleet, args)
                for rep in range(args.reps):
                    for mode in order(rep):
                        fleet.check_alive()
                        row = await run_one(args, fleet, http, tokenizer, rep, mode)
                        result["runs"].append(row)
                        print(line_of(row), flush=True)
                        save(args, result)  # a run cut short keeps the runs it finished
        finally:
            result["exit_codes"] = fleet.stop()
    result["summary"] = compare(result["runs"])
    return result


def line_of(r: dict) -> str:
    ttft = "-" if r["ttft_mean_s"] is None else f"{1e3 * r['ttft_mean_s']:8.1f} ms"
    return (f"rep {r['rep']} {r['mode']:4s}: {r['requests_per_s']:7.2f} req/s  TTFT {ttft}  "
            f"cached {r['cached_fraction']:.3f}  failed {r['failed']}  branches {r['gateway_branches']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mps:
        from benchmarks.device.mps import mps_daemon

        with mps_daemon(args.hosts * args.world_size) as info:
            result = asyncio.run(run(args))
            result["mps"] = info
    else:
        result = asyncio.run(run(args))
    print(json.dumps(result["summary"], indent=1))
    save(args, result)
    return 0


def save(args, result: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
