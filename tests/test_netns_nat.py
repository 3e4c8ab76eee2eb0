"""Homes behind NAT routers in the namespace harness (bench/netns.py ``nat=``): a NATed host's
outgoing TCP keeps its source port behind MASQUERADE, inbound to a home is dropped, and two homes
connect by TCP simultaneous open (what hole punching relies on). Skipped where namespaces (or
``nft``) are not available."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from echo2.bench import netns

WHY = netns.available() or (None if shutil.which("nft") else "needs nft (Debian package nftables)")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces with NAT: {WHY}")


def _bound(net: netns.Net, i: int, port: int) -> socket.socket:
    with net.inside(i):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((net.ip(i), port))
    s.settimeout(3.0)
    return s


def test_homes_masquerade_keep_port_drop_inbound_and_simultaneous_open() -> None:
    with netns.Net(4, 8.0, nat={2, 3}) as net:
        prefix = net.prefix
        assert net.ip(2) != net.public_ip(2) and net.ip(1) == net.public_ip(1)
        listener = _bound(net, 1, 7000)
        listener.listen()
        out = _bound(net, 2, 7100)
        with out:
            out.connect((net.ip(1), 7000))
            conn, addr = listener.accept()
            conn.close()
        listener.close()
        assert addr == (net.public_ip(2), 7100)  # the router's address, the host's own port

        probe = _bound(net, 1, 7200)
        with probe, pytest.raises(OSError):  # no one in home 3 asked for it: dropped (timeout)
            probe.connect((net.public_ip(3), 7300))

        got: dict[int, object] = {}

        def punch(i: int, j: int) -> None:
            s = _bound(net, i, 7400)
            with s:
                for _ in range(10):  # bounded: the first SYN may meet the other router's drop
                    try:
                        s.connect((net.public_ip(j), 7400))
                        got[i] = s.getpeername()
                        return
                    except OSError as exc:
                        got[i] = exc
                        s.close()
                        s = _bound(net, i, 7400)

        ts = [threading.Thread(target=punch, args=(2, 3)), threading.Thread(target=punch, args=(3, 2))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=40)
        assert got == {2: (net.public_ip(3), 7400), 3: (net.public_ip(2), 7400)}
    assert netns.list_netns(prefix) == []
