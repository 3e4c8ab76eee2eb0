"""Delivering a finished result to the hub: keep it through transient refusals, until its deadline.

A hub that answers ``busy`` (or rate-limits, or times out) has not judged the result; dropping it
then throws away the rollouts a node spent minutes on, and a hostile peer that keeps the hub
busy for a moment would turn that into lost work for everyone. So the node keeps the result and
retries with capped, jittered backoff (:class:`~echo2.protocol.backoff.Backoff`) until the task's
deadline; a refusal that is a verdict (stale, duplicate, forged, not admitted) ends it at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from echo2.protocol.backoff import Backoff
from echo2.protocol.errors import TransportError
from echo2.protocol.framing import RemoteError

log = logging.getLogger(__name__)

#: Codes that say "not now", not "no": the same result may be accepted later.
RETRY_CODES = frozenset({"busy", "rate_limited", "timeout", "too_many_streams", "too_slow", "internal"})


async def deliver_until(
    send: Callable[[], Awaitable[bytes]],
    *,
    deadline: float,
    backoff: Backoff,
    what: str = "result",
    clock: Callable[[], float] = time.time,
) -> bytes:
    """``await send()`` until it succeeds; retry transient failures while ``deadline`` allows.

    ``send`` is called afresh for each attempt (so it can seal a fresh envelope: a retried copy
    of the same one would be refused as a replay). ``deadline`` is on ``clock`` (wall time, like
    a task's deadline). Always tries once; raises the last error when it gives up.
    """
    while True:
        try:
            return await send()
        except RemoteError as exc:
            if exc.code not in RETRY_CODES:
                raise
            err: Exception = exc
        except (TransportError, OSError) as exc:
            err = exc
        delay = backoff.failed()
        if clock() + delay >= deadline:
            raise err
        log.info("%s not delivered (%s); retry %d in %.1f s", what, err, backoff.failures, delay)
        await trio.sleep(delay)
