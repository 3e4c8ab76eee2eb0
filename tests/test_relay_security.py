"""Issue 15 findings on the node side of the broadcast (A4 open data plane, A7 manifest sizes, A13
rollback) and the hub side (A9 demotion on evidence only), against a real hub sender and real
relay nodes on 127.0.0.1 (the Swarm of test_relay_runtime)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest
import trio
from test_relay_runtime import Swarm, _state

from echo2.node.relay_guard import PeerGate
from echo2.node.relay_state import RelayConfig, budget_refusal, is_news, star_view
from echo2.protocol import envelope, packing
from echo2.protocol.dataframe import FrameType
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ChunkHave, ChunkRequest, Manifest, ManifestChunk, TensorEntry
from echo2.protocol.net.dataplane import connect
from echo2.protocol.relay import Relay
from echo2.protocol.wire import REQ_GET, encode_request

MiB = 1024 * 1024


def _huge_manifest(version: int, model_config: str) -> Manifest:
    """A consistent, hub-signable manifest of 1 TiB (64 MiB chunks): every size in it is a claim."""
    chunk, total = 64 * MiB, 1 << 40
    n = total // chunk
    return Manifest(
        version=version, parent=None, created=time.time(), chunk_size=chunk, total_bytes=total,
        tensors=[TensorEntry(name="w", dtype="uint8", shape=[total], offset=0, nbytes=total)],
        chunks=[
            ManifestChunk(index=i, offset=i * chunk, raw_size=chunk, raw_hash=bytes(32), encoding="full",
                          enc_size=chunk, enc_hash=bytes(32), parent_raw_hash=None)
            for i in range(n)
        ],
        model_config=model_config, artifacts={}, bf16_split=False,
    )


def test_a7_manifest_claiming_a_tebibyte_is_refused_and_the_node_stays_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="echo2.node.relay_runtime")

    async def main() -> None:
        with trio.fail_after(60):
            sw = Swarm(tmp_path, 1, chunk=64 * 1024, up_MBps=50.0)
            async with trio.open_nursery() as nursery:
                await sw.start(nursery)
                await sw.publish(1, _state(200_000, 1))
                await sw.wait_holds(1, sw.nodes)
                node = sw.nodes[0]
                pub = sw.publisher.latest
                assert pub is not None
                refused: list[tuple[int, str]] = []
                node.on_refused = lambda v, why: refused.append((v, why))  # the node pauses with it (issue 19)
                huge = _huge_manifest(5, pub.packed.manifest.model_config)
                sw.sender.links[node.me].put(("manifest", 1, envelope.seal(sw.hub_id, huge, ttl_s=600)))
                with trio.move_on_after(10):
                    while "manifest v5 refused" not in caplog.text:
                        await trio.sleep(0.05)
                assert node.bc is not None and node.bc.version == 1, "the 1 TiB version must not start"
                assert "manifest v5 refused" in caplog.text
                assert [v for v, _ in refused] == [5] and "1099511627776" in refused[0][1].replace(",", ""), refused
                await sw.publish(6, _state(200_000, 6))  # still up, and still taking real versions
                await sw.wait_holds(6, sw.nodes)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a7_manifest_sizes_are_checked_against_memory_and_disk(tmp_path: Path) -> None:
    m = _huge_manifest(1, "{}")
    cfg = RelayConfig(max_memory_bytes=4 * 1024**3)
    assert "memory" in (budget_refusal(m, cfg, missing_bytes=m.total_bytes, free_disk=1 << 50) or "")
    small = dataclasses.replace(m, total_bytes=MiB)
    assert "disk" in (budget_refusal(small, cfg, missing_bytes=MiB, free_disk=MiB) or "")
    assert budget_refusal(small, cfg, missing_bytes=MiB, free_disk=1 << 40) is None


def test_a13_rollback_replayed_older_manifest_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        with trio.fail_after(60):
            sw = Swarm(tmp_path, 1, chunk=64 * 1024, up_MBps=50.0)
            async with trio.open_nursery() as nursery:
                await sw.start(nursery)
                await sw.publish(1, _state(200_000, 1))
                pub1 = sw.publisher.latest
                assert pub1 is not None
                await sw.wait_holds(1, sw.nodes)
                await sw.publish(2, _state(200_000, 2))
                await sw.wait_holds(2, sw.nodes)
                node = sw.nodes[0]
                # An old, still valid, hub-signed manifest replayed to the node (by whoever kept it).
                sw.sender.links[node.me].put(("manifest", 2, pub1.manifest_envelope))
                await trio.sleep(1.0)
                assert node.bc is not None and node.bc.version == 2, "rolled back to an older version"
                assert node.held is not None and node.held.version == 2
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a13_rollback_only_a_later_signing_is_news() -> None:
    m = _huge_manifest(3, "{}")
    other = dataclasses.replace(m, chunks=[dataclasses.replace(m.chunks[0], raw_hash=b"\x01" * 32), *m.chunks[1:]])
    older, later = m.created - 60, m.created + 60
    assert not is_news(dataclasses.replace(other, version=2, created=older), m)  # a replayed older version
    assert not is_news(dataclasses.replace(other, created=older), m)  # an older signing of the same number
    assert not is_news(dataclasses.replace(other, version=9, created=older), m)  # a hub's earlier run, further on
    assert is_news(dataclasses.replace(other, created=later), m)  # a restarted hub's word on its version
    assert is_news(dataclasses.replace(other, version=2, created=later), m)  # ... resumed from an older checkpoint
    assert is_news(dataclasses.replace(other, version=4, created=later), m)
    assert not is_news(m, m)


def test_a4_stranger_is_refused_on_the_data_plane(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="echo2.node.relay_guard")

    async def main() -> None:
        with trio.fail_after(60):
            sw = Swarm(tmp_path, 1, chunk=64 * 1024, up_MBps=50.0)
            async with trio.open_nursery() as nursery:
                await sw.start(nursery)
                await sw.publish(1, _state(200_000, 1))
                await sw.wait_holds(1, sw.nodes)
                node = sw.nodes[0]
                # Checked by the data plane's own limits: a chunk frame is at most one chunk of
                # the version plus its header, and verified chunks wait in a bounded queue.
                hub_link = node.links[sw.hub_id.peer_id].conn
                assert hub_link.max_sizes[FrameType.CHUNK] <= packing.max_encoded_size(64 * 1024) + 13
                assert node._store_tx.statistics().max_buffer_size < 1000
                stranger = Identity.generate()
                conn = await connect(node.data_addr, stranger, node.me, timeout_s=5)
                await conn.send_request(encode_request(REQ_GET, m=ChunkRequest(version=1, indices=[0, 1]).to_wire()))
                served = False
                with trio.move_on_after(5):
                    try:
                        while True:
                            f = await conn.receive()
                            if f.type is FrameType.CHUNK:
                                served = True
                                break
                            if f.type is FrameType.BYE:
                                break
                    except Echo2Error:
                        pass
                await conn.abort()
                assert not served, "a peer in no plan was served"
                assert "in no current plan: refused" in caplog.text
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a4_relay_queue_is_deduplicated_and_bounded() -> None:
    plan = star_view("n", "h")
    relay = Relay("n", plan, [bytes(32)] * 4, have=range(4), window=1)
    for _ in range(1000):
        relay.on_request("p", [0, 1, 2, 3])
    assert len(relay._queue["p"]) <= 4


def test_a4_early_buffers_are_bounded_per_peer() -> None:
    gate = PeerGate("me", "hub")
    big = bytes(MiB)
    kept = sum(gate.buffer_chunk("p", 7, big) for _ in range(100))
    assert kept * MiB <= 16 * MiB
    assert gate.buffer_chunk("q", 7, big), "another peer has its own budget"
    for k in range(10_000):
        gate.keep_have(f"peer{k}", ChunkHave(peer_id="me", version=9, have=b"\xff"))
    assert len(gate.early_have) <= 256
    gate.take_chunks(8)
    assert gate.early_bytes == 0  # a newer version makes older early chunks worthless
    limits = gate.frame_limits("stranger", 4 * MiB, 100)
    assert limits[FrameType.MESSAGE] <= 4096 and limits[FrameType.CHUNK] <= packing.max_encoded_size(4 * MiB) + 13


def test_a9_demotion_only_on_evidence_the_accused_served(tmp_path: Path) -> None:
    """Both nodes are accused (as a relay report does); the hub asks each to serve it a chunk:
    the honest one serves it intact and stays trusted, the corrupting one is distrusted."""

    async def main() -> None:
        with trio.fail_after(60):
            sw = Swarm(tmp_path, 2, chunk=64 * 1024, up_MBps=50.0, corrupt=frozenset({0}))
            async with trio.open_nursery() as nursery:
                await sw.start(nursery)
                await sw.publish(1, _state(300_000, 1))
                await sw.wait_holds(1, sw.nodes)
                liar_target, corrupt = sw.nodes[1], sw.nodes[0]
                convicted: list[str] = []
                sw.sender.on_convicted = lambda peer, _why: convicted.append(peer)
                for nd in (liar_target, corrupt):
                    sw.sender.accuse(nd.me, "reported by a peer")
                assert liar_target.me not in sw.sender.distrusted, "distrusted on an accusation alone"
                with trio.move_on_after(10):
                    while corrupt.me not in sw.sender.distrusted or liar_target.me in sw.sender.suspects:
                        await trio.sleep(0.05)
                assert corrupt.me in sw.sender.distrusted, "served a corrupt chunk: evidence"
                assert liar_target.me not in sw.sender.distrusted and liar_target.me not in sw.sender.suspects
                assert convicted == [corrupt.me], "punished (banned by the fleet) on the conviction only"
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a9_demotion_not_on_a_childs_pull(tmp_path: Path) -> None:
    """A child pulling its stripe from the hub is its word against its parent's: the parent is
    not demoted for it (the hub demotes only on what it saw itself)."""

    async def main() -> None:
        with trio.fail_after(60):
            sw = Swarm(tmp_path, 4, chunk=128 * 1024, up_MBps=8.0)
            async with trio.open_nursery() as nursery:
                await sw.start(nursery)
                await sw.publish(1, _state(1_000_000, 1))
                await sw.wait_holds(1, sw.nodes)
                cur = sw.sender.cur
                hub = sw.hub_id.peer_id
                pairs = [(child, p, s) for s in range(cur.plan.stripes)
                         for child, p in cur.plan.parent[s].items() if p != hub]
                assert pairs, f"the planner made no node a relay: {cur.plan.parent}"
                child, parent, stripe = pairs[0]
                node = next(nd for nd in sw.nodes if nd.me == child)
                indices = [i for i in range(cur.relay.n) if cur.plan.stripe_of(i) == stripe][:4]
                req = encode_request(REQ_GET, m=ChunkRequest(version=1, indices=indices).to_wire())
                for _ in range(3):
                    await node.links[hub].conn.send_request(req)
                await trio.sleep(1.0)
                assert parent not in sw.sender.demoted, "demoted on a child's word"
                nursery.cancel_scope.cancel()

    trio.run(main)
