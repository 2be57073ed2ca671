"""The transfer rendezvous: a torch store on an abstract Unix socket that serves only its own
user's processes (another user's connection is closed before a byte of it is read, and its
requests change nothing), with the semantics of a torch store (blocking gets and waits that
time out, counters, compare-and-set, deletes) for every client, gloo's process groups
included; closing it fails its clients' calls at once."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading

import msgspec
import pytest
import torch.distributed as dist

from lmpool.dataplane.rendezvous import open_store
from lmpool.frontend.rendezvous import Rendezvous
from lmpool.protocol.rendezvous import Set, parse_address
from lmpool.dataplane.transport import TransportError

NOBODY = 65534

# Another user's process: connects to the pool's socket, sends a valid request, and reports
# what it got back ("" when the server closed the connection unread).
INTRUDER = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect("\\0" + sys.argv[1])
frame = sys.stdin.buffer.read()
try:
    s.sendall(struct.pack("!I", len(frame)) + frame)
    got = s.recv(4096)
except OSError as e:
    got = b""
print(got.hex())
"""


@pytest.fixture
def rz():
    rz = Rendezvous.create()
    yield rz
    rz.close()


def test_the_address_names_an_abstract_socket_and_no_file(rz):
    name = parse_address(rz.address)
    assert rz.address == f"unix:@{name}" and len(name.rsplit("-", 1)[1]) == 32
    assert "@" + name in open("/proc/net/unix").read()  # abstract: listed with @, no path on disk
    assert name != parse_address(Rendezvous.create().address)
    with pytest.raises(ValueError, match="unix:@lmpool-rendezvous-KEY"):
        parse_address("tcp://127.0.0.1:5/abc")


def python_for_nobody() -> str | None:
    """A Python interpreter the user nobody may run (root's own may sit in a private home)."""
    if os.getuid() != 0:
        return None
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run([candidate, "-c", "pass"], user=NOBODY, group=NOBODY, capture_output=True,
                                   timeout=60)
        except OSError:  # absent, or not executable by nobody
            continue
        if probe.returncode == 0:
            return candidate
    return None


def test_another_user_s_process_is_refused_and_changes_nothing(rz):
    python = python_for_nobody()
    if python is None:
        pytest.skip("needs root and a Python the user nobody can run, to run a process as another user")
    request = msgspec.msgpack.encode(Set("rank0", b"forged"))
    run = subprocess.run([python, "-c", INTRUDER, parse_address(rz.address)], input=request,
                         capture_output=True, user=NOBODY, group=NOBODY, timeout=60, check=True)
    assert run.stdout.strip() == b"", "the server answered another user's process"
    assert rz.refused == 1
    store = open_store(rz.address, 5)
    assert not store.check(["rank0"]) and store.num_keys() == 0


def test_a_store_s_semantics(rz):
    a, b = open_store(rz.address, 5), open_store(rz.address, 0.3)
    a.set("k", "v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "missing"])
    assert a.add("n", 3) == 3 and b.add("n", 2) == 5
    assert a.compare_set("k", "v", "w") == b"w" and a.compare_set("k", "x", "y") == b"w"
    assert a.delete_key("k") and not a.delete_key("k")
    with pytest.raises(dist.DistStoreError):
        b.get("never")  # within its 0.3 s timeout
    with pytest.raises(dist.DistStoreError):
        b.wait(["never"], datetime.timedelta(seconds=0.2))
    # A get blocks until another client sets its key.
    got = []
    reader = threading.Thread(target=lambda: got.append(a.get("later")))
    reader.start()
    b.set("later", b"\x00\xff")
    reader.join()
    assert got == [b"\x00\xff"]
    a.wait(["later"])
    assert a.num_keys() == 2  # "n" and "later"


def test_gloo_meets_through_it(rz):
    """Two process groups of one pair rendezvous through prefixed clients, as the transports do."""
    def member(rank: int, out: list) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=60)
        client = open_store(rz.address, 60)  # referenced while torch uses it (StoreClient says why)
        out.append((dist.ProcessGroupGloo(dist.PrefixStore("lmpool/gloo/0-1/s", client), rank, 2, options), client))

    groups: list = []
    threads = [threading.Thread(target=member, args=(r, groups)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(groups) == 2


def test_a_closed_rendezvous_fails_its_clients_at_once():
    rz = Rendezvous.create()
    store = open_store(rz.address, 60)
    store.set("k", "v")
    rz.close()
    with pytest.raises(TransportError, match="rendezvous"):
        store.get("k")
    with pytest.raises(TransportError, match="cannot reach the rendezvous"):
        open_store(rz.address, 1)
