"""Hardware probe, memory-fit estimate, the hub's probe service and the node's measurements
(real libp2p hosts and a real data plane on 127.0.0.1; a real tiny model for throughput)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
import trio

from echo2 import __version__
from echo2.learner_hub import probe_service as hubprobe
from echo2.models import spec as modelspec
from echo2.node import hardware, measure
from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error, MeaningError, SchemaError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Announce
from echo2.protocol.net.control import ControlHost
from echo2.protocol.net.dataplane import DataPlaneServer


def run(main: Callable[[], Awaitable[None]], limit_s: float = 30.0) -> None:
    async def bounded() -> None:
        with trio.fail_after(limit_s):
            await main()

    trio.run(bounded)


# --- hardware ---------------------------------------------------------------------------------


def test_probe_fills_every_field(tmp_path: Path) -> None:
    hw = hardware.probe(tmp_path / "d")
    assert hw.cpu_cores >= 1 and hw.ram_bytes > 0 and hw.free_disk_bytes > 0
    assert hw.cpu_model and hw.python and hw.os
    assert (hw.accelerator_count > 0) == bool(hw.accelerator)


def test_parse_nvidia_smi() -> None:
    text = "NVIDIA H200, 143771\nNVIDIA H200, 143771\n"
    assert hardware.parse_nvidia_smi(text) == ("NVIDIA H200", 2, 143771 * 1024 * 1024)
    assert hardware.parse_nvidia_smi("") == ("", 0, 0)
    assert hardware.parse_nvidia_smi("garbage\nx, notanumber") == ("", 0, 0)


@pytest.mark.parametrize(
    "conf",
    [
        modelspec.tiny_config(),
        modelspec.tiny_config(hidden=64, layers=3, heads=4, arch="llama"),
        {**modelspec.tiny_config(hidden=64, layers=1), "tie_word_embeddings": False, "num_key_value_heads": 2},
    ],
)
def test_param_estimate_is_exact_for_llama_and_qwen(conf: dict) -> None:
    model = modelspec.model_from_config(modelspec.config_json(conf))
    real = sum(p.numel() for p in model.parameters())
    assert hardware.estimate_model_size(conf).params == real


def test_fits_says_what_to_do() -> None:
    conf = json.dumps(modelspec.tiny_config())
    ok, needed, msg = hardware.fits(conf, "float32", 8 * 1024**3)
    assert ok and needed > 0 and "fits" in msg
    smol = json.dumps(
        {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    )
    ok, needed, msg = hardware.fits(smol, "float32", 256 * 1024**2)
    assert not ok and needed > 256 * 1024**2
    assert "does not fit" in msg and "bfloat16" in msg and "134.5 M params" in msg
    ok32, n32, _ = hardware.fits(smol, "float32", 64 * 1024**3, kv_tokens=0)
    ok16, n16, _ = hardware.fits(smol, "bfloat16", 64 * 1024**3, kv_tokens=0)
    assert ok32 and ok16 and n16 * 2 == pytest.approx(n32, rel=1e-6)
    assert hardware.fits("{not json", "float32", 1)[0] is False
    assert hardware.fits(conf, "float12", 1 << 40)[2].startswith("unknown dtype")


# --- dial-back targets (pure) -------------------------------------------------------------------

PEER = Identity.from_seed(b"\x01" * 32).peer_id
OTHER = Identity.from_seed(b"\x02" * 32).peer_id


def test_dial_back_targets_use_observed_ip_and_refuse_other_peers() -> None:
    addrs = [
        f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}",
        f"/ip4/10.0.0.5/tcp/4002/p2p/{OTHER}",  # names someone else: ignored
        "/ip4/0.0.0.0/tcp/4003",
        "/dns4/example.com/tcp/4004",  # names are not dialled
        "/ip4/1.2.3.4/udp/4005",
        "not an address",
    ]
    got = hubprobe.dial_back_targets(addrs, PEER, "203.0.113.7")
    assert got == [f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}", f"/ip4/203.0.113.7/tcp/4003/p2p/{PEER}"]
    assert hubprobe.data_dial_target("10.0.0.5:7000", "203.0.113.7") == "203.0.113.7:7000"
    assert hubprobe.data_dial_target("0.0.0.0:7000", "203.0.113.7") == "203.0.113.7:7000"
    assert hubprobe.data_dial_target("host.example:7000", "203.0.113.7") == "203.0.113.7:7000"
    assert hubprobe.data_dial_target("", "1.2.3.4") is None


def test_a13_probe_dials_only_the_observed_ip() -> None:
    """A13 (probe fallback): without the IP the request came from, the hub dialled the announced
    hosts, i.e. any third party a prober named. Now it dials nothing but the observed IP."""
    addrs = [f"/ip4/198.51.100.9/tcp/4001/p2p/{PEER}", "/ip4/10.0.0.5/tcp/4002"]
    assert hubprobe.dial_back_targets(addrs, PEER, None) == []
    assert hubprobe.data_dial_target("198.51.100.9:7000", None) is None
    # an observed address that is no unicast host is not dialled either
    for bad in ("0.0.0.0", "224.0.0.1", "255.255.255.255", "::"):
        assert hubprobe.dial_back_targets(addrs, PEER, bad) == []
        assert hubprobe.data_dial_target("198.51.100.9:7000", bad) is None

    async def main() -> None:
        svc = hubprobe.ProbeService(Identity.generate(), control_host=None)
        ann = announce_for(Identity.from_seed(b"\x01" * 32), addrs, "198.51.100.9:7000")
        ok, reason, port = await svc._dial_back(PEER, ann, None)
        assert not ok and port is None and "dials nothing" in reason

    run(main)


def test_parse_bandwidth_request() -> None:
    assert hubprobe.parse_request(b"bw-down 1048576") == ("bw-down", 1048576)
    assert hubprobe.parse_request(b"bw-up 5") == ("bw-up", 5)
    for bad in (b"bw-down", b"bw-down -1", b"bw-down 0", b"bw-sideways 5", b"\xff\xfe",
                f"bw-up {hubprobe.MAX_TRANSFER + 1}".encode(), b"bw-up 5" + b" " * 100):
        with pytest.raises(SchemaError):
            hubprobe.parse_request(bad)


def test_reply_schemas_agree() -> None:
    """Both sides use the one ProbeReply of echo2.protocol.messages."""
    assert hubprobe.ProbeReply.DOMAIN == measure.ProbeReply.DOMAIN == "echo2/probe_reply/1.0.0"
    assert list(hubprobe.ProbeReply.SPEC) == list(measure.ProbeReply.SPEC)
    assert hubprobe.PROBE == measure.PROBE


# --- real hosts ---------------------------------------------------------------------------------


@asynccontextmanager
async def hub_with_probe(identity: Identity, **kw: object) -> AsyncIterator[tuple[ControlHost, hubprobe.ProbeService]]:
    async with ControlHost(identity, gossip=False, dial_timeout_s=3) as host, trio.open_nursery() as nursery:
        responder = hubprobe.BandwidthResponder(lambda _pid: True, links=kw.get("links"))  # type: ignore[arg-type]
        server = DataPlaneServer(identity, responder.handle, allow=responder.allow, max_connections=8)
        await nursery.start(server.serve)
        svc = hubprobe.ProbeService(identity, control_host=host, probe_data_addr=server.addr, **kw)  # type: ignore[arg-type]
        host.set_handler(hubprobe.PROBE, svc.handle_control, max_request=hubprobe.MAX_PROBE_REQUEST)
        yield host, svc
        nursery.cancel_scope.cancel()


def announce_for(ident: Identity, addrs: list[str], data_addr: str = "") -> Announce:
    return Announce(
        peer_id=ident.peer_id, software_version=__version__, accelerator="", accelerator_count=0,
        accelerator_memory_bytes=0, cpu_model="test", cpu_cores=1, ram_bytes=0, free_disk_bytes=0,
        engine="transformers", engine_version="", tokens_per_s=0.0, rollouts_per_s=0.0,
        upload_MBps=0.0, download_MBps=0.0, price_usd_per_hour=0.0, listen_addrs=addrs,
        data_addr=data_addr, reachable=False, versions_held=[], max_upload_MBps=0.0,
    )


def test_probe_reachable_clock_and_bandwidth() -> None:
    hub_id, node_id = Identity.generate(), Identity.generate()

    async def main() -> None:
        async with hub_with_probe(hub_id) as (hub, svc), ControlHost(node_id, gossip=False, dial_timeout_s=3) as node:
            await node.connect(hub.addrs[0])
            async with trio.open_nursery() as nursery:
                # the node's own data plane, so the hub checks that address too
                node_dp = DataPlaneServer(node_id, lambda conn: trio.sleep(0), allow=lambda p: p == hub_id.peer_id)
                await nursery.start(node_dp.serve)
                ann = announce_for(node_id, node.addrs, node_dp.addr)
                res, bw = await measure.measure_all(node, hub_id.peer_id, hub_id.peer_id, node_id, ann, timeout_s=10)
                nursery.cancel_scope.cancel()
            assert res.reachable, res.reason
            assert "dialled back" in res.reason and "data plane" in res.reason
            assert abs(res.clock_skew_s) < 1.0
            assert bw is not None and bw.upload_MBps > 1 and bw.download_MBps > 1
            assert svc.probes == 1
            # a second probe right away is refused (rate limit), with its own code
            with pytest.raises(RemoteError) as ei:
                await measure.probe_hub(node, hub_id.peer_id, hub_id.peer_id, node_id, ann, timeout_s=10)
            assert ei.value.code == "rate_limited"

    run(main)


def test_probe_reports_unreachable_port() -> None:
    hub_id, node_id = Identity.generate(), Identity.generate()

    async def main() -> None:
        async with hub_with_probe(hub_id, dial_timeout_s=1.0) as (hub, _svc):
            async with ControlHost(node_id, gossip=False, dial_timeout_s=3) as node:
                await node.connect(hub.addrs[0])
                with trio.socket.socket() as s:  # a port with nobody listening
                    await s.bind(("127.0.0.1", 0))
                    dead = s.getsockname()[1]
                ann = announce_for(node_id, [f"/ip4/127.0.0.1/tcp/{dead}/p2p/{node_id.peer_id}"])
                res = await measure.probe_hub(node, hub_id.peer_id, hub_id.peer_id, node_id, ann, timeout_s=10)
                assert not res.reachable
                assert f"cannot dial /ip4/127.0.0.1/tcp/{dead}" in res.reason

    run(main)


def test_probe_refuses_forged_and_foreign_requests() -> None:
    hub_id, node_id, other = Identity.generate(), Identity.generate(), Identity.generate()

    async def main() -> None:
        async with hub_with_probe(hub_id) as (hub, _svc), ControlHost(node_id, gossip=False) as node:
            await node.connect(hub.addrs[0])
            # signed by someone other than the stream's peer
            req = envelope.seal(other, announce_for(other, []))
            with pytest.raises(RemoteError) as ei:
                await node.request(hub_id.peer_id, hubprobe.PROBE, req, max_response=8192, timeout_s=5)
            assert ei.value.code == "signer_not_allowed"
            with pytest.raises(RemoteError):
                await node.request(hub_id.peer_id, hubprobe.PROBE, b"\x00garbage", max_response=8192, timeout_s=5)
            # a valid request with no dialable address: answered, not reachable
            res = await measure.probe_hub(node, hub_id.peer_id, hub_id.peer_id, node_id, announce_for(node_id, ["/dns4/x/tcp/1"]))
            assert not res.reachable and "no dialable" in res.reason

    run(main)


def test_probe_reply_is_bound_to_the_request() -> None:
    hub_id = Identity.generate()
    me = Identity.generate().peer_id
    nonce = os.urandom(16)
    reply = hubprobe.ProbeReply(peer_id=me, request_nonce=nonce, hub_time=1.0, reachable=True, reason="", probe_data_addr="")
    # sealed an hour "in the past" by our clock: accepted all the same (bound by nonce, not time)
    data = envelope.seal(hub_id, reply, now=1_000.0)
    assert measure.open_probe_reply(data, hub_peer=hub_id.peer_id, me=me, request_nonce=nonce).hub_time == 1.0
    with pytest.raises(MeaningError):
        measure.open_probe_reply(data, hub_peer=hub_id.peer_id, me=me, request_nonce=os.urandom(16))
    with pytest.raises(Echo2Error):
        measure.open_probe_reply(data, hub_peer=Identity.generate().peer_id, me=me, request_nonce=nonce)


def test_bandwidth_responder_refuses_bad_requests() -> None:
    hub_id, node_id = Identity.generate(), Identity.generate()

    async def main() -> None:
        from echo2.protocol.dataframe import FrameType, parse_error
        from echo2.protocol.net import dataplane

        async with trio.open_nursery() as nursery:
            server = DataPlaneServer(hub_id, hubprobe.BandwidthResponder(lambda _pid: True).handle)
            await nursery.start(server.serve)
            conn = await dataplane.connect(server.addr, node_id, hub_id.peer_id, timeout_s=5)
            async with conn:
                await conn.send_request(b"bw-down 99999999999")
                frame = await conn.receive(timeout_s=5)
                assert frame.type is FrameType.ERROR
                assert parse_error(frame.payload)[0] == "bad_request"
            nursery.cancel_scope.cancel()

    run(main)


def test_a12_bandwidth_probe_serves_admitted_peers_only_within_a_budget() -> None:
    """A12: the bandwidth responder served anyone (a free traffic source and sink). A stranger is
    now refused in the handshake, before a byte moves; an admitted peer gets a byte budget per
    window, spent across its connections; another peer's budget is its own."""
    hub_id, member, other, stranger = (Identity.generate() for _ in range(4))
    admitted = {member.peer_id, other.peer_id}
    MiB = 1024 * 1024

    async def main() -> None:
        from echo2.protocol.dataframe import FrameType, parse_error
        from echo2.protocol.errors import HandshakeError
        from echo2.protocol.net import dataplane

        responder = hubprobe.BandwidthResponder(admitted.__contains__, budget_bytes=3 * MiB, window_s=600.0)
        async with trio.open_nursery() as nursery:
            server = DataPlaneServer(hub_id, responder.handle, allow=responder.allow)
            await nursery.start(server.serve)
            with pytest.raises(HandshakeError) as ei:
                await dataplane.connect(server.addr, stranger, hub_id.peer_id, timeout_s=5)
            assert getattr(ei.value, "reason", "") == "not_allowed"
            with pytest.raises(measure.BandwidthNotOffered):
                await measure.measure_bandwidth(server.addr, stranger, hub_id.peer_id, timeout_s=5)
            assert responder.refusals["not_admitted"] == 2 and responder.bytes_moved == 0

            async def ask(who: Identity, n: int) -> str:
                conn = await dataplane.connect(server.addr, who, hub_id.peer_id, timeout_s=5)
                async with conn:
                    await conn.send_request(f"bw-down {n}".encode())
                    while True:
                        frame = await conn.receive(timeout_s=5)
                        if frame.type is FrameType.ERROR:
                            return parse_error(frame.payload)[0]
                        if frame.type is FrameType.REQUEST:
                            return bytes(frame.payload).decode()

            assert await ask(member, 2 * MiB) == f"bw-down-done {2 * MiB}"
            # the budget is the peer's, not the connection's: a fresh connection does not reset it
            assert await ask(member, 2 * MiB) == "rate_limited"
            assert await ask(member, MiB) == f"bw-down-done {MiB}"
            assert await ask(member, MiB // 2) == "rate_limited"
            assert await ask(other, 2 * MiB) == f"bw-down-done {2 * MiB}"
            assert responder.bytes_moved == 5 * MiB and responder.refusals["rate_limited"] == 2
            nursery.cancel_scope.cancel()

    run(main)


def test_a10_dial_back_proves_the_observed_data_address_and_the_hub_times_the_upload() -> None:
    """A10: the planner's address, reachability and upload come from the hub's own dial-back
    (at the IP the request came from, the data-plane handshake proving the node's key) and its
    own timing of the node's upload, never from the announce (here 0.0.0.0 and no upload)."""
    from echo2.learner_hub.links import LinkBook

    hub_id, node_id, impostor = Identity.generate(), Identity.generate(), Identity.generate()
    links = LinkBook()

    async def main() -> None:
        async with hub_with_probe(hub_id, links=links, admitted=lambda _pid: True) as (hub, _svc):
            async with ControlHost(node_id, gossip=False, dial_timeout_s=3) as node, trio.open_nursery() as nursery:
                await node.connect(hub.addrs[0])
                # first the port holds someone else's data plane: nothing is verified
                fake = DataPlaneServer(impostor, lambda conn: trio.sleep(0))
                await nursery.start(fake.serve)
                ann = announce_for(node_id, node.addrs, f"0.0.0.0:{fake.port}")
                res = await measure.probe_hub(node, hub_id.peer_id, hub_id.peer_id, node_id, ann, timeout_s=10)
                assert not res.reachable
                v = links.view(node_id.peer_id, ann.data_addr, 0.0, [node_id.peer_id])
                assert v.data_addr == f"127.0.0.1:{fake.port}" and not v.reachable and not v.measured
                # then its own data plane: proven at the observed IP, and its upload timed
                real = DataPlaneServer(node_id, lambda conn: trio.sleep(0), allow=lambda p: False)
                await nursery.start(real.serve)
                await trio.sleep(2.1)  # the probe service's per-peer interval
                ann = announce_for(node_id, node.addrs, f"0.0.0.0:{real.port}")
                res, bw = await measure.measure_all(node, hub_id.peer_id, hub_id.peer_id, node_id, ann, timeout_s=10)
                assert res.reachable, res.reason
                v = links.view(node_id.peer_id, ann.data_addr, 0.0, [node_id.peer_id])
                assert v.data_addr == f"127.0.0.1:{real.port}" and v.reachable and v.measured
                assert bw is not None and v.upload_Bps > 1e6
                # the node's own cap can only lower what the hub measured
                assert links.view(node_id.peer_id, ann.data_addr, 2e6, [node_id.peer_id]).upload_Bps == 2e6
                nursery.cancel_scope.cancel()

    run(main)


def test_a10_the_hub_dials_back_what_the_planner_asked_about() -> None:
    """A10 without the node's help: the address the planner wanted (observed IP, announced port)
    is dialled by the hub's verifier; it becomes a parent's address only where the handshake
    proved the node's key, is retried at most once per ``retry_s``, and never for a stranger."""
    from echo2.learner_hub.links import LinkBook

    hub_id, node_id, impostor, stranger = (Identity.generate() for _ in range(4))
    links = LinkBook()
    admitted = {node_id.peer_id, impostor.peer_id}

    async def main() -> None:
        svc = hubprobe.ProbeService(hub_id, links=links, admitted=admitted.__contains__, dial_timeout_s=2.0)
        async with trio.open_nursery() as nursery:
            real = DataPlaneServer(node_id, lambda conn: trio.sleep(0), allow=lambda p: False)
            fake = DataPlaneServer(stranger, lambda conn: trio.sleep(0))
            await nursery.start(real.serve)
            await nursery.start(fake.serve)
            cases = ((node_id, real.port), (impostor, fake.port), (stranger, real.port))
            for who, port in cases:
                links.observed(who.peer_id, "127.0.0.1")
                v = links.view(who.peer_id, f"0.0.0.0:{port}", 0.0, [who.peer_id])
                assert v.data_addr == f"127.0.0.1:{port}" and not v.reachable
            await nursery.start(partial(svc.verify_loop, interval_s=0.05, retry_s=60.0))
            with trio.fail_after(10):
                while not links.view(node_id.peer_id, f"0.0.0.0:{real.port}", 0.0, [node_id.peer_id]).reachable:
                    await trio.sleep(0.05)
            await trio.sleep(0.3)
            # the impostor's port holds another key: tried once, not proven, not retried yet
            assert not links.view(impostor.peer_id, f"0.0.0.0:{fake.port}", 0.0, [impostor.peer_id]).reachable
            assert links.unproven(trio.current_time(), 60.0, 16) == []
            # a peer that is not admitted is never dialled, so never proven
            assert not links.view(stranger.peer_id, f"0.0.0.0:{real.port}", 0.0, [stranger.peer_id]).reachable
            nursery.cancel_scope.cancel()

    run(main)


# --- throughput ---------------------------------------------------------------------------------


def test_measure_throughput_on_a_tiny_policy() -> None:
    from echo2.models.engine import TransformersEngine

    torch.manual_seed(0)
    conf = modelspec.tiny_config(hidden=64, layers=1)
    mc, arts = modelspec.artifacts_for(conf, modelspec.tokenizer_json())
    model = modelspec.model_from_config(mc)
    eng = TransformersEngine(device="cpu")
    with pytest.raises(MeaningError):
        measure.measure_throughput(eng, budget_s=0.1)
    eng.load_version(0, mc, arts, model.state_dict())
    t = measure.measure_throughput(eng, n_prompts=4, group_size=2, max_new_tokens=8, budget_s=0.2, max_calls=3)
    assert 1 <= t.calls <= 3 and t.rollouts == 8 * t.calls
    assert t.tokens_per_s > 0 and t.rollouts_per_s > 0 and t.tokens <= 64 * t.calls
