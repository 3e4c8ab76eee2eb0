"""Experiment tracking (issue 21): report_to writes every step's figures under TRL's names, read
back with TensorBoard's own reader; a tracker that fails is dropped, logged once, and the hub
trains on."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from hubkit import small_hub_cfg

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.store import HubStore
from echo2.learner_hub.trainmetrics import TRL_STEP_NAMES

pytest.importorskip("tensorboard")


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # ~100 s here, nearly all of it three processes starting on 2 shared cores
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_swarm_writes_trl_metrics_to_tensorboard_at_every_step(tmp_path: Path) -> None:
    """A hub and two nodes (real processes): every TRL-named figure that applies (kl with a KL
    penalty, low/high clip ratios with asymmetric clipping, one reward function, evaluations)
    is in the event files at every step, as transformers' callbacks name them."""
    from echo2.bench.swarm import LocalSwarm

    steps = 5
    cfg = HubConfig(task="copy", steps=steps, staleness=1, seed=0, exit_when_done=True, prompts_per_step=4,
                    group_size=4, kl_coef=0.01, epsilon_high=0.28, eval_every=steps, eval_max_prompts=4,
                    report_to=["tensorboard"], run_name="trl-names")
    t0 = time.monotonic()
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start()
        st = swarm.wait(240)
        assert swarm.hub is not None
        swarm.hub.wait(timeout=60)  # run_hub closes the trackers on its way out
    wall = time.monotonic() - t0
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*/*.log"))
    assert st is not None and st.get("final"), f"swarm did not finish:\n{logs}"
    assert st["tracking"]["disabled"] == {} and st["tracking"]["report_to"] == ["tensorboard"], st["tracking"]

    logdir = tmp_path / "hub" / "tensorboard" / "trl-names"
    scalars = _scalars(logdir)
    [func] = st["rewards"]["functions"]
    names = [*TRL_STEP_NAMES, "kl", f"rewards/{func}/mean", f"rewards/{func}/std"]
    every = list(range(1, steps + 1))
    missing = [n for n in names if [s for s, _ in scalars.get(f"train/{n}", [])] != every]
    assert not missing, (missing, sorted(scalars))
    for n in ("echo2/staleness_mean", "echo2/staleness_max", "echo2/learner_busy_fraction", "echo2/predicted_busy_fraction",
              "echo2/active_nodes", "echo2/accepted_tokens_per_s", "echo2/stale_dropped", "echo2/loop_lag_p99_ms"):
        assert [s for s, _ in scalars[n]] == every, n
    # each version's broadcast (its time to the last node that holds it), logged at its own step
    assert {s for s, _ in scalars["echo2/broadcast_last_node_s"]} <= set(range(steps + 1)) and all(
        v >= 0 for _, v in scalars["echo2/broadcast_last_node_s"])
    # the evaluations (step 0 and the last) under TRL's eval_* names
    assert [s for s, _ in scalars["eval/reward"]] == [0, steps] and "eval/accuracy" in scalars
    # the values are the training room's: the event file and status.json say the same
    last = st["train_metrics"][-1]
    assert last["step"] == steps
    for n in ("reward", "loss", "entropy", "kl", "num_tokens", "sampling/importance_sampling_ratio/mean"):
        assert math.isclose(scalars[f"train/{n}"][-1][1], last[n], rel_tol=1e-5, abs_tol=1e-6), n
    assert last["entropy"] > 0 and last["completions/max_length"] <= cfg.max_new_tokens
    # TRL's num_tokens is a running total of prompt + completion tokens
    toks = [v for _, v in scalars["train/num_tokens"]]
    assert all(b > a for a, b in zip(toks, toks[1:], strict=False))
    # the whole run's figures are in the store too (echo2 hub report reads them)
    with HubStore.in_dir(tmp_path / "hub") as store:
        rows = store.train_metrics()
    assert [r["step"] for r in rows] == every and rows[-1]["reward"] == last["reward"]
    print(f"swarm of {steps} steps with report_to=tensorboard: {wall:.1f} s, {len(scalars)} scalar tags")


def test_a_tracker_whose_writer_raises_is_dropped_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real hub trains its steps in-process (its node's results made by the real engine) while
    TensorBoard's writer raises from the second step on: one warning names the tracker and the
    reason, the status says so, the steps before it are on disk, and every step is trained."""
    from test_hub_results import admit
    from torch.utils.tensorboard import SummaryWriter

    from echo2.learner_hub.hub import Hub
    from echo2.models.engine import TransformersEngine
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import Result, Task, task_hash

    steps = 4
    hub = Hub(small_hub_cfg(tmp_path, steps=steps, report_to=["tensorboard"], run_name="failing"))
    node = Identity.generate()
    assert admit(hub, node).admitted
    real_add = SummaryWriter.add_scalar

    def add_scalar(self: SummaryWriter, tag: str, value: float, step: int | None = None, *a: object, **kw: object) -> None:
        if step is not None and step >= 2:
            raise OSError("No space left on device")
        real_add(self, tag, value, step, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)

    engines: dict[int, TransformersEngine] = {}

    def answer(task: Task, version: int) -> Result:
        if version not in engines:  # the node loads each version once
            engines[version] = eng = TransformersEngine(device="cpu")
            eng.load_version(version, hub.model_config, hub.artifacts, hub.learner.state_dict_for_publish())
        comps = engines[version].generate(task.prompts, task.group_size, task.max_new_tokens, task.temperature,
                                          task.top_p, task.seed)
        return Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=version,
                      completions=comps, started_at=time.time(), gen_seconds=0.1,
                      tokens=sum(len(c.token_ids) for c in comps))

    async def node_loop() -> None:
        """The node: takes the hub's tasks one at a time and answers them with the version the
        learner is at (read between steps only, as a node holds a published version)."""
        info = hub.nodes[node.peer_id]
        while not hub.done.is_set():
            await trio.sleep(0.01)
            if hub.trainer.training:
                continue
            info.held_version = hub.learner.version
            hub._pump()
            if info.mailbox:
                task = envelope.open_envelope(hub.outbox.seal(info.mailbox.popleft()), Task, replay=None).message
                result = answer(task, hub.learner.version)
                await hub.on_result(node.peer_id, envelope.seal(node, result))

    async def run() -> None:
        with trio.fail_after(120):
            await hub.publish()  # version 0, as serve() does before the learner starts
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hub.learner_loop)
                nursery.start_soon(node_loop)

    with caplog.at_level(logging.WARNING, logger="echo2.learner_hub.tracking"):
        trio.run(run)
        hub.trainer.tracker.close()
    hub.store.close()
    assert hub.learner.version == steps  # every step trained
    warnings = [r.getMessage() for r in caplog.records if "tracking" in r.name and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "tensorboard disabled" in warnings[0] and "No space left on device" in warnings[0], warnings
    rep = hub.status()["tracking"]
    assert "No space left on device" in rep["disabled"]["tensorboard"] and rep["active"] == []
    assert [m["step"] for m in hub.status()["train_metrics"]] == list(range(1, steps + 1))
    scalars = _scalars(tmp_path / "tensorboard" / "failing")
    assert [s for s, _ in scalars["train/reward"]] == [1]  # written before the writer failed
    # that step has every TRL name that applies (no KL penalty here), read back by TensorBoard
    [func] = hub.rewards.names
    names = [*TRL_STEP_NAMES, f"rewards/{func}/mean", f"rewards/{func}/std"]
    assert [n for n in names if [s for s, _ in scalars.get(f"train/{n}", [])] != [1]] == []
    assert "train/kl" not in scalars


def test_learner_figures_follow_their_definitions() -> None:
    """Entropy, the sampling ratio and the clip split, against direct computations from the
    model's full distribution before the step; the entropy pass leaves the log-probs unchanged."""
    import random

    import torch
    from test_learner import _rollout, _setup

    from echo2.learner_hub.envs import make_env
    from echo2.learner_hub.learner import Learner
    from echo2.models import spec as modelspec
    from echo2.models.engine import TransformersEngine

    model, mc, arts, tok = _setup()
    learner = Learner(model, tok, lr=3e-3, epsilon_high=0.28, temperature=0.9)
    eng, env, rng = TransformersEngine(device="cpu"), make_env("copy"), random.Random(0)
    fresh = _rollout(learner, eng, env, tok, mc, arts, 4, 4, rng, seed=1)
    stale = _rollout(learner, eng, env, tok, mc, arts, 4, 4, rng, seed=2)  # made with version 0 too
    s1 = learner.step(fresh)
    # rows sampled with the learner's own version: the ratio is the sampler's numerical noise
    assert abs(s1.is_ratio_min - 1) < 1e-3 and abs(s1.is_ratio_max - 1) < 1e-3 and s1.staleness_max == 0

    rows = [(g.prompt_ids, s.token_ids) for g in stale for s in g.samples]
    behav = [s.logprobs for g in stale for s in g.samples]
    before = learner.recompute_logprobs_batch(rows)  # the learner's log-probs at version 1, before step 2
    d = torch.tensor([a - b for r, q in zip(before, behav, strict=True) for a, b in zip(r, q, strict=True)])
    ents = []
    with torch.no_grad():
        for p, c in rows:  # the full distribution at each completion position, one row at a time
            logits = learner.model(input_ids=torch.tensor([list(p) + list(c)])).logits[0].float() / learner.temperature
            logp = torch.log_softmax(logits[len(p) - 1 : len(p) - 1 + len(c)], dim=-1)
            ents += (-(logp.exp() * logp).sum(-1)).tolist()
    s2 = learner.step(stale)
    assert s2.staleness_max == 1 and s2.staleness_mean == 1.0
    ratio = d.exp()
    assert math.isclose(s2.is_ratio_min, float(ratio.min()), rel_tol=1e-4)
    assert math.isclose(s2.is_ratio_mean, float(ratio.mean()), rel_tol=1e-4)
    assert math.isclose(s2.is_ratio_max, float(ratio.max()), rel_tol=1e-4)
    assert math.isclose(s2.logp_diff_mean, float(d.abs().mean()), rel_tol=1e-4)
    assert math.isclose(s2.logp_diff_max, float(d.abs().max()), rel_tol=1e-4)
    assert s2.is_ratio_max > 1.01 or s2.is_ratio_min < 0.99  # the step moved the policy: a stale row shows it
    assert math.isclose(s2.entropy, sum(ents) / len(ents), rel_tol=1e-4)
    assert math.isclose(s2.clip_low + s2.clip_high, s2.clip_frac, abs_tol=1e-6)
    # the entropy rides along: the log-probs are bit for bit those of the plain call
    kw: dict[str, Any] = dict(pad_id=learner.pad_id, temperature=learner.temperature)
    plain, _ = modelspec.teacher_forced_batch(learner.model, rows[:5], **kw)
    out: list[torch.Tensor] = []
    with_ent, _ = modelspec.teacher_forced_batch(learner.model, rows[:5], entropy_out=out, **kw)
    assert torch.equal(plain, with_ent) and out[0].shape == plain.shape


def test_step_metrics_by_trl_definitions_and_reward_parts_survive_storage() -> None:
    from echo2.learner_hub.learner import StepStats
    from echo2.learner_hub.rewards import apply_scores, combine
    from echo2.learner_hub.rows import Group, Sample, decode_groups, encode_groups
    from echo2.learner_hub.trainmetrics import eval_metrics, step_metrics

    def smp(n: int, finish: str = "stop") -> Sample:
        return Sample(token_ids=list(range(n)), logprobs=[-1.0] * n, reward=0.0, version=0, finish_reason=finish)

    groups = [Group([1], [smp(2), smp(4, "length"), smp(3)]), Group([1, 2], [smp(5), smp(1)])]
    # two functions: "fmt" applies to every completion, "acc" only to the first group's
    outs = [[1.0, 0.0, 1.0, 0.5, 0.5], [1.0, 1.0, 0.0, None, None]]
    scored = combine(outs, [1.0, 2.0], 5, ["fmt", "acc"])
    kept, dropped = apply_scores(groups, scored)
    assert dropped == 0 and [s.reward for g in kept for s in g.samples] == [3.0, 2.0, 1.0, 0.5, 0.5]
    kept = decode_groups(encode_groups(kept))  # as a restart restores them
    assert kept[0].samples[0].reward_parts == {"fmt": 1.0, "acc": 1.0} and kept[1].samples[0].reward_parts == {"fmt": 0.5}
    stats = StepStats(version=1, loss=0.5, pg_loss=0.5, reward_mean=0.0, reward_std=0.0, ratio_mean=1.0, ratio_max=1.0,
                      clip_frac=0.1, kl_ref=0.02, kl_behaviour=0.0, grad_norm=2.0, tokens=15, sequences=5, groups=2,
                      zero_adv_groups=1, staleness_mean=0.0, mismatch_rows=0, mismatch_mean=0.0, mismatch_max=0.0)
    m = step_metrics(kept, stats, learning_rate=1e-3, num_tokens=123, kl=True)
    assert m["reward"] == 7.0 / 5 and math.isclose(m["reward_std"], float(np.std([3, 2, 1, 0.5, 0.5], ddof=1)))
    assert m["rewards/acc/mean"] == 2.0 / 3 and m["rewards/fmt/mean"] == 0.6
    assert math.isclose(m["rewards/acc/std"], float(np.std([1, 1, 0], ddof=1)))
    assert m["frac_reward_zero_std"] == 2 / 5  # the second group's rewards are equal: its 2 rows of 5
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (3.0, 1.0, 5.0)
    assert m["completions/clipped_ratio"] == 1 / 5 and m["completions/max_terminated_length"] == 5.0
    assert m["kl"] == 0.02 and m["num_tokens"] == 123 and m["learning_rate"] == 1e-3 and m["loss"] == 0.5
    assert "kl" not in step_metrics(kept, stats, learning_rate=1e-3, num_tokens=0, kl=False)
    ev = eval_metrics({"step": 5, "mean_reward": 0.5, "accuracy": 0.25, "n": 8, "reward_std": 0.1,
                       "rewards_by_func": {"acc": {"mean": 0.25, "std": None}}})
    assert ev == {"eval_reward": 0.5, "eval_reward_std": 0.1, "eval_accuracy": 0.25, "eval_rewards/acc/mean": 0.25,
                  "eval_num_completions": 8.0}


def test_a_tracker_that_cannot_import_is_dropped_and_the_others_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    from echo2.learner_hub.tracking import Tracker

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    with caplog.at_level(logging.WARNING, logger="echo2.learner_hub.tracking"):
        tr = Tracker.for_hub(["wandb", "tensorboard"], tmp_path, "run", {"lr": 0.1}, "[hub]\nlr = 0.1\n")
        for step in (1, 2, 3):
            tr.log(step, {"reward": step / 10, "echo2/active_nodes": 2.0})
        tr.log(0, {"eval_reward": 0.5})
        assert tr.flush(60)
        tr.close()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "wandb disabled" in warning and "pip install 'echo2[wandb]'" in warning
    assert tr.report()["active"] == ["tensorboard"] and tr.report()["written"] == 4
    scalars = _scalars(tmp_path / "tensorboard" / "run")
    assert [s for s, _ in scalars["train/reward"]] == [1, 2, 3] and scalars["eval/reward"] == [(0, 0.5)]
    assert [s for s, _ in scalars["echo2/active_nodes"]] == [1, 2, 3]


def test_wandb_and_trackio_write_offline_under_the_hub_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in the test extra (large installs): skipped unless both are installed."""
    import importlib.util
    import sqlite3
    import sys

    pytest.importorskip("wandb")
    if importlib.util.find_spec("trackio") is None:  # not imported here: it reads TRACKIO_DIR on import
        pytest.skip("trackio is not installed")
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported already: its TRACKIO_DIR is fixed for this process")
    from echo2.learner_hub.tracking import Tracker

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    tr = Tracker.for_hub(["wandb", "trackio"], tmp_path, "run", {"lr": 0.1}, "[hub]\nlr = 0.1\n")
    for step in (1, 2):
        tr.log(step, {"reward": step / 10})
    tr.log(0, {"eval_reward": 0.5})
    assert tr.flush(120)
    tr.close(120)
    assert tr.report()["disabled"] == {} and tr.report()["written"] == 3
    [run] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # offline: nothing left the machine
    assert run.stat().st_size > 0
    db = sqlite3.connect(tmp_path / "trackio" / "echo2.db")
    rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    assert [s for s, _ in rows] == [1, 2, 0] and b'"train/reward":0.2' in rows[1][1] and b'"eval/reward":0.5' in rows[2][1]


def test_report_to_in_hub_toml(tmp_path: Path) -> None:
    from echo2.learner_hub.config import ConfigError, load_config, render_config
    from echo2.learner_hub.tracking import report_targets

    assert report_targets(HubConfig().report_to) == []  # "none" by default
    p = tmp_path / "hub.toml"
    p.write_text(render_config(HubConfig(report_to=["tensorboard", "wandb"], run_name="r1")))
    cfg = load_config(p)
    assert report_targets(cfg.report_to) == ["tensorboard", "wandb"] and cfg.run_name == "r1"
    p.write_text('[hub]\nreport_to = "trackio"\n')
    assert report_targets(load_config(p).report_to) == ["trackio"]
    p.write_text('[hub]\nreport_to = ["tensorbord"]\n')
    with pytest.raises(ConfigError, match='report_to = \\["tensorbord"\\]: must be one of "none", "tensorboard"'):
        load_config(p)
