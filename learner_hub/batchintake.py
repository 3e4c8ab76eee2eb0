"""Batched result intake and the channel offer (issue 20, item 2): the hub's side.

A :class:`~echo2.protocol.batchmessages.ResultBatch` is opened like any request (size, signature
over the raw bytes, signer admitted, replay), then each item, a result's own signed envelope, goes
through the hub's per-result intake (``per_result``: :meth:`Hub.on_result`, one call per item, so
whatever judges a lone result judges a batched one the same way). The items are judged at once,
not one after another: each accepted result waits for its durable store commit, and the store
worker commits what is queued together. Each item gets its verdict in the :class:`BatchAck`: the
hub's signed receipt, or the refusal's code and message, exactly what the lone request would have
answered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from echo2.protocol import envelope
from echo2.protocol.batchmessages import (
    MAX_BATCH_BYTES,
    MAX_BATCH_RESULTS,
    BatchAck,
    BatchVerdict,
    ChannelOffer,
    ResultBatch,
)
from echo2.protocol.errors import Echo2Error, MeaningError, NotAdmitted
from echo2.protocol.identity import Identity
from echo2.protocol.wire import MAX_RESULT

log = logging.getLogger(__name__)

PerResult = Callable[[str, bytes], Awaitable[bytes]]
Allowed = Callable[[str, type], bool]


async def judge_batch(identity: Identity, peer: str, data: bytes, *, replay: envelope.PeerReplay, allowed: Allowed,
                      per_result: PerResult) -> bytes:
    """The sealed BatchAck for one ResultBatch from ``peer``; an Echo2Error refuses the batch whole."""
    batch = envelope.open_envelope(data, ResultBatch, replay=replay, allowed=allowed, max_size=MAX_RESULT).message
    if batch.node_id != peer:
        raise MeaningError("result batch names another node")
    verdicts: list[BatchVerdict | None] = [None] * len(batch.results)

    async def one(i: int, item: bytes) -> None:
        try:
            receipt = await per_result(peer, item)
            verdicts[i] = BatchVerdict(accepted=True, code="ok", message="", receipt=receipt)
        except Echo2Error as exc:
            verdicts[i] = BatchVerdict(accepted=False, code=exc.code[:64], message=exc.message[:1024], receipt=b"")
        except Exception as exc:  # a bug judging one item must not cost the others their verdicts
            log.exception("judging item %d of a result batch from %s failed", i, peer)
            verdicts[i] = BatchVerdict(accepted=False, code="internal", message=f"internal error ({type(exc).__name__})",
                                       receipt=b"")

    async with trio.open_nursery() as nursery:
        for i, item in enumerate(batch.results):
            nursery.start_soon(one, i, item)
    done = [v for v in verdicts if v is not None]
    assert len(done) == len(verdicts)
    return envelope.seal(identity, BatchAck(node_id=peer, verdicts=done), ttl_s=300)


def channel_offer(identity: Identity, peer: str, addr: str | None, *, admitted: bool) -> bytes:
    """The sealed ChannelOffer for an admitted node; a refusal when there is no channel."""
    if not admitted:
        raise NotAdmitted("this node is not admitted (the hub may have restarted): request admission")
    if not addr:
        raise MeaningError("this hub serves no channel: use the control plane")
    offer = ChannelOffer(hub_id=identity.peer_id, node_id=peer, addr=addr, max_batch=MAX_BATCH_RESULTS,
                         max_batch_bytes=MAX_BATCH_BYTES)
    return envelope.seal(identity, offer, ttl_s=300)
