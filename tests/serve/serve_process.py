"""Starting ``lmpool serve`` as a real process on a loopback port, and stopping it; ``stop``
checks that the server left no pool process and no shared-memory object behind. Also raw HTTP/1.1
on a socket, for the tests that send requests no client library would."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from waiting import wait_until

from lmpool_ipc.lifecycle import pid_alive, sweep_dead_pools
from lmpool_ipc.names import SEM_FILE_PREFIX, parse_object

BLOCK = 16
PROMPT = "The harbour town woke slowly on winter mornings, and"
STARTUP_LIMIT_S = 300  # the server answers /health once its replicas have loaded the model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (each held until all are picked: ``free_port`` twice may repeat one)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ServerProcess:
    """One ``lmpool serve`` process; ``url`` is its base URL once ``wait_ready`` returns."""

    def __init__(self, model: str, *args: str, log: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lmpool.cli", "serve", model, "--port", str(self.port),
               "--block-size", str(BLOCK), "--log-level", "warning", *args]
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:  # fail at once, not at the deadline
                raise AssertionError(f"lmpool serve exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, "lmpool serve to become healthy", limit=STARTUP_LIMIT_S, interval=0.2,
                   show=self.log.read_text)

    def worker_pids(self) -> list[int]:
        return self.children(b"lmpool.worker.main")

    def worker_pid(self, rank: int) -> int:
        """The pid of the worker serving ``rank`` (its spec, in its environment, names the rank)."""
        for pid in self.worker_pids():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            spec = next(v for v in environ if v.startswith(b"LMPOOL_SPEC="))[len(b"LMPOOL_SPEC="):]
            if json.loads(spec).get("rank") == rank:
                return pid
        raise AssertionError(f"no live worker serves rank {rank}")

    def children(self, module: bytes = b"lmpool.") -> list[int]:
        """The server's live child processes running ``module`` (the pool's workers and control)."""
        return pool_children(self.proc.pid, module)

    def stop(self) -> None:
        """Stop the server gracefully; fail if its pool left a process or shared memory behind."""
        children = self.children() if self.proc.poll() is None else []
        terminate(self.proc, 60)  # a graceful stop shuts the pool down
        self._log_file.close()
        assert not [pid for pid in children if pid_alive(pid)], "a pool process outlived its server"
        left = owned_shm(self.proc.pid)
        assert not left, f"the server's pool left shared memory behind: {left}"


    def kill(self) -> None:
        """Kill the server as a crash would: its workers die with it (their parent-death
        signal), and its shared memory stays until a sweep, which a restart would run."""
        children = self.children()
        self.proc.kill()
        self.proc.wait()
        self._log_file.close()
        wait_until(lambda: not any(pid_alive(pid) for pid in children),
                   "every pool process to die with its killed server", limit=60, interval=0.05)
        sweep_dead_pools()
        assert not owned_shm(self.proc.pid)


def terminate(proc: subprocess.Popen, limit: float) -> None:
    """SIGTERM, and SIGKILL if ``proc`` has not exited ``limit`` seconds later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pool_children(parent: int, module: bytes = b"lmpool.") -> list[int]:
    """Live child processes of ``parent`` running ``module``: the pool processes it owns (other
    pools on the machine, whatever their command line, are not its children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().split(")")[-1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == parent and module in cmdline and stat[0] != "Z":
                pids.append(int(entry.name))
    return pids


def owned_shm(owner: int) -> list[str]:
    """The shared-memory objects of pools that ``owner`` started."""
    return [n for n in os.listdir("/dev/shm") if _owner(n) == owner]


def _owner(name: str) -> int | None:
    parsed = parse_object(name.removeprefix(SEM_FILE_PREFIX))
    return parsed.owner_pid if parsed else None


def start_server(model: str, tmp: Path, *args: str) -> ServerProcess:
    return start_servers(1, model, tmp, *args)[0]


@contextlib.contextmanager
def serving(model: str, tmp: Path, *args: str):
    """One server, ready, for the ``with`` block; stopped (and checked) after."""
    server = start_server(model, tmp, *args)
    try:
        yield server
    finally:
        server.stop()


def openai_client(server: ServerProcess) -> openai.OpenAI:
    """The official client for ``server``, retrying nothing (a test sees every failure)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def start_servers(n: int, model: str, tmp: Path, *args: str, grpc_ports: list[int] | None = None) -> list[ServerProcess]:
    """``n`` servers, started side by side, each ready (server i with ``--grpc-port grpc_ports[i]``,
    and an HTTP port distinct from them)."""
    extra = [("--grpc-port", str(port)) for port in grpc_ports] if grpc_ports else [()] * n
    ports = [p for p in free_ports(n + len(grpc_ports or ())) if p not in (grpc_ports or ())][:n]
    servers = [ServerProcess(model, *args, *extra[i], log=tmp / f"serve-{i}-{time.monotonic_ns()}.log",
                             port=ports[i]) for i in range(n)]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def wait_for(condition, what: str, limit: float = 60.0) -> None:
    """Return once ``condition()`` holds (a state to reach); fail naming ``what`` after ``limit`` s
    (the serve tests' ceiling unless a call names its own)."""
    wait_until(condition, what, limit=limit)


def metric(server: ServerProcess, name: str) -> float:
    """The sum of a metric's series on the server's /metrics page."""
    page = httpx.get(f"{server.url}/metrics", timeout=60).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", page, re.M))


def busy(server: ServerProcess) -> float:
    """Requests running or waiting on the server's ranks."""
    return metric(server, "lmpool:num_requests_running") + metric(server, "lmpool:num_requests_waiting")


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response (with a Content-Length, as every error body has) off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status = int(head.split()[1])
    headers = dict(line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed in the middle of a response"
        body += chunk
    return status, headers, body


def request_head(length: int | None = None, path: str = "/v1/completions") -> bytes:
    """A JSON POST's head: its body's length declared, or (None) chunked."""
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (path.encode(), framing)


def small_request() -> bytes:
    """A whole completion request of two tokens."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    return request_head(len(body)) + body


def smg_binary() -> str:
    """The smg gateway's binary (the dev extra installs it); the test skips where it cannot run."""
    path = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    try:
        subprocess.run([path, "--help"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the smg gateway binary cannot run here: {e}")
    return path
