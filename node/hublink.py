"""The node's requests to its hub: on the long-lived channel when it is up, else on a fresh libp2p
stream each, as before (issue 20, item 2; why the channel is the data plane's TCP:
:mod:`echo2.protocol.channel`).

:class:`HubLink` has the control host's ``request`` signature, so the task loop, the holds report
and the pauser call it as they called the host. Its :meth:`run` keeps the channel: ask the hub
where (``CHANNEL`` on the control plane: a signed ChannelOffer), dial it, read replies until it
ends, then try again with capped backoff. A hub without a channel (an older hub, or
``channel = false``) answers the ask with an error: the node stays on the control plane and asks
again later. A request already on the channel when it breaks fails with ``TransportError``, which
every caller already retries (a result is resealed for its retry, so a copy the hub did take
reads as a duplicate, never as a replay).

A running node's results go through :meth:`send_batch` (several sealed results in one signed
ResultBatch, a verdict per item), driven by the node's outbox (:mod:`.taskloop_delivery`, which
decides what goes together, within :meth:`batch_limits`). :meth:`send_result` batches for callers
that send results concurrently: while one send is on the wire, results finished meanwhile queue
up and go together (at most the hub's offered count and bytes); a result that finds nothing else
waiting goes at once, alone, as the plain RESULT request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from echo2.protocol import envelope
from echo2.protocol.backoff import Backoff
from echo2.protocol.batchmessages import BatchAck, ChannelOffer, ResultBatch
from echo2.protocol.channel import OP_BY_PROTOCOL, batch_prefix
from echo2.protocol.errors import Echo2Error, MeaningError, TransportError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.net.channel import ChannelClient
from echo2.protocol.net.control import ControlHost
from echo2.protocol.net.names import reachable_data_addr
from echo2.protocol.wire import CHANNEL, MAX_CONTROL_REQUEST, RESULT, RESULTS

log = logging.getLogger(__name__)

#: how long a node waits before asking a hub without a channel again
NO_CHANNEL_RETRY_S = 60.0


class _Pending:
    __slots__ = ("sealed", "done", "reply", "error")

    def __init__(self, sealed: bytes) -> None:
        self.sealed = sealed
        self.done = trio.Event()
        self.reply: bytes | None = None
        self.error: Exception | None = None


class HubLink:
    def __init__(self, host: ControlHost, identity: Identity, hub_peer: str, *, enabled: bool = True,
                 replay: envelope.ReplayGuard | None = None) -> None:
        self.host, self.identity, self.hub_peer, self.enabled = host, identity, hub_peer, enabled
        self.replay = replay
        self.channel: ChannelClient | None = None
        self.offer: ChannelOffer | None = None
        self.channel_requests = 0  # answered on the channel (for tests and the bench)
        self.batches_sent = 0
        self._queue: deque[_Pending] = deque()
        self._queued = trio.Event()
        self._flushing = False

    @property
    def up(self) -> bool:
        return self.channel is not None and self.channel.up

    async def request(self, peer: str, protocol_id: str, payload: bytes, *, max_response: int,
                      timeout_s: float | None = None) -> bytes:
        ch = self.channel
        if ch is not None and ch.up and peer == self.hub_peer and protocol_id in OP_BY_PROTOCOL:
            reply = await ch.request(protocol_id, payload, max_response=max_response,
                                     timeout_s=self.host.request_timeout_s if timeout_s is None else timeout_s)
            self.channel_requests += 1
            return reply
        return await self.host.request(peer, protocol_id, payload, max_response=max_response, timeout_s=timeout_s)

    # --- results ----------------------------------------------------------------------------------
    async def send_result(self, sealed: bytes, *, timeout_s: float = 30.0) -> bytes:
        """Deliver one sealed result; its receipt, or the hub's refusal as RemoteError."""
        if not self.up or not self._flushing:
            return await self.request(self.hub_peer, RESULT, sealed, max_response=MAX_CONTROL_REQUEST, timeout_s=timeout_s)
        item = _Pending(sealed)
        self._queue.append(item)
        self._queued.set()
        with trio.fail_after(timeout_s + 30.0):  # the flusher answers every item; this is a backstop
            await item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.reply is not None
        return item.reply

    async def _flusher(self) -> None:
        self._flushing = True
        try:
            while True:
                await self._queued.wait()
                self._queued = trio.Event()
                while self._queue:
                    await self._flush_once()
        finally:
            self._flushing = False
            while self._queue:
                item = self._queue.popleft()
                item.error = TransportError("the hub link stopped")
                item.done.set()

    async def _flush_once(self) -> None:
        offer = self.offer
        max_count = offer.max_batch if offer is not None and self.up else 1
        max_bytes = offer.max_batch_bytes if offer is not None else 0
        n = batch_prefix([len(p.sealed) for p in self._queue], max_count=max_count, max_bytes=max_bytes)
        items = [self._queue.popleft() for _ in range(n)]
        try:
            if len(items) == 1:
                items[0].reply = await self.request(self.hub_peer, RESULT, items[0].sealed,
                                                    max_response=MAX_CONTROL_REQUEST, timeout_s=30)
            else:
                await self._send_batch(items)
        except (Echo2Error, OSError) as exc:
            for item in items:
                if item.reply is None and item.error is None:
                    item.error = exc
        finally:
            for item in items:
                if item.reply is None and item.error is None:
                    item.error = TransportError("result not answered")
                item.done.set()

    async def _send_batch(self, items: list[_Pending]) -> None:
        for item, outcome in zip(items, await self.send_batch([p.sealed for p in items]), strict=True):
            if isinstance(outcome, bytes):
                item.reply = outcome
            else:
                item.error = outcome

    def batch_limits(self) -> tuple[int, int]:
        """(results, bytes) one ResultBatch may carry now: the hub's offer while the channel is
        up; (1, 0) without it (results then go one per request on the control plane)."""
        offer = self.offer
        if offer is None or not self.up:
            return 1, 0
        return offer.max_batch, offer.max_batch_bytes

    async def send_batch(self, sealed: list[bytes], *, timeout_s: float = 60.0) -> list[bytes | RemoteError]:
        """Send sealed results as one signed ResultBatch; per item, in order, the hub's receipt or
        its refusal. A refusal of the whole batch raises RemoteError; a transport failure, or an
        acknowledgement that does not answer this batch, raises Echo2Error (nothing is known)."""
        batch = ResultBatch(node_id=self.identity.peer_id, results=list(sealed))
        reply = await self.request(self.hub_peer, RESULTS, envelope.seal(self.identity, batch, ttl_s=300),
                                   max_response=MAX_CONTROL_REQUEST, timeout_s=timeout_s)
        ack = envelope.open_envelope(reply, BatchAck, replay=self.replay, allowed=self._hub_only).message
        if ack.node_id != self.identity.peer_id or len(ack.verdicts) != len(sealed):
            raise MeaningError("the hub's batch acknowledgement does not match the batch")
        self.batches_sent += 1
        return [v.receipt if v.accepted else RemoteError(v.code, v.message) for v in ack.verdicts]

    def _hub_only(self, signer: str, _t: type) -> bool:
        return signer == self.hub_peer

    # --- the channel --------------------------------------------------------------------------------
    async def run(self, on_offer: Callable[[ChannelOffer], None] | None = None) -> None:
        """Keep the channel up (and the result batcher running) until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flusher)
            if not self.enabled:
                await trio.sleep_forever()
            backoff = Backoff(base_s=1.0, cap_s=30.0)
            while True:
                try:
                    await self._open()
                    backoff.reset()
                except RemoteError as exc:
                    log.info("hub offers no channel (%s): requests stay on the control plane", exc)
                    await trio.sleep(NO_CHANNEL_RETRY_S)
                    continue
                except (Echo2Error, OSError) as exc:
                    delay = backoff.failed()
                    log.info("channel to the hub not opened (%s); retry in %.1f s", exc, delay)
                    await trio.sleep(delay)
                    continue
                ch = self.channel
                assert ch is not None
                log.info("channel to the hub open at %s", ch.conn.remote_ip())
                try:
                    await ch.run()
                finally:
                    self.channel = None
                    await ch.aclose()
                await trio.sleep(backoff.failed())

    async def _open(self) -> None:
        reply = await self.host.request(self.hub_peer, CHANNEL, b"", max_response=MAX_CONTROL_REQUEST, timeout_s=10)
        offer = envelope.open_envelope(reply, ChannelOffer, replay=self.replay, allowed=self._hub_only).message
        if offer.hub_id != self.hub_peer or offer.node_id != self.identity.peer_id:
            raise MeaningError("channel offer names another hub or node")
        addr = reachable_data_addr(offer.addr, self.host.remote_ip(self.hub_peer))
        self.channel = await ChannelClient.open(addr, self.identity, self.hub_peer)
        self.offer = offer
