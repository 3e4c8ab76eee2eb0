"""Hardware probe, memory-fit estimate, the hub's probe service and the node's measurements
(real libp2p hosts and a real data plane on 127.0.0.1; a real tiny model for throughput)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
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
    assert hubprobe.dial_back_targets(addrs, PEER, None) == [f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}"]
    assert hubprobe.data_dial_target("10.0.0.5:7000", "203.0.113.7") == "203.0.113.7:7000"
    assert hubprobe.data_dial_target("0.0.0.0:7000", None) is None
    assert hubprobe.data_dial_target("host.example:7000", None) is None
    assert hubprobe.data_dial_target("", "1.2.3.4") is None


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
        server = DataPlaneServer(identity, hubprobe.handle_probe_connection, max_connections=8)
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
            server = DataPlaneServer(hub_id, hubprobe.handle_probe_connection)
            await nursery.start(server.serve)
            conn = await dataplane.connect(server.addr, node_id, hub_id.peer_id, timeout_s=5)
            async with conn:
                await conn.send_request(b"bw-down 99999999999")
                frame = await conn.receive(timeout_s=5)
                assert frame.type is FrameType.ERROR
                assert parse_error(frame.payload)[0] == "bad_request"
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
