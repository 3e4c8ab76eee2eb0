"""A peer whose requests keep being refused for rate is disconnected (A3 at the stream level).

A refusal still costs the host the stream; `bench attack` A3's admitted throwaway keys sent ~38
refused admission requests a second. Real ControlHosts on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from echo2.protocol.errors import Echo2Error, RateLimited
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost, RequestLimits

PROTO = "/echo2/test-strikes/1.0.0"


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 40.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


async def refuse(_peer: str, _data: bytes) -> bytes:
    raise RateLimited("too many of these right now; retry later")


def test_a_peer_refused_for_rate_again_and_again_is_disconnected() -> None:
    async def main() -> None:
        limits = RequestLimits(strikes_per_s=0.01, strikes_burst=5)
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as flooder,
        ):
            server.set_handler(PROTO, refuse, max_request=1024)
            gone: list[str] = []
            server.on_disconnect(lambda p: gone.append(p))
            await flooder.connect(server.addrs[0])
            codes: list[str] = []
            for _ in range(12):
                try:
                    await flooder.request(server.addrs[0], PROTO, b"x", max_response=64, timeout_s=5)
                except Echo2Error as exc:
                    codes.append(exc.code)
                if gone:
                    break
            for _ in range(100):
                if gone:
                    break
                await trio.sleep(0.05)
            assert codes[:5] == ["rate_limited"] * 5
            assert gone == [flooder.peer_id]
            assert server.refusals["dropped_for_refusals"] == 1

    run(main)


def test_a_few_refusals_cost_an_honest_peer_nothing() -> None:
    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False) as honest,
        ):
            server.set_handler(PROTO, refuse, max_request=1024)
            await honest.connect(server.addrs[0])
            for _ in range(5):  # a node retrying with backoff: a handful, well inside the burst
                try:
                    await honest.request(server.addrs[0], PROTO, b"x", max_response=64, timeout_s=5)
                except Echo2Error as exc:
                    assert exc.code == "rate_limited"
            await trio.sleep(0.2)
            assert server.is_connected(honest.peer_id)
            assert server.refusals["dropped_for_refusals"] == 0

    run(main)
