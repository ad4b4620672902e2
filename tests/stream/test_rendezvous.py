"""The TP ranks' rendezvous store is unauthenticated, so it listens on the loopback interface only:
nothing beyond this node can join or poison the target's TP group."""
from __future__ import annotations

import datetime
import gc
import socket

from specforge_k25.stream.target_stream import Rendezvous


def _listening(port: int) -> list[str]:
    """The local addresses (as the kernel prints them, hex) that listen on `port`, IPv4 and IPv6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":  # TCP_LISTEN
                found.append(address)
    return found


def test_the_rendezvous_listens_on_loopback_only_and_serves_a_client():
    from torch.distributed import TCPStore

    rendezvous = Rendezvous(timeout_s=10)
    port = rendezvous.store.port
    assert port > 0 and rendezvous.env()["MASTER_PORT"] == str(port)
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, and no wildcard (0.0.0.0 or ::)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("rank0", "ready")
    assert rendezvous.store.get("rank0") == b"ready"
    del client, rendezvous
    gc.collect()
    assert _listening(port) == []  # the store's socket is closed with it


def test_the_port_is_not_reachable_on_another_address_of_this_host():
    """Connecting to the port on this host's other IPv4 addresses is refused (there: nothing listens)."""
    import psutil

    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    rendezvous = Rendezvous(timeout_s=10)
    for address in others:
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, rendezvous.store.port)) != 0, address
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", rendezvous.store.port)) == 0
