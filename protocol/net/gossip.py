"""GossipSub on the control host: settings sized for announcements, and the guarded topic readers.

py-libp2p's GossipSub defaults (120 s heartbeat, 10 msgs/s per peer and topic, a 32-deep
subscription queue that drops silently, a 1 MiB limit that drops silently) are replaced: heartbeat
1 s, a rate limit sized for a large fleet's announcements, adaptive gossip off (it can stretch the
heartbeat to 30-60 s), a reader task per subscription that drains the queue at once, and our own
size limit checked before publishing (TooLarge) and on receipt (counted refusal). Messages handed
to a handler are rate-limited per origin and topic.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID as GOSSIPSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIPSUB_V11
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from ..errors import Echo2Error, Timeout, TooLarge, TransportError
from ..peerlimit import KeyedRateLimiter
from .libp2p_host import peer_str

logger = logging.getLogger(__name__)

TopicHandler = Callable[[str, bytes], Awaitable[None]]


@dataclass(frozen=True)
class GossipConfig:
    """GossipSub settings sized for announcements, not py-libp2p's defaults.

    Announcements are a few KiB (an Announce with 16 addresses is < 4 KiB), sent on join and
    every tens of seconds per node. A relaying peer forwards the whole fleet's announcements, so
    the per-peer, per-topic rate limit must cover fleet size / announce period with margin:
    1000 nodes every 10 s is 100 msgs/s.
    """

    heartbeat_s: int = 1  # GossipSub's heartbeat_interval is an int (trio.sleep of it)
    degree: int = 6  # D, D_lo, D_hi: the GossipSub v1.1 spec defaults
    degree_low: int = 4
    degree_high: int = 12
    max_message_size: int = 64 * 1024  # per published message, checked before publishing
    max_rpc_size: int = 1024 * 1024  # one inbound pubsub RPC may batch several messages
    max_messages_per_topic_per_second: float = 200.0
    seen_ttl_s: int = 120
    handler_timeout_s: float = 10.0



async def start_gossip(host: IHost, services: contextlib.AsyncExitStack, cfg: GossipConfig) -> Pubsub:
    """GossipSub with our settings, run as services of ``services``; returns once ready."""
    router = GossipSub(
        protocols=[GOSSIPSUB_V11, GOSSIPSUB_V10],
        degree=cfg.degree,
        degree_low=cfg.degree_low,
        degree_high=cfg.degree_high,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=cfg.heartbeat_s,
        adaptive_gossip_enabled=False,
        max_messages_per_topic_per_second=cfg.max_messages_per_topic_per_second,
    )
    pubsub = Pubsub(
        host,
        router,
        seen_ttl=cfg.seen_ttl_s,
        strict_signing=True,  # messages signed by their origin's libp2p key (spec default)
        max_inbound_rpc_size=cfg.max_rpc_size,
    )
    await services.enter_async_context(background_trio_service(pubsub))
    await services.enter_async_context(background_trio_service(router))
    with trio.fail_after(10):
        await pubsub.wait_until_ready()
    return pubsub

class Gossip:
    """Publishing and subscribing, mixed into :class:`~echo2.protocol.net.control.ControlHost`
    (whose lifecycle starts GossipSub and owns the nursery the readers run in)."""

    peer_id: str
    gossip_config: GossipConfig
    refusals: collections.Counter[str]
    _pubsub: Pubsub | None
    _nursery: trio.Nursery | None
    _subscriptions: dict[str, Any]
    _gossip_rate: KeyedRateLimiter

    if TYPE_CHECKING:

        def _refuse(self, code: str, peer: str, protocol_id: str, detail: str) -> None: ...

    def _require_pubsub(self) -> Pubsub:
        if self._pubsub is None:
            raise TransportError("gossip is not running on this host")
        return self._pubsub

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish to a GossipSub topic; TooLarge (before anything is sent) above the limit."""
        limit = self.gossip_config.max_message_size
        if len(data) > limit:
            self.refusals["too_large"] += 1
            raise TooLarge(f"gossip message of {len(data)} bytes exceeds the limit of {limit}")
        pubsub = self._require_pubsub()
        try:
            await pubsub.publish(topic, data)
        except Exception as exc:
            raise TransportError(f"publish to {topic} failed: {exc}") from exc

    async def subscribe(self, topic: str, handler: TopicHandler) -> None:
        """Deliver every message on ``topic`` from other peers to ``handler(origin peer, data)``.

        One reader task per topic drains py-libp2p's 32-deep queue at once; each call is bounded
        by ``gossip_config.handler_timeout_s`` and guarded (an exception is logged, not raised).
        Our own messages are not delivered.
        """
        pubsub = self._require_pubsub()
        if self._nursery is None:
            raise TransportError("control host is not running")
        if topic in self._subscriptions:
            raise ValueError(f"already subscribed to {topic}")
        subscription = await pubsub.subscribe(topic)
        self._subscriptions[topic] = subscription
        self._nursery.start_soon(self._topic_reader, topic, subscription, handler)

    async def unsubscribe(self, topic: str) -> None:
        if self._subscriptions.pop(topic, None) is not None and self._pubsub is not None:
            await self._pubsub.unsubscribe(topic)

    async def _topic_reader(self, topic: str, subscription: Any, handler: TopicHandler) -> None:
        cfg = self.gossip_config
        while True:
            try:
                msg = await subscription.get()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            origin = "?"
            try:
                origin = ID(msg.from_id).to_base58()
                if origin == self.peer_id:
                    continue
                if not self._gossip_rate.allow((topic, origin), trio.current_time()):
                    self._refuse("rate_limited", origin, topic, "gossip messages above the per-origin rate")
                    continue
                data = bytes(msg.data)
                if len(data) > cfg.max_message_size:
                    self._refuse("too_large", origin, topic, f"gossip message of {len(data)} bytes")
                    continue
                with trio.move_on_after(cfg.handler_timeout_s) as scope:
                    await handler(origin, data)
                if scope.cancelled_caught:
                    self._refuse("timeout", origin, topic, "gossip handler timed out")
            except Echo2Error as exc:
                self._refuse(exc.code, origin, topic, exc.message)
            except Exception:
                self.refusals["internal"] += 1
                logger.exception("gossip handler for %s failed on a message from %s", topic, origin)

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to be subscribed to ``topic`` (from their subscription announcements)."""
        if self._pubsub is None:
            return []
        return [peer_str(p) for p in self._pubsub.peer_topics.get(topic, set())]

    async def wait_topic_peers(self, topic: str, count: int, *, timeout_s: float = 10.0) -> None:
        """Wait until at least ``count`` peers announced a subscription to ``topic``."""
        try:
            with trio.fail_after(timeout_s):
                while len(self.topic_peers(topic)) < count:
                    await trio.sleep(0.05)
        except trio.TooSlowError as exc:
            raise Timeout(f"fewer than {count} peers on {topic} after {timeout_s:g} s") from exc
