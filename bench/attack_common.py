"""Instruments the attacks of ``echo2 bench attack`` share: an honest newcomer asking for
admission (from the honest IP), the hub's responsiveness seen from its status port, RSS peaks,
and a stranger's or an admitted attacker's control host."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from echo2.bench.fuzz_observe import rss_mb


def announce(ident: Any, **over: Any) -> Any:
    from echo2.protocol.messages import Announce

    fields: dict[str, Any] = dict(
        peer_id=ident.peer_id, software_version="attack", accelerator="", accelerator_count=0,
        accelerator_memory_bytes=0, cpu_model="attack", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30,
        engine="attack", engine_version="", tokens_per_s=0.0, rollouts_per_s=0.0, upload_MBps=0.0, download_MBps=0.0,
        price_usd_per_hour=0.0, listen_addrs=[], data_addr="", reachable=False, versions_held=[], max_upload_MBps=0.0,
    )
    fields.update(over)
    return Announce(**fields)


@asynccontextmanager
async def control_host(ident: Any = None) -> AsyncIterator[Any]:
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.control import ControlHost

    async with ControlHost(ident or Identity.generate(), gossip=False, dial_timeout_s=5) as host:
        yield host


async def admit(host: Any, hub_addr: str, **announce_over: Any) -> Any:
    """Ask for admission with ``host``'s identity; the AdmissionDecision (or raises Echo2Error)."""
    from echo2.protocol import envelope, wire
    from echo2.protocol.messages import AdmissionDecision, AdmissionRequest

    ident = host.identity
    req = AdmissionRequest(peer_id=ident.peer_id, join_token="", announce=announce(ident, **announce_over))
    resp = await host.request(hub_addr, wire.ADMISSION, envelope.seal(ident, req), max_response=wire.MAX_CONTROL_REQUEST,
                              timeout_s=10)
    return envelope.open_envelope(resp, AdmissionDecision, replay=None).message


class HonestProbe:
    """A newcomer asking for admission once a second, each a fresh identity from an address of
    its own (127.0.1.N), as new volunteers are; counts the answers by outcome.

    Each from its own address since the hub counts new identities per address (A3,
    learner_hub/admission_gate.py: 32 at once, then 0.5/s): one address minting a key a second
    is what the gate exists to slow, and a probe doing so from the honest nodes' address
    measured that bound instead of the attack's effect on newcomers (session 9's probe did)."""

    def __init__(self, hub_addr: str, every_s: float = 1.0) -> None:
        self.hub_addr = hub_addr
        self.every_s = every_s
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[float] = []

    async def run(self) -> None:
        from echo2.bench.attack_swarm import attacker_source
        from echo2.protocol.errors import Echo2Error

        n = 0
        while True:
            t0 = time.monotonic()
            n += 1
            try:
                with trio.fail_after(15), attacker_source(f"127.0.1.{1 + n % 250}"):
                    async with control_host() as host:
                        d = await admit(host, self.hub_addr)
                        self.outcomes["admitted" if d.admitted else "refused:" + d.reason[:40]] += 1
            except trio.TooSlowError:
                self.outcomes["timeout"] += 1
            except Echo2Error as exc:
                self.outcomes[str(getattr(exc, "code", type(exc).__name__))] += 1
            except Exception as exc:  # a host's errors come out of its nursery wrapped
                from echo2.protocol.net.libp2p_host import find_echo2_error

                ours = find_echo2_error(exc)
                self.outcomes[str(getattr(ours, "code", type(ours).__name__)) if ours else type(exc).__name__] += 1
            self.latencies.append(round(time.monotonic() - t0, 3))
            await trio.sleep(max(0.0, self.every_s - (time.monotonic() - t0)))

    def tried(self) -> int:
        return sum(self.outcomes.values())

    def failed(self) -> int:
        return self.tried() - self.outcomes["admitted"]


class Responsiveness:
    """The hub's loop seen from outside: the time its status server takes to answer (it runs on
    the hub's trio loop, so a blocked loop shows here), polled four times a second."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.rtts: list[float] = []
        self.failures = 0

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                with trio.fail_after(30):
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                    try:
                        await stream.send_all(b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                        await stream.receive_some(256)
                    finally:
                        await trio.aclose_forcefully(stream)
                self.rtts.append(time.monotonic() - t0)
            except (trio.TooSlowError, OSError, trio.BrokenResourceError):
                self.failures += 1
            await trio.sleep(0.25)

    def max_ms(self) -> float:
        return round(max(self.rtts, default=0.0) * 1e3, 1)


class RssPeak:
    """The peak RSS growth of one process since ``run`` started (sampled four times a second)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first: float | None = None
        self.peak = 0.0

    async def run(self) -> None:
        while True:
            v = rss_mb(self.pid)
            if v is not None:
                if self.first is None:
                    self.first = v
                self.peak = max(self.peak, v - self.first)
            await trio.sleep(0.25)


def codes(text: str, *words: str) -> int:
    """Lines of ``text`` mentioning any of ``words`` (case-insensitive)."""
    pat = re.compile("|".join(re.escape(w) for w in words), re.I)
    return sum(1 for line in text.splitlines() if pat.search(line))


async def stranger_connect(addr: str, peer: str, counts: Counter[str], prefix: str) -> Any:
    """A data-plane connection to ``peer`` under a fresh throwaway key, or None after counting the
    refusal as ``{prefix}{reason}`` and pausing a second (the attackers' dial, written once)."""
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.dataplane import connect

    try:
        return await connect(addr, Identity.generate(), peer, timeout_s=5)
    except Echo2Error as exc:
        counts[f"{prefix}{getattr(exc, 'reason', getattr(exc, 'code', type(exc).__name__))}"] += 1
        await trio.sleep(1.0)
        return None
