"""``echo2 node doctor`` against a real in-process hub probe service (libp2p + data plane)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from echo2.keyfile import load_identity, save_identity
from echo2.learner_hub import probe_service as hubprobe
from echo2.node import doctor
from echo2.protocol import modelspec
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost
from echo2.protocol.net.dataplane import DataPlaneServer


def run(main: Callable[[], Awaitable[None]], limit_s: float = 40.0) -> None:
    async def bounded() -> None:
        with trio.fail_after(limit_s):
            await main()

    trio.run(bounded)


def node_dir(tmp_path: Path) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    save_identity(Identity.generate(), d / "node.key")
    (d / "model_config.json").write_text(modelspec.config_json(modelspec.tiny_config()))
    return d


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def test_all_checks_pass_against_a_real_hub(tmp_path: Path) -> None:
    data_dir = node_dir(tmp_path)
    hub_id = Identity.generate()

    async def main() -> None:
        async with ControlHost(hub_id, dial_timeout_s=3) as hub, trio.open_nursery() as nursery:
            responder = hubprobe.BandwidthResponder(lambda _pid: True)  # as if admitted
            server = DataPlaneServer(hub_id, responder.handle, allow=responder.allow, max_connections=8)
            await nursery.start(server.serve)
            svc = hubprobe.ProbeService(hub_id, control_host=hub, probe_data_addr=server.addr)
            hub.set_handler(hubprobe.PROBE, svc.handle_control, max_request=hubprobe.MAX_PROBE_REQUEST)
            checks = await doctor.run_doctor_async(hub.addrs[0], data_dir, "transformers", 3.0)
            nursery.cancel_scope.cancel()
        got = by_name(checks)
        table = doctor.render_table(checks)
        assert not [c for c in checks if c.failed], table
        for name in ("python", "torch", "engine", "memory fit", "disk", "identity", "hub reachable",
                     "listen port reachable", "clock skew", "bandwidth"):
            assert got[name].status == doctor.PASS, table
        assert got["gpu"].status in (doctor.PASS, doctor.INFO)
        assert "dialled back" in got["listen port reachable"].detail
        # a node on the hub's machine (loopback) asks no router for a mapping, and says why
        assert got["port mapping"].status == doctor.INFO and "127.0.0.1 only" in got["port mapping"].detail, table
        assert "MB/s" in got["bandwidth"].detail
        assert doctor.exit_code(checks) == 0 and "all checks passed" in table
        assert svc.probes == 1
        # the node's identity (not a throw-away one) was used
        assert load_identity(data_dir / "node.key").peer_id in got["identity"].detail
        parsed = json.loads(doctor.checks_json(checks))
        assert parsed["ok"] is True and len(parsed["checks"]) == len(checks)

    run(main)


def test_wrong_hub_address_fails_fast_and_names_the_fix(tmp_path: Path) -> None:
    data_dir = node_dir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    wrong = f"/ip4/127.0.0.1/tcp/{dead}/p2p/{Identity.generate().peer_id}"

    async def main() -> None:
        t0 = time.monotonic()
        checks = await doctor.run_doctor_async(wrong, data_dir, "transformers", 3.0)
        assert time.monotonic() - t0 < 10
        got = by_name(checks)
        hub = got["hub reachable"]
        assert hub.failed and "hub.addrs" in hub.fix and "firewall" in hub.fix
        for name in ("listen port reachable", "clock skew", "bandwidth"):
            assert got[name].status == doctor.SKIP
        assert doctor.exit_code(checks) == 1
        assert "fix: check the multiaddr" in doctor.render_table(checks)

    run(main)


def test_hub_address_without_peer_id_and_silent_listener(tmp_path: Path) -> None:
    data_dir = node_dir(tmp_path)

    async def main() -> None:
        checks = await doctor.run_doctor_async("/ip4/127.0.0.1/tcp/1", data_dir, "transformers", 1.0)
        assert by_name(checks)["hub reachable"].failed
        # a listener that accepts TCP and never speaks: bounded by the timeout, not ~120 s
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        t0 = time.monotonic()
        silent = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
        checks = await doctor.run_doctor_async(silent, data_dir, "transformers", 1.0)
        assert time.monotonic() - t0 < 8
        assert by_name(checks)["hub reachable"].failed
        for lst in listeners:
            await lst.aclose()

    run(main)


def test_local_checks(tmp_path: Path) -> None:
    d = tmp_path / "n"
    d.mkdir()
    check, ident = doctor.check_identity(d)
    assert check.status == doctor.INFO and ident is None
    key = d / "node.key"
    save_identity(Identity.generate(), key)
    os.chmod(key, 0o644)
    check, ident = doctor.check_identity(d)
    assert check.failed and check.fix == f"chmod 600 {key}"
    os.chmod(key, 0o600)
    assert doctor.check_identity(d)[0].status == doctor.PASS
    key.write_bytes(b"junk")
    os.chmod(key, 0o600)
    assert doctor.check_identity(d)[0].failed

    from echo2.node.hardware import Hardware

    hw = Hardware("", 0, 0, "cpu", 2, 64 * 1024**2, 10, "Linux", "3.11")
    assert doctor.check_gpu(hw).status == doctor.INFO and "CPU node" in doctor.check_gpu(hw).detail
    assert doctor.check_memory(hw, None, "auto").status == doctor.INFO
    big = modelspec.config_json(modelspec.tiny_config(hidden=1024, layers=8))
    mem = doctor.check_memory(hw, big, "transformers")
    assert mem.failed and "does not fit" in mem.detail
    assert doctor.check_disk(hw, d).failed
    assert doctor.check_engine("nonsense").failed
    assert doctor.check_engine("transformers").status == doctor.PASS


def test_register_doctor_parses() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="node_cmd")
    doctor.register_doctor(sub)
    args = parser.parse_args(["doctor", "--hub", "/ip4/127.0.0.1/tcp/1/p2p/x", "--json", "--timeout", "2"])
    assert args.func is doctor.cmd and args.json and args.timeout == 2.0
