"""The transfer rendezvous listens on loopback only, and every client's keys live under
the pool's random key, which only the address (never a command line) carries."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from lmpool.dataplane import Rendezvous
from lmpool.dataplane.transport import open_store, parse_address


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of the TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.append(address)
    return found


def test_the_rendezvous_listens_on_loopback_only():
    rz = Rendezvous.create()
    try:
        host, port, key = parse_address(rz.address)
        assert host == "127.0.0.1"
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0
    finally:
        rz.close()


def test_keys_live_under_the_pools_secret_key():
    a, b = Rendezvous.create(), Rendezvous.create()
    try:
        host, port, key = parse_address(a.address)
        assert len(key) == 32 and key != parse_address(b.address)[2]
        open_store(a.address, 5).set("rank0", "x")
        raw = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        assert raw.list_keys() == [f"lmpool-{key}/rank0"]  # nothing under a guessable name
        assert open_store(a.address, 5).get("rank0") == b"x"
    finally:
        a.close()
        b.close()
