"""The hub's collector policy (learner_hub/gcpolicy.py, issue 20): survivors frozen each tick, so
an automatic full collection walks only the recent ones; a cycle that dies frozen is reclaimed by
the periodic full collection; everything unfrozen when the hub stops serving."""

from __future__ import annotations

import gc
import weakref

import trio

from echo2.learner_hub.gcpolicy import freeze_survivors


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_survivors_are_frozen_and_dead_cycles_reclaimed() -> None:
    seen: dict[str, object] = {}

    async def main() -> None:
        obj = _Node()
        alive = weakref.ref(obj)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(freeze_survivors, 0.01, 0.3)
            await trio.sleep(0.05)
            seen["frozen"] = gc.get_freeze_count()
            del obj
            gc.collect()
            seen["after_collect"] = alive() is not None  # frozen: a collection does not walk it
            with trio.fail_after(5):
                while alive() is not None:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()

    gc.collect()
    try:
        trio.run(main)
    finally:
        frozen_after = gc.get_freeze_count()
        gc.unfreeze()
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 0
    assert seen["after_collect"] is True
    assert frozen_after == 0  # unfrozen once the hub stops serving
