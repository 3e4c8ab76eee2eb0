"""Issue 15, A5: rows are verified before they enter a GRPO step, with the hub's secret RNG, also
under bf16 publication; finish reasons and token counts are the hub's; a HoldsVersion lie costs no
training row. Real tiny model, real engine, real publisher and store; the training room's own loop."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import small_hub_cfg

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.intake import TaskBook
from echo2.learner_hub.learner import Learner, StepStats
from echo2.learner_hub.publisher import PolicyPublisher, StarSender
from echo2.learner_hub.rows import Group, Sample
from echo2.learner_hub.storeworker import StoreWorker
from echo2.learner_hub.training import Trainer, build_learner
from echo2.models import spec as modelspec
from echo2.models.engine import TransformersEngine
from echo2.protocol.identity import Identity

HONEST, LIAR = "honest-node", "lying-node"
SHIFT = -0.5  # what tests/hostile_node.py's "logprobs" mode does to every log-prob


class CountingLearner(Learner):
    """The real learner; records the node of every row its loss is computed over."""

    seen: list[str]

    def step(self, groups: Sequence[Group]) -> StepStats:
        self.seen.extend(s.node_id for g in groups for s in g.samples)
        return super().step(groups)


def make_trainer(tmp_path: Path, publish_dtype: str) -> tuple[Trainer, CountingLearner, HubConfig]:
    cfg = HubConfig(dir=str(tmp_path), steps=1, prompts_per_step=2, group_size=4, max_new_tokens=6,
                    tiny_hidden=64, publish_dtype=publish_dtype)  # type: ignore[arg-type]
    base, _tok, mc, arts = build_learner(cfg)
    learner = CountingLearner(base.model, base.tok, publish_dtype=base.publish_dtype, temperature=cfg.temperature)
    learner.seen = []
    publisher = PolicyPublisher(Identity.generate(), mc, arts, cfg)
    trainer = Trainer(cfg, learner, publisher, StarSender(publisher), StoreWorker(tmp_path), TaskBook())
    trio.run(trainer.publish)  # version 0, as the hub publishes it before any task
    return trainer, learner, cfg


def rollouts(trainer: Trainer, node: str, n_prompts: int, seed: int, *, weights: dict[str, Any] | None = None,
             forge: Any = None) -> list[Group]:
    """Groups made by a node running the published version 0 (or ``weights``), as intake builds
    them; ``forge(i, logprobs)`` alters the reported log-probs of sample ``i`` of each group."""
    pub = trainer.publisher.recent[0]
    from echo2.models import statedict

    sd = weights if weights is not None else statedict.assemble(pub.packed.manifest, pub.packed.raw_chunks)
    eng = TransformersEngine(device="cpu")
    eng.load_version(0, trainer.publisher.model_config, trainer.publisher.artifacts, sd)
    tok = eng.tokenizer
    assert tok is not None
    prompts = [tok.encode(f"{seed}{i}=", add_bos=True) for i in range(n_prompts)]
    comps = eng.generate(prompts, trainer.cfg.group_size, trainer.cfg.max_new_tokens, trainer.cfg.temperature, 1.0, seed)
    groups = [Group(prompt_ids=p, samples=[]) for p in prompts]
    for c in comps:
        g = groups[c.prompt_index]
        lps = list(c.logprobs)
        if forge is not None:
            lps = forge(len(g.samples), lps)
        g.samples.append(Sample(list(c.token_ids), lps, float(len(g.samples) % 2), 0, node_id=node))
    return groups


def train_one_step(trainer: Trainer, batches: list[tuple[str, list[Group]]]) -> dict[str, float]:
    """Buffer the results (in this order) and run the training room until its one step is done."""
    for tid, groups in batches:
        trainer.add(tid, groups, 0)
    checked: dict[str, float] = {}

    async def main() -> None:
        with trio.fail_after(120):
            await trainer.run(lambda: None, checked.update, lambda: 0.0, lambda _s: (lambda _st: None), lambda: None)

    try:
        trio.run(main)
    finally:
        trainer.store.close()
    return checked


def shifted(_i: int, lps: list[float]) -> list[float]:
    return [x + SHIFT for x in lps]


def test_a5_forged_row_never_reaches_the_grpo_loss(tmp_path: Path) -> None:
    # fp32 publication: the old in-step check saw the forgery, but only while training on it
    trainer, learner, cfg = make_trainer(tmp_path, "float32")
    forged = rollouts(trainer, LIAR, 2, seed=1, forge=shifted)
    honest = rollouts(trainer, HONEST, 2, seed=2)
    checked = train_one_step(trainer, [("t-liar", forged), ("t-honest", honest)])  # the liar's rows are taken first
    assert learner.version == 1
    assert LIAR not in learner.seen and learner.seen.count(HONEST) == 2 * cfg.group_size
    assert checked[LIAR] > cfg.logprob_tolerance and checked[HONEST] <= cfg.logprob_tolerance
    assert trainer.trained_rows == {HONEST: 2 * cfg.group_size}
    assert trainer.history[-1]["rows"] == 2 * cfg.group_size


def test_a5_honest_first_sample_does_not_hide_forged_rows(tmp_path: Path) -> None:
    # the old spot check took the first sample per (node, version): an honest one put first
    trainer, learner, cfg = make_trainer(tmp_path, "bfloat16")
    forged = rollouts(trainer, LIAR, 2, seed=3, forge=lambda i, lps: lps if i == 0 else shifted(i, lps))
    honest = rollouts(trainer, HONEST, 2, seed=4)
    checked = train_one_step(trainer, [("t-liar", forged), ("t-honest", honest)])
    assert checked[LIAR] >= abs(SHIFT) - 1e-3
    assert LIAR not in learner.seen and learner.seen.count(HONEST) == 2 * cfg.group_size


def test_a5_sampled_checks_use_the_hubs_secret_rng_over_all_rows() -> None:
    from echo2.learner_hub.verify import Verifier, pick_rows

    rows = [Group([1, 2], [Sample([5, 6], [-1.0, -1.0], 0.0, 0, node_id=n) for _ in range(8)]) for n in ("a", "b")]
    v = Verifier(None, lambda _v: None, 1e-3, fraction=0.25)  # type: ignore[arg-type]
    assert isinstance(v.rng, random.SystemRandom)
    seen: set[tuple[int, int]] = set()
    for _ in range(200):
        picked = pick_rows(rows, 0.25, v.rng)
        assert sorted({g for g, _ in picked}) == [0, 1] and len(picked) == 4  # ceil(0.25 * 8) per node
        seen.update(picked)
    assert len(seen) == 16  # every row of every node gets drawn, not the first one listed
    assert len(pick_rows(rows, 1.0, v.rng)) == 16  # the default checks all


def test_a5_bf16_publication_catches_forged_row_and_passes_honest_ones(tmp_path: Path) -> None:
    # bf16 publication switched the per-row check off; honest bf16 rows must still pass the default tolerance
    trainer, learner, cfg = make_trainer(tmp_path, "bfloat16")
    assert cfg.publish_dtype != cfg.dtype
    forged = rollouts(trainer, LIAR, 1, seed=5, forge=lambda i, lps: shifted(i, lps) if i == 2 else lps)
    honest = rollouts(trainer, HONEST, 2, seed=6)
    # the batch takes one honest group and the liar's; the liar's goes and the batch is topped up
    checked = train_one_step(trainer, [("t-honest-a", honest[:1]), ("t-liar", forged), ("t-honest-b", honest[1:])])
    # measured: an fp32 engine on the bf16-published weights matches the float32 shadow to ~1e-6
    assert checked[HONEST] < 1e-5, checked
    assert checked[LIAR] > cfg.logprob_tolerance
    assert LIAR not in learner.seen and learner.seen.count(HONEST) == 2 * cfg.group_size


def test_a5_holds_version_lie_costs_no_training_row(tmp_path: Path) -> None:
    # a node that said it holds version 0 but samples with other weights: its rows, labelled v0, are
    # honest about those weights and still never trained
    trainer, learner, cfg = make_trainer(tmp_path, "bfloat16")
    other = modelspec.model_from_config(trainer.publisher.model_config)
    liar = rollouts(trainer, LIAR, 2, seed=7, weights={k: v.detach().clone() for k, v in other.state_dict().items()})
    honest = rollouts(trainer, HONEST, 2, seed=8)
    checked = train_one_step(trainer, [("t-liar", liar), ("t-honest", honest)])
    assert checked[LIAR] > cfg.logprob_tolerance
    assert LIAR not in learner.seen and learner.seen.count(HONEST) == 2 * cfg.group_size


def test_a5_finish_reason_is_derived_from_the_tokens() -> None:
    from test_intake import STOP, issue, make_intake, submit

    from echo2.learner_hub.intake import Accept, Punish
    from echo2.learner_hub.recipe import PromptItem
    from echo2.learner_hub.rewards import RewardRunner, TrainerState, apply_scores, batch_of
    from echo2.protocol.messages import Completion, Result, task_hash

    finishes: list[str] = []

    def reward(completions: list[str], finish_reason: list[str], **_kw: Any) -> list[float]:
        finishes.extend(finish_reason)  # what the reward functions are told
        return [1.0 if f == "stop" else 0.0 for f in finish_reason]

    def judge(ids: list[int], claim: str) -> object:
        intake = make_intake()
        submit(intake, 2)
        t = issue(intake)[0]
        comps = [Completion(prompt_index=i, token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=claim)
                 for i in range(len(t.prompts)) for _ in range(t.group_size)]
        r = Result(task_id=t.task_id, task_hash=task_hash(t), node_id=t.node_id, version=0, completions=comps,
                   started_at=0.0, gen_seconds=0.1, tokens=len(ids))
        v = intake.judge(t.node_id, r, 1.0, 0)
        if isinstance(v, Accept):  # scored as the hub scores an accepted result
            items = [PromptItem(text=str(g.item), prompt=str(g.item)) for g in v.task.groups]
            scored = trio.run(RewardRunner([reward], [1.0]).score, batch_of(v.rows, items, v.texts), TrainerState())
            apply_scores(v.rows, scored)
        return v

    # a stop claimed on a completion with no stop token (shorter than max_new_tokens) is a truncation
    v = judge([7], "stop")
    assert isinstance(v, Accept)
    assert {s.finish_reason for g in v.rows for s in g.samples} == {"length"} and set(finishes) == {"length"}
    assert all(s.reward == 0.0 for g in v.rows for s in g.samples)
    # a completion that goes on after a stop token cannot come from an engine
    assert isinstance(judge([STOP, 7], "length"), Punish)
    # the claimed 'length' of a completion that ends with the stop token is a stop
    v = judge([7, STOP], "length")
    assert isinstance(v, Accept) and {s.finish_reason for g in v.rows for s in g.samples} == {"stop"}


def test_a5_token_counts_are_the_hubs_not_the_nodes(tmp_path: Path) -> None:
    from test_hub_results import admit, run_task, take_task

    from echo2.learner_hub.hub import Hub
    from echo2.protocol import envelope
    from echo2.protocol.messages import Result

    hub = Hub(small_hub_cfg(tmp_path))
    try:
        node = Identity.generate()
        assert admit(hub, node).admitted
        honest = run_task(hub, node, take_task(hub, node))
        real = sum(len(c.token_ids) for c in honest.completions)
        inflated = Result(**{**honest.__dict__, "tokens": 10**12})
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, inflated))
        row = hub.ledger.row(node.peer_id, 0.0)
        assert row is not None and row.accepted_tokens == real
        assert hub.nodes[node.peer_id].tokens == real
        got = hub.store.call_sync(lambda st: st._db.execute("SELECT tokens FROM results").fetchall())
        assert got == [(real,)]
    finally:
        hub.store.close()


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a5_non_finite_logprobs_fail_the_check(tmp_path: Path, bad: float) -> None:
    trainer, learner, cfg = make_trainer(tmp_path, "bfloat16")
    forged = rollouts(trainer, LIAR, 1, seed=9, forge=lambda i, lps: [bad] + lps[1:])
    out = trainer.verifier.check(forged)
    trainer.store.close()
    assert out.failed == {LIAR} and out.kept == [] and out.rejected == [0]


def test_a5_rows_of_a_version_no_longer_kept_are_dropped_unblamed(tmp_path: Path) -> None:
    trainer, _learner, _cfg = make_trainer(tmp_path, "bfloat16")
    groups = rollouts(trainer, HONEST, 2, seed=10)
    for g in groups[1:]:
        for s in g.samples:
            s.version = 7  # never published: nothing to check it against
    out = trainer.verifier.check(groups)
    trainer.store.close()
    assert out.kept == [0] and out.unverifiable == [1] and out.failed == set() and out.rejected == []
