"""The intake pool's counters in the hub's status.json and `echo2 hub status` (issue 20): a real
hub with one real intake worker, killed while it checks a result (one ``busy`` answer and a
restart), then the resent result accepted."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio
from test_intake_workers import SLEEP_S, admit, answer, make_hub, take_task

from echo2.cli import main as echo2_main
from echo2.learner_hub.intake_pool import IntakeBusy
from echo2.protocol import envelope
from echo2.protocol.identity import Identity


def test_pool_counters_reach_status_json_and_hub_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["ECHO2_TEST_REWARD_SLEEP_S"] = str(SLEEP_S)
    hub = make_hub(tmp_path, 1, reward_funcs=["test_intake_workers:slow_reward"])
    try:
        node = Identity.generate()
        admit(hub, node)
        task = take_task(hub, node)
        pid = hub.intake_pool.pids()[0]
        during: dict[str, object] = {}

        async def main() -> None:
            async def kill_soon() -> None:
                await trio.sleep(SLEEP_S / 2)  # the worker is inside the reward function now
                during.update(hub.status()["intake_pool"])
                os.kill(pid, signal.SIGKILL)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                with trio.fail_after(60), pytest.raises(IntakeBusy):
                    await hub.on_result(node.peer_id, envelope.seal(node, answer(task, node)))
            with trio.fail_after(60):  # the node resends: the restarted worker takes it
                await hub.on_result(node.peer_id, envelope.seal(node, answer(task, node)))
            await hub.write_status()

        trio.run(main)
        assert during["in_flight"] == 1 and during["workers_alive"] == 1 and during["verdicts"] == {}
        pool = json.loads((hub.dir / "status.json").read_text())["intake_pool"]
        assert pool["workers"] == 1 and pool["workers_alive"] == 1 and pool["restarts"] == 1
        assert pool["in_flight"] == 0 and pool["checked"] == 1  # the killed check found nothing
        assert pool["verdicts"] == {"busy": 1, "ok": 1} and pool["busy_by_reason"] == {"worker_died": 1}
        assert echo2_main(["hub", "status", "--dir", str(hub.dir)]) == 0
        out = capsys.readouterr().out
        assert "1 of 1 alive, 1 restarts, 0 in flight" in out and "busy 1, ok 1" in out and "worker_died 1" in out
    finally:
        hub.intake_pool.close()
        hub.store.close()
        os.environ.pop("ECHO2_TEST_REWARD_SLEEP_S", None)


def test_hub_status_without_a_status_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert echo2_main(["hub", "status", "--dir", str(tmp_path)]) == 1
    assert "no status" in capsys.readouterr().out
