"""Evaluation through the swarm: eval prompts dispatched like rollouts (their own queue, group
size and temperature, measured at one version), scored by the reward functions, never trained;
figures in status, metrics and the store."""

from __future__ import annotations

import time
from pathlib import Path

import trio
from hubkit import small_hub_cfg

from echo2.learner_hub.dispatch import DispatchConfig, Dispatcher, PromptGroup
from echo2.learner_hub.evaluation import Evaluator, parse_eval_prompt_id
from echo2.learner_hub.recipe import PromptItem
from echo2.learner_hub.rewards import Scored


def evaluator(n: int = 3, every: int = 5, steps: int = 20, gs: int = 1) -> Evaluator:
    items = [PromptItem(text=f"{i}=", prompt=f"{i}=", row={"answer": str(i)}) for i in range(n)]
    return Evaluator(items, [[1, i] for i in range(n)], every=every, steps=steps, pass_threshold=1.0,
                     group_size=gs, started=time.time())


def test_due_at_zero_every_k_and_the_last_step_once() -> None:
    ev = evaluator()
    assert ev.due(0) == 0
    groups = ev.start(0)
    assert [parse_eval_prompt_id(g.prompt_id) for g in groups] == [(0, 0), (0, 1), (0, 2)]
    assert ev.due(0) is None and ev.due(4) is None
    assert ev.due(6) == 5  # the learner passed step 5 between two calls: evaluate now
    ev.start(5)
    assert ev.due(7) is None and ev.due(20) == 20
    assert parse_eval_prompt_id("p12") is None


def test_figures_of_an_evaluation() -> None:
    ev = evaluator(n=3, gs=2)
    groups = ev.start(0)
    # two results: prompts 0 and 1 together, then prompt 2 (one completion excluded)
    assert ev.add(groups[:2], Scored([1.0, 0.0, 1.0, 1.0], [None] * 4), version=0) == []
    [rec] = ev.add(groups[2:], Scored([0.5, None], [None, "raised"]), version=0)
    assert rec["step"] == 0 and rec["n"] == 5 and rec["excluded"] == 1 and rec["versions"] == [0, 0]
    assert rec["accuracy"] == 3 / 5 and abs(rec["mean_reward"] - 3.5 / 5) < 1e-12
    rep = ev.report()
    assert rep["latest"] == rec and rep["history"] == [rec] and rep["in_progress"] == []
    assert ev.add(groups[2:], Scored([1.0, 1.0], [None, None]), version=0) == []  # a late duplicate changes nothing


def test_eval_tasks_have_their_own_queue_and_skip_staleness() -> None:
    d = Dispatcher(DispatchConfig(staleness=1, target_task_s=1.0), task_id_prefix="t")
    d.add_node("A", rate=100.0)
    d.submit([PromptGroup("p1", (1, 2), 4)])
    d.eval_queue.extend([PromptGroup("e0.0", (1, 3), 1), PromptGroup("e0.1", (1, 4), 1)])
    assert d.next_eval_tasks(0.0, 0, ["B"]) == []  # not a holder of the version
    [et] = d.next_eval_tasks(0.0, 0, ["A"])
    assert {g.prompt_id for g in et.groups} == {"e0.0", "e0.1"} and not d.eval_queue and len(d.queue) == 1
    [tt] = d.next_tasks(0.0, 0)
    assert [g.prompt_id for g in tt.groups] == ["p1"]  # never mixed with training groups
    # the learner moved 5 steps on: a training result is stale, an eval result is not
    assert d.on_result(1.0, tt.task_id, "A", 0, 5, 4).code.value == "stale"
    assert d.on_result(1.0, et.task_id, "A", 0, 5, 2).accepted
    assert d.eval_handled(et.task_id) and not d.eval_handled(et.task_id)
    # a lost eval task goes back to the eval queue
    d.eval_queue.append(PromptGroup("e5.0", (1, 5), 1))
    [et2] = d.next_eval_tasks(2.0, 5, ["A"])
    d.on_node_left("A")
    assert [g.prompt_id for g in d.eval_queue] == ["e5.0"] and et2.task_id not in d.eval_tasks


def test_evaluation_through_a_real_hub(tmp_path: Path) -> None:
    """Step 0 evaluation: greedy eval tasks go out before training tasks, their results are
    scored by the task's reward function, credited, stored, reported, and never trained."""
    from test_hub_results import admit, run_task

    from echo2.learner_hub.hub import Hub
    from echo2.learner_hub.status_http import hub_metrics, render_metrics
    from echo2.learner_hub.store import HubStore
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity

    cfg = small_hub_cfg(tmp_path, eval_every=5, eval_max_prompts=6, eval_temperature=0.0)
    hub = Hub(cfg)
    node = Identity.generate()
    assert admit(hub, node).admitted
    hub.nodes[node.peer_id].held_version = 0
    hub._refill()
    hub._pump()
    mailbox = hub.nodes[node.peer_id].mailbox
    tasks = list(mailbox)
    mailbox.clear()
    evals = [t for t in tasks if t.task_id in hub.dispatcher.eval_tasks]
    assert evals and all(t.group_size == 1 and t.temperature == 0.0 and t.min_version == 0 for t in evals)
    assert sum(len(t.prompts) for t in evals) <= 6
    buffered = len(hub.buffer)
    for _ in range(10):  # until the evaluation has all its prompts back
        for t in evals:
            trio.run(hub.on_result, node.peer_id, envelope.seal(node, run_task(hub, node, t)))
        if hub.evaluator.history:
            break
        hub._pump()
        evals = list(mailbox)
        evals = [t for t in evals if t.task_id in hub.dispatcher.eval_tasks]
        mailbox.clear()
    st = hub.status()
    [rec] = st["eval"]["history"]
    assert rec["step"] == 0 and rec["n"] == 6 and 0.0 <= rec["accuracy"] <= 1.0 and st["eval"]["latest"] == rec
    assert len(hub.buffer) == buffered  # never trained
    assert hub.ledger.totals(time.time()).as_dict()["accepted_rollouts"] >= 6  # paid work
    assert "echo2_eval_accuracy" in render_metrics(hub_metrics(st))
    hub.store.flush()
    assert [e["step"] for e in hub.store.call_sync(HubStore.evaluations)] == [0]
    assert hub.evaluator.due(0) is None
    hub.store.close()
