"""A1 (node side): a result refused for now (busy, timeout) is kept and sent again with backoff until
its deadline; a verdict (duplicate, forged, ...) ends it at once. Real ControlHosts on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from echo2.node.delivery import deliver_until
from echo2.protocol.backoff import Backoff
from echo2.protocol.errors import Echo2Error, MeaningError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost

RESULT = "/echo2/test-a1-result/1.0.0"


class Busy(Echo2Error):
    code = "busy"


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 30.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


def test_a1_node_keeps_a_refused_result_and_retries() -> None:
    async def main() -> None:
        seen: list[bytes] = []

        async def hub_result(_peer: str, data: bytes) -> bytes:
            seen.append(data)
            if len(seen) <= 3:
                raise Busy("too many request bytes in flight; retry later")
            if data in seen[:-1]:
                raise MeaningError("duplicate")
            return b"accepted"

        async with (
            ControlHost(Identity.generate(), gossip=False) as hub,
            ControlHost(Identity.generate(), gossip=False) as node,
        ):
            hub.set_handler(RESULT, hub_result, max_request=1024)
            addr = hub.addrs[0]
            attempt = iter(range(100))

            async def send() -> bytes:
                # a fresh envelope per attempt (a resent copy would be a replay)
                return await node.request(addr, RESULT, b"result-%d" % next(attempt), max_response=64)

            reply = await deliver_until(send, deadline=time.time() + 20, backoff=Backoff(base_s=0.05, cap_s=0.2))
            assert reply == b"accepted" and len(seen) == 4

            # a verdict is final: no retry
            seen.clear()

            async def dup() -> bytes:
                seen.append(b"x")
                raise RemoteError("duplicate", "already accepted")

            with pytest.raises(RemoteError):
                await deliver_until(dup, deadline=time.time() + 20, backoff=Backoff(base_s=0.05, cap_s=0.2))
            assert len(seen) == 1

            # a hub that stays busy: given up at the deadline, with the last refusal
            async def busy() -> bytes:
                raise RemoteError("busy", "retry later")

            t0 = time.time()
            with pytest.raises(RemoteError, match="retry later"):
                await deliver_until(busy, deadline=time.time() + 1.0, backoff=Backoff(base_s=0.05, cap_s=0.2))
            assert time.time() - t0 < 1.5

    run(main)
