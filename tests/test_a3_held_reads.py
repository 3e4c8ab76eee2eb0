"""A3 at the transport: a peer refused for rate is not read again until it may ask again.

`bench attack` A3 (session 11): admitted throwaway keys asked for admission again as fast as the
hub answered; each refusal was cheap but the py-libp2p stream it came on cost ~3 ms of hub CPU,
~38 a second, 29 % of the honest nodes' rate. Now the refusal holds the requester's connection
unread for the bucket's wait (protocol/net/yamux_guard.py), so a flooder's next request waits in
its own buffers. Real ControlHosts on 127.0.0.1.
"""

from __future__ import annotations

import trio
from test_a1_inflight import run

from echo2.learner_hub.admission_gate import AdmissionGate, AdmissionLimits
from echo2.protocol.errors import Echo2Error, RateLimited
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost, RequestLimits
from echo2.protocol.net.yamux_guard import MAX_HOLD_S
from echo2.protocol.peerlimit import KeyedRateLimiter

ASK = "/echo2/test-a3-held/1.0.0"


def test_wait_s_is_the_time_to_the_next_token() -> None:
    lim = KeyedRateLimiter(0.5, 2.0)
    assert lim.wait_s("k", 0.0) == 0.0  # untracked: a full bucket
    assert lim.allow("k", 0.0) and lim.allow("k", 0.0) and not lim.allow("k", 0.0)
    assert abs(lim.wait_s("k", 0.0) - 2.0) < 1e-9
    assert abs(lim.wait_s("k", 1.5) - 0.5) < 1e-9
    assert lim.wait_s("k", 2.0) == 0.0


def test_admission_gate_refusal_says_when_to_retry() -> None:
    gate = AdmissionGate(AdmissionLimits(key_per_s=0.5, key_burst=1.0), known=["old"])
    assert gate.refusal("old", "198.51.100.9", 10.0) is None
    refused = gate.refusal("old", "198.51.100.9", 10.5)
    assert isinstance(refused, RateLimited) and refused.code == "rate_limited"
    assert abs(refused.retry_after_s - 1.5) < 1e-9
    assert "too many admission requests" in refused.message


def test_a3_rate_limited_requester_is_held_not_served_again() -> None:
    """A requester that asks again at once after each refusal reaches the handler about once per
    hold, not once per round trip; another peer is served meanwhile; the held one's request is
    answered once the hold ends (late, not lost)."""

    async def main() -> None:
        calls: dict[str, int] = {}
        hold_s = 1.0

        async def ask(peer: str, data: bytes) -> bytes:
            calls[peer] = calls.get(peer, 0) + 1
            if data == b"flood":
                raise RateLimited("asked too often; retry later", hold_s)
            return b"ok"

        async with (
            ControlHost(Identity.generate(), gossip=False, limits=RequestLimits(end_grace_s=0.5)) as server,
            ControlHost(Identity.generate(), gossip=False) as flooder,
            ControlHost(Identity.generate(), gossip=False) as honest,
        ):
            server.set_handler(ASK, ask, max_request=1024)
            await flooder.connect(server.addrs[0])
            await honest.connect(server.addrs[0])
            answered = refused = 0
            honest_rtts: list[float] = []

            async def flood() -> None:
                nonlocal refused
                while True:
                    try:
                        await flooder.request(server.peer_id, ASK, b"flood", max_response=1024)
                    except Echo2Error as exc:
                        refused += exc.code == "rate_limited"

            async def polite() -> None:
                nonlocal answered
                for _ in range(10):
                    t0 = trio.current_time()
                    assert await honest.request(server.peer_id, ASK, b"hi", max_response=64) == b"ok"
                    honest_rtts.append(trio.current_time() - t0)
                    answered += 1
                    await trio.sleep(0.2)

            window_s = 2.5
            async with trio.open_nursery() as n:
                n.start_soon(flood)
                await polite()
                await trio.sleep(max(0.0, window_s - 10 * 0.2))
                n.cancel_scope.cancel()
            served = calls.get(flooder.peer_id, 0)
            # refused at once each time, the flooder reached the handler hundreds of times in 2.5 s
            assert 1 <= served <= window_s / hold_s + 2, served
            assert refused >= 1
            assert answered == 10 and max(honest_rtts) < hold_s, honest_rtts
            assert server.refusals["rate_limited"] == served
            # the hold ends: the flooder's next request is read and answered
            await trio.sleep(hold_s)
            with trio.fail_after(MAX_HOLD_S + 5):
                try:
                    await flooder.request(server.peer_id, ASK, b"flood", max_response=1024)
                except Echo2Error as exc:
                    assert exc.code == "rate_limited"
            assert calls[flooder.peer_id] == served + 1

    run(main, 60.0)


def test_a3_bucket_refusal_holds_too() -> None:
    """The transport's own per-protocol bucket holds its refused peer for the bucket's wait."""

    async def main() -> None:
        calls = 0

        async def ask(_peer: str, _data: bytes) -> bytes:
            nonlocal calls
            calls += 1
            return b"ok"

        limits = RequestLimits(per_protocol={ASK: (1.0, 2.0)}, end_grace_s=0.5)
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as flooder,
        ):
            server.set_handler(ASK, ask, max_request=1024)
            await flooder.connect(server.addrs[0])
            outcomes: dict[str, int] = {}
            with trio.move_on_after(2.5):
                while True:
                    try:
                        await flooder.request(server.peer_id, ASK, b"x", max_response=64)
                        outcomes["ok"] = outcomes.get("ok", 0) + 1
                    except Echo2Error as exc:
                        outcomes[exc.code] = outcomes.get(exc.code, 0) + 1
            # burst 2, then 1/s; each refusal holds the connection until the next token
            assert 2 <= calls <= 5, (calls, outcomes)
            assert outcomes.get("rate_limited", 0) <= 4, outcomes

    run(main, 30.0)
