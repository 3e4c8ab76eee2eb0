"""The hub's garbage collector at scale (issue 20).

CPython's automatic full collection walks every container object that has survived two younger
collections, and it runs whenever those grew by a quarter since the last one. A hub serving 10,000
nodes holds ~1.2 M such objects (nodes, 80,000 tasks in flight, their payloads' bookkeeping), and
the results it takes in keep promoting new ones: measured with a trio instrument and gc callbacks on
`echo2 bench intake --nodes 10000`, full collections of 217-281 ms, 4 in 15 s of results, each
finding nothing to free, were the loop's lag p99 in every phase (230-250 ms; the loop's own work
peaked at ~30 ms a pass).

So the hub moves what has survived to the permanent generation once a second (``gc.freeze``): an
automatic full collection then walks only what became long-lived since the last second (measured:
none over 4 ms in the same run; loop lag p99 231 -> 37 ms in the heartbeat phase). What dies in a
reference cycle after being frozen is not freed until a full collection over everything: 3,001
such objects in a 3-minute run at 10,000 nodes (of 1.24 M frozen), so every RECLAIM_EVERY_S the
hub unfreezes and collects everything once (~0.5 s at that size: one lag sample of 6,000 in the
10-minute window of the p99).
"""

from __future__ import annotations

import gc
import logging
import time

import trio

log = logging.getLogger(__name__)

FREEZE_EVERY_S = 1.0
RECLAIM_EVERY_S = 900.0


async def freeze_survivors(every_s: float = FREEZE_EVERY_S, reclaim_every_s: float = RECLAIM_EVERY_S) -> None:
    """Run in the hub's process for as long as it serves (never in a process that must free its
    cyclic garbage between short-lived hubs, such as a test run: see Hub.freeze_gc)."""
    last_reclaim = trio.current_time()
    gc.freeze()  # what the hub built before it served (a bench's 10,000 admissions)
    try:
        while True:
            await trio.sleep(every_s)
            if trio.current_time() - last_reclaim >= reclaim_every_s:
                last_reclaim = trio.current_time()
                t0 = time.perf_counter()
                gc.unfreeze()
                freed = gc.collect()
                log.info("full collection over every object: %d freed in %.0f ms", freed,
                         (time.perf_counter() - t0) * 1e3)
            gc.freeze()
    finally:
        gc.unfreeze()  # what is left is collected as usual again
