"""A hub restarted on the same directory puts the accepted results its last checkpoint does not
cover back into the buffer (real hub, real store, real model; handlers called directly)."""

from __future__ import annotations

from pathlib import Path

import trio
from hubkit import small_hub_cfg
from test_hub_results import admit, run_task, take_task

from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.identity import Identity


def test_restart_restores_untrained_results(tmp_path: Path) -> None:
    cfg = small_hub_cfg(tmp_path)
    hub = Hub(cfg)
    trio.run(hub.trainer.checkpoint)  # step 0
    node = Identity.generate()
    assert admit(hub, node).admitted
    task = take_task(hub, node)
    trio.run(hub.on_result, node.peer_id, envelope.seal(node, run_task(hub, node, task)))
    assert len(hub.buffer) == len(task.prompts) and task.task_id in hub.intake.book
    hub.store.close()  # what was queued is written
    again = Hub(cfg)
    assert again.resumed_from == 0 and again.restored_results == 1
    assert len(again.buffer) == len(task.prompts)
    # the restored task's entry waits for its groups, and goes with the last one
    book = again.intake.book
    assert task.task_id in book
    assert [book.group_gone(task.task_id) for _ in task.prompts][-1] and task.task_id not in book
    again.store.close()
