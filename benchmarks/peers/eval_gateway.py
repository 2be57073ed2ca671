"""The real SGLang model gateway (``smg``) as an evaluation peer: ``smg_cache_aware``.

Where the other peers are LMPool's reimplementations of a system's routing rule, this one
runs the system: ``world_size`` single-replica ``lmpool serve`` hosts, each with exactly the
engine settings a pool rank of the same run gets (block size, KV blocks, running sequences,
batched tokens, model length, dtype, device, eager mode), behind ``smg launch --policy
cache_aware`` with smg's defaults for everything that decides routing (``SMG_FLAGS``; the
other flags only bind addresses and quiet its log). The replay drives it through
``gateway_client.GatewayClient``, which has the pool's ``stream`` shape.

Placement: on CUDA host ``i`` sees only the GPU that pool rank ``i`` would use (rank
``i`` -> visible GPU ``i % gpus``), and under ``--mps`` every host inherits the daemon's
variables from this process, as the pool's workers do, so it gets the same share of SMs
(``mps.mps_daemon``). A host is its own process with its own control plane, so it sizes
nothing from its neighbours: its KV budget is the explicit ``--num-kv-blocks``.

Prompts reach the hosts as ``token_text`` codec text (the hosts load a codec copy of the
checkpoint: the same weights and configuration, another tokenizer), so the hosts run the
trace's exact token ids and smg's tree sees one character per token.

Invariants: every process started here is stopped (and waited for) before ``run_gateway``
returns or raises, the gateway first; a gateway that cannot run makes the policy
unavailable (``GatewayUnavailable``), never a failed suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.peers.gateway_client import GatewayClient
from benchmarks.peers.token_text import codec_checkpoint

from lmpool.protocol.spec import PR_SET_PDEATHSIG

# What decides smg's routing: its cache-aware policy with its own default thresholds.
SMG_FLAGS = ("--policy", "cache_aware")
STOP_WAIT_S = 60.0
_POLL_S = 0.2
SERVED_NAME = "model"


class GatewayUnavailable(Exception):
    pass


def smg_path() -> str:
    """The smg binary: beside this Python (the pip package's entry point), else on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else (shutil.which("smg") or "smg")


def smg_version() -> str:
    """``smg --version``'s output; raises ``GatewayUnavailable`` when the binary cannot run."""
    try:
        done = subprocess.run([smg_path(), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise GatewayUnavailable(f"the smg binary cannot run: {type(e).__name__}: {e}") from e
    if done.returncode != 0:
        raise GatewayUnavailable(f"smg --version exited {done.returncode}: {done.stderr.strip()[:300]}")
    return done.stdout.strip()


def gateway_record() -> dict:
    """What the policy's JSON says of the gateway (its version, or why it cannot run)."""
    try:
        version = smg_version()
    except GatewayUnavailable as e:
        version, error = None, str(e)
    else:
        error = None
    return {"binary": "smg", "version": version, "flags": list(SMG_FLAGS), "error": error}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_args(args, setting, max_model_len: int) -> list[str]:
    """The engine flags of one host: those ``eval_suite.engine_args`` gives a pool rank."""
    out = ["--world-size", "1", "--block-size", str(args.block_size), "--num-kv-blocks", str(setting.kv_blocks),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(max_model_len)]
    if args.dtype:
        out += ["--dtype", args.dtype]
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.cascade_min_saved_tokens is not None:
        out += ["--cascade-min-saved-tokens", str(args.cascade_min_saved_tokens)]
    if args.prefill_attention is not None:
        out += ["--prefill-attention", args.prefill_attention]
    if args.piecewise_graph_max_tokens is not None:
        out += ["--piecewise-graph-max-tokens", str(args.piecewise_graph_max_tokens)]
    return out


def visible_gpus() -> list[str]:
    """This process's GPUs as its children number them (without initialising CUDA here)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # under --mps, already renumbered for the daemon
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return [str(i) for i in range(len(listed.splitlines()))]
    return []


def host_env(rank: int, device: str, gpus: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cuda":
        if not gpus:
            raise RuntimeError("no visible GPU for the gateway's hosts")
        env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]  # pool rank r runs on cuda:(r % gpus)
    return env


def _terminate_with_parent() -> None:
    """In a host or the gateway, before it runs: SIGTERM (a clean stop) when the suite dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``cmd`` as a child writing to ``log``: in its own session, so a terminal's Ctrl-C reaches
    the suite first, which then stops it; and sent SIGTERM when the suite itself dies unannounced
    (killed), so nothing outlives it."""
    with open(log, "wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_terminate_with_parent)


def stop_processes(procs: list[subprocess.Popen]) -> list[int]:
    """SIGTERM every one of ``procs`` (a graceful stop: a host shuts its pool down), then wait;
    SIGKILL whatever outlives ``STOP_WAIT_S``. Their exit codes, in order."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


class Processes:
    """The hosts and the gateway of one run; ``stop`` ends every one of them."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.hosts: list[subprocess.Popen] = []
        self.host_urls: list[str] = []
        self.gateway: subprocess.Popen | None = None
        self.gateway_url = ""

    def _spawn(self, cmd: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        return spawn(cmd, self.logs / f"{name}.log", env)

    def start_hosts(self, model: str, args, setting, max_model_len: int) -> None:
        gpus = visible_gpus() if args.device == "cuda" else []
        for rank in range(args.world_size):
            port = free_port()
            cmd = [sys.executable, "-m", "lmpool.cli", "serve", model, "--port", str(port), "--device", args.device,
                   "--served-model-name", SERVED_NAME, "--log-level", "warning",
                   *host_args(args, setting, max_model_len)]
            self.hosts.append(self._spawn(cmd, f"host-{rank}", host_env(rank, args.device, gpus)))
            self.host_urls.append(f"http://127.0.0.1:{port}")

    def start_gateway(self) -> None:
        port = free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        cmd = [smg_path(), "launch", *SMG_FLAGS, "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *self.host_urls, "--prometheus-host", "127.0.0.1", "--prometheus-port",
               str(free_port()), "--log-level", "warn"]
        self.gateway = self._spawn(cmd, "smg")

    def fingerprints(self) -> dict[str, int]:
        return {f"lmpool-{p.pid}": rank for rank, p in enumerate(self.hosts)}

    def log_tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.log").read_text(errors="replace")[-1500:]
        return ""

    def check_alive(self) -> None:
        for rank, p in enumerate(self.hosts):
            if p.poll() is not None:
                raise RuntimeError(f"host {rank} exited with {p.returncode}: {self.log_tail(f'host-{rank}')}")
        if self.gateway is not None and self.gateway.poll() is not None:
            raise RuntimeError(f"smg exited with {self.gateway.returncode}: {self.log_tail('smg')}")

    def stop(self) -> dict:
        """SIGTERM the gateway, then the hosts (a graceful stop shuts a host's pool down);
        SIGKILL whatever outlives ``STOP_WAIT_S``. Returns each process's exit code."""
        codes = {"smg": stop_processes([self.gateway])[0]} if self.gateway else {}
        codes.update((f"host-{i}", code) for i, code in enumerate(stop_processes(self.hosts)))
        return codes


async def wait_until(check, processes, limit_s: float, what: str) -> None:
    """Return once ``await check()`` holds; fail when one of ``processes`` died (its
    ``check_alive`` raises) or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while True:
        processes.check_alive()
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if await check():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {limit_s:g} s")
        await asyncio.sleep(_POLL_S)


async def start(processes: Processes, model: str, args, setting, max_model_len: int, limit_s: float) -> None:
    processes.start_hosts(model, args, setting, max_model_len)
    async with httpx.AsyncClient(timeout=10) as http:
        async def hosts_healthy() -> bool:
            codes = [(await http.get(f"{url}/health")).status_code for url in processes.host_urls]
            return all(c == 200 for c in codes)

        await wait_until(hosts_healthy, processes, limit_s, "the hosts' health")
        processes.start_gateway()

        async def all_registered() -> bool:
            ready = (await http.get(f"{processes.gateway_url}/readiness")).json()
            return ready.get("healthy_workers") == len(processes.hosts)

        # Every host must be registered and healthy before the first request, or the first
        # ones would all go to the hosts registered so far.
        await wait_until(all_registered, processes, limit_s, "smg's registration of every host")


async def run_gateway(model: str, args, trace, setting, max_model_len: int, replay, on_done) -> dict:
    """Start the hosts and smg, replay ``trace`` through them, stop everything; the run's
    record, shaped as ``eval_suite.run_one``'s. Raises ``GatewayUnavailable`` when smg cannot run."""
    from lmpool.model.config import ModelConfig
    from lmpool.tokenizer import load_tokenizer

    version = smg_version()
    record: dict = {"transfers": None, "rank_stats": [],
                    "gateway": {"binary": "smg", "version": version, "flags": list(SMG_FLAGS),
                                "prompts": "token_text codec (one character per token id)"}}
    with tempfile.TemporaryDirectory(prefix="lmpool-smg-") as tmp:
        codec = str(codec_checkpoint(model, Path(tmp) / "codec", ModelConfig.from_pretrained(model).vocab_size))
        (Path(tmp) / "logs").mkdir()
        processes = Processes(Path(tmp) / "logs")
        client = None
        try:
            started = time.perf_counter()
            await start(processes, codec, args, setting, max_model_len, min(300.0, max(60.0, args.run_timeout)))
            record["start_s"] = time.perf_counter() - started
            client = GatewayClient(processes.gateway_url, processes.host_urls, processes.fingerprints(),
                                   SERVED_NAME, load_tokenizer(codec))
            client.prepare(trace)
            async with asyncio.timeout(args.run_timeout):
                t = time.perf_counter()
                record["requests"] = await replay(client, trace, setting.arrival, on_done)
                record["replay_s"] = time.perf_counter() - t
            record["gateway"]["prompts_checked"] = client.checked
        finally:
            if client is not None:
                await client.aclose()
            record["gateway"]["exit_codes"] = processes.stop()
            # Which processes served (a host's fingerprint is ``lmpool-<pid>``), all stopped by now.
            record["gateway"]["pids"] = {"smg": processes.gateway.pid if processes.gateway else None,
                                         "hosts": [p.pid for p in processes.hosts]}
    return record
