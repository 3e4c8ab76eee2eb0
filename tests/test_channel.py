"""Batched results and the node's channel to its hub (issue 20, item 2): the sans-IO core, then a
real Hub object serving a real ChannelServer on 127.0.0.1 to a ChannelClient and a HubLink."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.batchmessages import BatchAck, ResultBatch
from echo2.protocol.channel import (
    KIND_REPLY,
    KIND_REQUEST,
    OP_BY_PROTOCOL,
    RequestIds,
    batch_prefix,
    pack_key,
    unpack_key,
)
from echo2.protocol.dataframe import FrameType
from echo2.protocol.errors import DecodeError, HandshakeError, MeaningError, TransportError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest, Heartbeat, Receipt, Result, Task, task_hash
from echo2.protocol.net.channel import ChannelClient, ChannelServer
from echo2.protocol.wire import HOLDS, MAX_CONTROL_REQUEST, MAX_TASK, RESULT, RESULTS, WORK


def test_keys_round_trip_and_refuse_strangers() -> None:
    for proto, op in OP_BY_PROTOCOL.items():
        k = unpack_key(pack_key(KIND_REQUEST, op.code, 2**32 - 1))
        assert (k.kind, k.op.protocol_id, k.rid) == (KIND_REQUEST, proto, 2**32 - 1)
    good = pack_key(KIND_REPLY, 1, 7)
    for bad in (bytes(32), good[:31], b"\x00" + good[1:], good[:31] + b"\x01", good[:2] + b"\x09" + good[3:],
                good[:3] + b"\x63" + good[4:]):
        with pytest.raises(DecodeError):
            unpack_key(bad)
    assert OP_BY_PROTOCOL[WORK].frame is FrameType.REQUEST and OP_BY_PROTOCOL[RESULTS].frame is FrameType.MESSAGE


def test_batch_prefix_and_request_ids() -> None:
    assert batch_prefix([], max_count=4, max_bytes=10) == 0
    assert batch_prefix([50], max_count=4, max_bytes=10) == 1  # one item goes alone whatever its size
    assert batch_prefix([3, 3, 3, 3, 3], max_count=4, max_bytes=100) == 4
    assert batch_prefix([3, 3, 5, 1], max_count=8, max_bytes=10) == 2
    ids = RequestIds()
    a, b = ids.take(), ids.take()
    assert a != b and ids.done(a) and not ids.done(a)
    ids._next = b  # wrapped onto one still waiting: skipped
    assert ids.take() not in (a, b) or not ids.done(b)


@pytest.fixture()
def hub(tmp_path: Path) -> Hub:
    return Hub(small_hub_cfg(tmp_path))


def _admit(hub: Hub, node: Identity) -> None:
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
    trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    assert node.peer_id in hub.nodes
    hub.nodes[node.peer_id].held_version = hub.learner.version


def _result(hub: Hub, node: Identity, task: Task) -> bytes:
    plain = [t for t in range(3, 60) if t not in set(hub.tok.stop_ids)]
    comps = [Result.SPEC["completions"].item.cls(prompt_index=i, token_ids=plain[: task.max_new_tokens],  # type: ignore[attr-defined]
                                                   logprobs=[-0.5] * task.max_new_tokens, finish_reason="length")
             for i in range(len(task.prompts)) for _ in range(task.group_size)]
    r = Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0, completions=comps,
               started_at=time.time(), gen_seconds=0.1, tokens=sum(len(c.token_ids) for c in comps))
    return envelope.seal(node, r, ttl_s=300)


def _handlers(hub: Hub) -> dict[str, object]:
    return {WORK: hub.on_work, RESULT: hub.on_result, RESULTS: hub.on_results, HOLDS: hub.on_holds}


def test_batch_over_the_channel_gets_a_verdict_per_item(hub: Hub) -> None:
    node, stranger = Identity.generate(), Identity.generate()
    _admit(hub, node)

    async def main() -> None:
        hub._refill()  # prompts in the queue, as the learner loop keeps it
        server = ChannelServer(hub.identity, _handlers(hub), allow=lambda p: p in hub.nodes)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            with pytest.raises(HandshakeError):  # not admitted: no channel
                await ChannelClient.open(server.addr, stranger, hub.identity.peer_id)
            ch = await ChannelClient.open(server.addr, node, hub.identity.peer_id)
            nursery.start_soon(ch.run)
            hb = Heartbeat(peer_id=node.peer_id, seq=1, versions_held=[0], busy_tasks=0, queue_free=1)
            with trio.fail_after(30):
                reply = await ch.request(WORK, envelope.seal(node, hb), max_response=MAX_TASK, timeout_s=20)
            task = envelope.open_envelope(reply, Task, replay=None).message
            good = _result(hub, node, task)
            batch = ResultBatch(node_id=node.peer_id, results=[good, b"\x00not an envelope", good])
            with trio.fail_after(60):
                reply = await ch.request(RESULTS, envelope.seal(node, batch), max_response=MAX_CONTROL_REQUEST, timeout_s=60)
            ack = envelope.open_envelope(reply, BatchAck, replay=None).message
            assert [v.accepted for v in ack.verdicts].count(True) == 1  # the same result twice: one is a duplicate
            assert ack.verdicts[1].code != "ok" and not ack.verdicts[1].accepted
            ok = next(v for v in ack.verdicts if v.accepted)
            rec = envelope.open_envelope(ok.receipt, Receipt, replay=None).message
            assert rec.task_ids == [task.task_id] and rec.node_id == node.peer_id
            assert hub.dispatcher.stats.accepted == 1
            # a batch naming another node is refused whole, as an error reply on the channel
            other = ResultBatch(node_id=stranger.peer_id, results=[good])
            with pytest.raises(RemoteError) as err:
                await ch.request(RESULTS, envelope.seal(node, other), max_response=MAX_CONTROL_REQUEST, timeout_s=20)
            assert err.value.code == MeaningError.code
            # a control frame over its limit is refused from its header: the connection is dropped
            with pytest.raises(TransportError), trio.fail_after(20):
                await ch.request(WORK, b"\x00" * (100 * 1024), max_response=MAX_TASK, timeout_s=15)
            assert not ch.up
            assert server.server.stats.refusals["frame.too_large"] == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_hub_link_uses_the_channel_batches_and_falls_back_to_streams(hub: Hub) -> None:
    from echo2.learner_hub.serve import _start_channel
    from echo2.node.hublink import HubLink
    from echo2.protocol.net.control import ControlHost
    from echo2.protocol.wire import CHANNEL

    node = Identity.generate()
    _admit(hub, node)
    hub_peer = hub.identity.peer_id

    async def main() -> None:
        hub._refill()
        async with ControlHost(hub.identity, gossip=False) as hhost, ControlHost(node, gossip=False) as nhost:
            for proto, handler in (*_handlers(hub).items(), (CHANNEL, hub.on_channel)):
                hhost.set_handler(proto, handler, max_request=64 << 20)  # type: ignore[arg-type]
            async with trio.open_nursery() as nursery:
                await _start_channel(hub, hhost, nursery)
                await nhost.connect(hhost.addrs[0])
                link = HubLink(nhost, node, hub_peer)
                nursery.start_soon(link.run)
                with trio.fail_after(20):
                    while not link.up:
                        await trio.sleep(0.05)
                hb = Heartbeat(peer_id=node.peer_id, seq=1, versions_held=[0], busy_tasks=0, queue_free=1)
                with trio.fail_after(30):
                    reply = await link.request(hub_peer, WORK, envelope.seal(node, hb), max_response=MAX_TASK, timeout_s=20)
                assert link.channel_requests == 1
                task = envelope.open_envelope(reply, Task, replay=None).message
                good = _result(hub, node, task)
                outcomes: list[object] = []

                async def send(data: bytes) -> None:
                    try:
                        outcomes.append(await link.send_result(data, timeout_s=30))
                    except RemoteError as exc:
                        outcomes.append(exc.code)

                with trio.fail_after(60):
                    async with trio.open_nursery() as senders:
                        for data in (good, good, b"\x00junk"):
                            senders.start_soon(send, data)
                assert link.batches_sent == 1  # finished together: one batch, one verdict each
                receipts = [o for o in outcomes if isinstance(o, bytes)]
                assert len(receipts) == 1 and len(outcomes) == 3 and hub.dispatcher.stats.accepted == 1
                envelope.open_envelope(receipts[0], Receipt, replay=None)
                # the channel goes down and the hub offers none any more: the same requests take
                # a libp2p stream each, as before the channel
                hub.channel_addr = ""
                assert link.channel is not None
                await link.channel.conn.abort()
                with trio.fail_after(10):
                    while link.up:
                        await trio.sleep(0.05)
                hb = Heartbeat(peer_id=node.peer_id, seq=2, versions_held=[0], busy_tasks=0, queue_free=1)
                with trio.fail_after(30):
                    await link.request(hub_peer, WORK, envelope.seal(node, hb), max_response=MAX_TASK, timeout_s=20)
                assert link.channel_requests == 2  # one more: the send_result batch
                nursery.cancel_scope.cancel()

    trio.run(main)
