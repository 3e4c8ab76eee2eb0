"""Issue 19 item 5, names a person can type: /dns4 and /dns6 hub addresses (resolved by the system
resolver: here "localhost" from /etc/hosts, so every dial goes to 127.0.0.1) and join strings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from echo2.cli import main
from echo2.learner_hub.admission import make_join_token
from echo2.protocol.errors import Echo2Error, TransportError
from echo2.protocol.identity import Identity
from echo2.protocol.joinstring import JoinStringError, make_join_string, parse_join_string
from echo2.protocol.net.control import ControlHost
from echo2.protocol.net.names import dns_parts, reachable_data_addr, resolve_addr

PEER = Identity.from_seed(b"\x07" * 32).peer_id
PING = "/echo2/test-names/1.0.0"


def test_dns_parts() -> None:
    assert dns_parts(f"/dns4/hub.example.org/tcp/4001/p2p/{PEER}") == ("dns4", "hub.example.org", 4001, f"/tcp/4001/p2p/{PEER}")
    assert dns_parts(f"/dns6/h/tcp/1/p2p/{PEER}")[0] == "dns6"  # type: ignore[index]
    assert dns_parts(f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}") is None
    for bad in ("/dns4/hub.example.org", "/dns4//tcp/1/p2p/x", "/dns4/h/udp/1/p2p/x", "/dns4/h/tcp/0/p2p/x", "/dns4/h/tcp/70000"):
        with pytest.raises(TransportError, match="/dns4/NAME/tcp/PORT/p2p/PEER_ID"):
            dns_parts(bad)


def test_resolve_localhost_and_say_why_not() -> None:
    assert trio.run(resolve_addr, f"/dns4/localhost/tcp/4001/p2p/{PEER}") == f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"
    plain = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"
    assert trio.run(resolve_addr, plain) == plain
    # an IPv4 literal asked for as IPv6: the resolver refuses without any network; the error names it
    with pytest.raises(TransportError, match=r"cannot resolve '127\.0\.0\.1' \(dns6\)"):
        trio.run(resolve_addr, f"/dns6/127.0.0.1/tcp/4001/p2p/{PEER}")


def test_connect_and_request_by_name() -> None:
    async def main_() -> None:
        async def pong(_peer: str, data: bytes) -> bytes:
            return b"pong:" + data

        with trio.fail_after(30):
            async with ControlHost(Identity.generate(), gossip=False) as hub, ControlHost(Identity.generate(), gossip=False) as node:
                hub.set_handler(PING, pong, max_request=64)
                port = hub.addrs[0].split("/tcp/")[1].split("/")[0]
                by_name = f"/dns4/localhost/tcp/{port}/p2p/{hub.peer_id}"
                assert await node.connect(by_name) == hub.peer_id
                assert await node.request(by_name, PING, b"x", max_response=64) == b"pong:x"

    trio.run(main_)


def test_join_string_round_trip_and_refusals() -> None:
    hub = Identity.from_seed(b"\x01" * 32)
    addr = f"/dns4/hub.example.org/tcp/4001/p2p/{hub.peer_id}"
    token = make_join_token(hub, ttl_s=3600, now=time.time())
    s = make_join_string(addr, token)
    assert s == f"{addr}/join/{token}" and set(s) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/._-")
    assert parse_join_string(s + "\n") == (addr, token)
    assert parse_join_string(addr) == (addr, "")  # an open hub: the address alone
    other = make_join_token(Identity.from_seed(b"\x02" * 32), ttl_s=3600, now=time.time())
    with pytest.raises(JoinStringError, match="signed by hub .* not by the hub at this address"):
        parse_join_string(f"{addr}/join/{other}")
    with pytest.raises(JoinStringError, match="not a join token"):
        parse_join_string(f"{addr}/join/hello")
    with pytest.raises(JoinStringError, match="/p2p/PEER_ID"):
        parse_join_string(f"/dns4/hub.example.org/tcp/4001/join/{token}")
    with pytest.raises(JoinStringError, match="starts with the hub's address"):
        parse_join_string(token)


def test_hub_join_string_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hub", "init", "--dir", str(tmp_path)]) == 0
    hub = (capsys.readouterr().out.split("hub peer ID ")[1].split()[0])
    (tmp_path / "hub.addrs").write_text(f"/ip4/127.0.0.1/tcp/4001/p2p/{hub}\n")
    assert main(["hub", "join-string", "--dir", str(tmp_path), "--host", "hub.example.org", "--expires", "1h"]) == 0
    out = capsys.readouterr()
    addr, token = parse_join_string(out.out)
    assert addr == f"/dns4/hub.example.org/tcp/4001/p2p/{hub}" and token.startswith("e2jt1.")
    assert "token id" in out.err  # recorded like `hub token`'s, so it can be revoked
    assert main(["hub", "join-string", "--dir", str(tmp_path), "--no-token"]) == 0
    assert parse_join_string(capsys.readouterr().out) == (f"/ip4/127.0.0.1/tcp/4001/p2p/{hub}", "")
    # the node takes it whole, and refuses a mangled one before doing anything
    with pytest.raises(SystemExit, match="--join: the join token was signed by hub"):
        other = make_join_token(Identity.generate(), ttl_s=60, now=time.time())
        main(["node", "run", "--join", f"/dns4/localhost/tcp/1/p2p/{hub}/join/{other}", "--data-dir", str(tmp_path / "n")])
    with pytest.raises(SystemExit):
        main(["node", "run", "--join", addr, "--hub", addr])  # one or the other


def test_unresolvable_name_is_an_echo2_error() -> None:
    # what the node's connect loop catches and retries (Echo2Error), never a raw socket.gaierror
    with pytest.raises(Echo2Error):
        trio.run(resolve_addr, f"/dns6/127.0.0.1/tcp/1/p2p/{PEER}")


def test_a_hub_on_every_interface_is_dialled_where_it_was_reached() -> None:
    # a hub with listen_host = 0.0.0.0 tells nodes its data plane is at 0.0.0.0:PORT
    assert reachable_data_addr("0.0.0.0:7001", "203.0.113.5") == "203.0.113.5:7001"
    assert reachable_data_addr("[::]:7001", "2001:db8::1") == "[2001:db8::1]:7001"
    assert reachable_data_addr("127.0.0.1:7001", "203.0.113.5") == "127.0.0.1:7001"  # a named host stays
    assert reachable_data_addr("0.0.0.0:7001", None) == "0.0.0.0:7001"  # nothing better known
