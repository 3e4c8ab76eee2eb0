"""A hub (or whoever forges one) chooses the model and every task's size: the node sizes them
against its memory budget before allocating, declines what does not fit with a reason, survives
running out of memory (A7), and accepts only allow-listed model config keys with built-in
attention and the model hub offline (A8)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from echo2.models import spec as ms
from echo2.models import statedict
from echo2.models.engine import EngineError, TransformersEngine
from echo2.models.offline import OFFLINE_VARS, is_offline, model_hub_offline
from echo2.node.budget import (
    Budget,
    ModelTooLarge,
    TaskTooLarge,
    check_model,
    footprint,
    memory_budget,
    plan_task,
)
from echo2.node.generate import generate_bounded
from echo2.node.hardware import Hardware
from echo2.node.runtime import Node, NodeConfig
from echo2.node.versions import HeldVersion
from echo2.protocol import envelope
from echo2.protocol.errors import ManifestError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    MAX_GROUP_SIZE,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    ErrorReply,
    Result,
    Task,
    TaskDecline,
)
from echo2.protocol.packedresult import PackedResult
from echo2.protocol.wire import DECLINE, RESULT

HUB = Identity.generate()
MiB = 1024**2


class HubWire:
    """Stands in for the network to the hub: keeps what the node sends, answers "ok"."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def request(self, peer: str, protocol: str, payload: bytes, **_kw: Any) -> bytes:
        assert peer == HUB.peer_id
        kind = {DECLINE: TaskDecline, RESULT: (PackedResult, Result)}[protocol]
        self.sent.append((protocol, envelope.open_envelope(payload, kind, replay=None, max_size=64 * MiB).message))
        return envelope.seal(HUB, ErrorReply(code="ok", message="noted"))


class SmallMemoryEngine(TransformersEngine):
    """A real engine on a machine with room for ``limit`` samples at once (more: MemoryError, as
    an allocation that fails would raise); ``fail`` makes every call fail with that error."""

    limit = 1 << 30
    fail: Exception | None = None
    calls: list[int]

    def generate(self, prompts: list[list[int]], group_size: int, *rest: Any) -> Any:  # type: ignore[override]
        self.calls.append(len(prompts) * group_size)
        if self.fail is not None:
            raise self.fail
        if len(prompts) * group_size > self.limit:
            raise MemoryError(f"cannot allocate {len(prompts) * group_size} samples")
        return super().generate(prompts, group_size, *rest)


def tiny_version(**config: Any) -> tuple[str, dict[str, bytes], dict[str, torch.Tensor]]:
    cj, arts = ms.artifacts_for({**ms.tiny_config(hidden=32, layers=1, heads=2), **config}, ms.tokenizer_json())
    torch.manual_seed(0)
    return cj, arts, ms.model_from_config(cj).state_dict()


def make_node(tmp_path: Path, budget_MiB: int, engine: TransformersEngine | None = None) -> Node:
    node = Node(NodeConfig(hub=f"/ip4/127.0.0.1/tcp/9/p2p/{HUB.peer_id}", data_dir=tmp_path,
                           memory_budget_MiB=budget_MiB))
    node._engine = engine or TransformersEngine(device="cpu")
    return node


def loaded_node(tmp_path: Path, budget_MiB: int, engine: TransformersEngine | None = None) -> Node:
    node = make_node(tmp_path, budget_MiB, engine)
    cj, arts, sd = tiny_version()
    node._footprint = node._check_fit(cj)  # what _load does before building the model
    node._engine.load_version(1, cj, arts, sd)
    return node


def task_for(node: Node, prompts: list[list[int]], group_size: int = 2, max_new_tokens: int = 3) -> Task:
    return Task(task_id="t-1", node_id=node.peer_id, prompts=prompts, group_size=group_size,
                max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, seed=5, min_version=1,
                max_version_lag=1, deadline=time.time() + 60)


def run_task(node: Node, task: Task) -> HubWire:
    wire = HubWire()

    async def main() -> None:
        with trio.fail_after(60):
            await node._run_task(wire, task)  # type: ignore[arg-type]

    trio.run(main)
    return wire


# --- A7: models ---------------------------------------------------------------------------------


def test_a7_model_over_the_memory_budget_is_refused_before_it_is_built(tmp_path: Path) -> None:
    node = make_node(tmp_path, budget_MiB=16)
    # ~8.5 M parameters, 34 MB in float32: over a 16 MiB budget (small enough that old code, which
    # built it anyway, would not hurt the machine running this test)
    cj, arts = ms.artifacts_for(ms.tiny_config(hidden=512, layers=2, heads=8), ms.tokenizer_json())
    small_sd = tiny_version()[2]
    pv = statedict.pack_version(small_sd, version=1, parent=None, model_config=cj, artifacts=arts)

    async def main() -> None:
        with pytest.raises(ModelTooLarge) as err:
            await node._load(HeldVersion(pv.manifest, pv.raw_chunks), 0.0)
        msg = err.value.message
        assert "8,5" in msg and "16.0 MiB" in msg and "budget" in msg, msg  # the number measured and the cap

    trio.run(main)
    assert node._engine.model is None and node.held is None  # nothing was built, nothing is held
    # the same node takes a model that fits
    cj, arts, sd = tiny_version()
    pv = statedict.pack_version(sd, version=2, parent=None, model_config=cj, artifacts=arts)

    async def load_small() -> None:
        with trio.fail_after(60):
            await node._load(HeldVersion(pv.manifest, pv.raw_chunks), 0.0)

    trio.run(load_small)
    assert node.held is not None and node.held.version == 2 and node._footprint is not None


def test_a7_config_sizes_are_bounded_before_a_library_sees_them(tmp_path: Path) -> None:
    node = make_node(tmp_path, budget_MiB=1 << 20)  # a 1 TiB budget: only the stated sizes stop these
    base = ms.tiny_config(hidden=32, layers=1, heads=2)
    for key, value in (("num_hidden_layers", 10**9), ("vocab_size", 1 << 40), ("hidden_size", -1),
                       ("num_attention_heads", True), ("layer_types", ["full_attention"] * 100_000)):
        t0 = time.monotonic()
        with pytest.raises(ManifestError, match=key):
            node._check_fit(json.dumps({**base, key: value}))
        assert time.monotonic() - t0 < 5, key  # refused, not built
    # stated sizes within the bounds but over the budget: refused before transformers builds the config
    huge = {**base, "hidden_size": 65536, "intermediate_size": 1 << 20, "num_hidden_layers": 512}
    with pytest.raises(ModelTooLarge, match="budget"):
        node._check_fit(json.dumps(huge))
    # sizes a node cannot know without the library's defaults are not guessed
    with pytest.raises(ModelTooLarge, match="cannot size"):
        node._check_fit(json.dumps({k: v for k, v in base.items() if k != "vocab_size"}))


def test_a7_model_size_counts_the_library_defaults_a_config_leaves_out() -> None:
    # no intermediate_size: transformers' qwen2 default (22016) applies, not a guess from hidden
    conf = {k: v for k, v in ms.tiny_config(hidden=32, layers=1, heads=2).items() if k != "intermediate_size"}
    cj = ms.config_json(conf)
    full = ms.hf_config_from_json(cj).to_dict()
    fp = footprint(full, "float32")
    assert fp.params == sum(p.numel() for p in ms.model_from_config(cj).parameters())
    assert fp.intermediate == 22016
    with pytest.raises(ModelTooLarge, match="does not fit"):
        check_model(fp, Budget(4 * MiB, "configured"))
    check_model(fp, Budget(64 * MiB, "configured"))


def test_a7_budget_is_configured_or_a_share_of_memory() -> None:
    hw = Hardware("", 0, 0, "cpu", 2, 10 * 1024**3, 0)
    assert memory_budget(hw, configured_MiB=100).bytes == 100 * MiB
    assert memory_budget(hw).bytes == 8 * 1024**3
    gpu = Hardware("H", 1, 80 * 1024**3, "cpu", 2, 10 * 1024**3, 0)
    assert memory_budget(gpu, on_accelerator=True).bytes == 64 * 1024**3


# --- A7: tasks ----------------------------------------------------------------------------------


def test_a7_task_sizes_are_checked_before_anything_is_allocated() -> None:
    cj = tiny_version()[0]
    fp = footprint(ms.hf_config_from_json(cj).to_dict(), "float32")
    big = Budget(1 << 40, "configured")
    # the schema's largest task: its result alone would be over the wire's result limit
    with pytest.raises(TaskTooLarge, match="result limit"):
        plan_task(fp, big, prompts=MAX_PROMPTS, group_size=MAX_GROUP_SIZE, prompt_len=MAX_PROMPT_TOKENS,
                  max_new_tokens=MAX_NEW_TOKENS)
    # a prompt so long that one sample does not fit what the model leaves of a small budget
    with pytest.raises(TaskTooLarge, match="budget") as err:
        plan_task(fp, Budget(64 * MiB, "configured"), prompts=1, group_size=1, prompt_len=4096, max_new_tokens=1)
    assert "4096" in err.value.message
    # what fits runs in batches that fit: all at once with room, fewer at a time in less
    plan = plan_task(fp, big, prompts=16, group_size=16, prompt_len=64, max_new_tokens=64)
    assert plan.batch_rows == plan.rows == 256
    tight = Budget(fp.resident_bytes + 256 * 64 * 160 + 10 * plan.sample_bytes, "configured")
    plan = plan_task(fp, tight, prompts=16, group_size=16, prompt_len=64, max_new_tokens=64)
    assert plan.batch_rows == 10
    assert plan_task(fp, big, prompts=16, group_size=16, prompt_len=64, max_new_tokens=64, rows_cap=3).batch_rows == 3


def test_a7_oversized_task_is_declined_to_the_hub_and_the_node_goes_on(tmp_path: Path) -> None:
    node = loaded_node(tmp_path, budget_MiB=64)
    # one sample of a 4096-token prompt needs its attention scores (heads × 4096² floats), over 64 MiB
    wire = run_task(node, task_for(node, [[5] * 4096], group_size=1, max_new_tokens=1))
    assert [p for p, _ in wire.sent] == [DECLINE]
    d = wire.sent[0][1]
    assert d.reason_code == "too_large" and "budget" in d.reason and d.task_id == "t-1"
    assert node.stats.tasks_declined == 1 and node._current_task is None
    # and the next, ordinary task runs
    wire = run_task(node, task_for(node, [[5, 6, 7], [8, 9]], group_size=2))
    assert [p for p, _ in wire.sent] == [RESULT] and len(wire.sent[0][1].completions) == 4


def test_a7_out_of_memory_lowers_the_batch_declines_at_one_sample_and_the_node_stays_up(tmp_path: Path) -> None:
    eng = SmallMemoryEngine(device="cpu")
    eng.calls = []
    node = loaded_node(tmp_path, budget_MiB=256, engine=eng)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    eng.limit = 2  # the budget allows all 12 samples at once; the machine holds 2
    wire = run_task(node, task_for(node, prompts, group_size=4))
    assert [p for p, _ in wire.sent] == [RESULT]
    res = wire.sent[0][1]
    assert [c.prompt_index for c in res.completions] == [0] * 4 + [1] * 4 + [2] * 4
    # 12 at once, then 6 (one whole prompt of 4 samples), then 2 at a time, which fits
    assert eng.calls[:3] == [12, 4, 2] and set(eng.calls[3:]) == {2}
    assert node._rows_cap == 2  # remembered: the next task starts small
    eng.calls.clear()
    run_task(node, task_for(node, prompts, group_size=4))
    assert set(eng.calls) == {2}
    # out of memory on a single sample: declined with its reason, and the node is still up
    eng.fail = MemoryError("no memory at all")
    wire = run_task(node, task_for(node, prompts, group_size=4))
    assert [(p, m.reason_code) for p, m in wire.sent] == [(DECLINE, "out_of_memory")]
    eng.fail = RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 TB")
    wire = run_task(node, task_for(node, prompts, group_size=4))
    assert [(p, m.reason_code) for p, m in wire.sent] == [(DECLINE, "out_of_memory")]
    eng.fail = ValueError("anything else the engine trips on")
    wire = run_task(node, task_for(node, prompts, group_size=4))
    assert [(p, m.reason_code) for p, m in wire.sent] == [(DECLINE, "engine_error")]
    eng.fail = None
    wire = run_task(node, task_for(node, prompts, group_size=4))
    assert [p for p, _ in wire.sent] == [RESULT]


def test_a7_batched_generation_matches_unbatched_when_it_fits() -> None:
    eng = TransformersEngine(device="cpu")
    cj, arts, sd = tiny_version()
    eng.load_version(1, cj, arts, sd)
    task = Task(task_id="t", node_id=HUB.peer_id, prompts=[[5, 6], [7], [8, 9, 10]], group_size=3, max_new_tokens=4,
                temperature=1.0, top_p=1.0, seed=9, min_version=0, max_version_lag=0, deadline=0.0)
    whole, rows = generate_bounded(eng, task, 9)
    assert rows == 9 and whole == eng.generate([list(p) for p in task.prompts], 3, 4, 1.0, 1.0, 9)
    with pytest.raises(EngineError, match="no prompts"):
        generate_bounded(eng, dataclasses.replace(task, prompts=[]), 4)
    for batch in (1, 2, 4, 6):
        got, _ = generate_bounded(eng, task, batch)
        assert [c.prompt_index for c in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2], batch
        assert all(1 <= len(c.token_ids) <= 4 for c in got)


# --- A8: model config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("attn_implementation", "kernels-community/flash-attn"),
        ("_attn_implementation", "kernels-community/flash-attn"),
        ("experts_implementation", "kernels-community/x"),
        ("auto_map", {"AutoModelForCausalLM": "evil.Model"}),
        ("quantization_config", {"quant_method": "bitsandbytes"}),
        ("return_dict", False),
    ],
)
def test_a8_config_key_outside_the_allow_list_is_refused_by_name(key: str, value: Any) -> None:
    cj = json.dumps({**ms.tiny_config(hidden=32, layers=1, heads=2), key: value})
    with pytest.raises(ManifestError, match=f"key '{key}' is not allowed"):
        ms.parse_model_config(cj)
    with pytest.raises(ManifestError, match=key):
        ms.model_from_config(cj)
    eng = TransformersEngine(device="cpu")
    with pytest.raises(ManifestError, match=key):
        eng.load_version(1, cj, {"tokenizer.json": ms.tokenizer_json()}, tiny_version()[2])
    assert eng.model is None  # the setting never reached the engine


def test_a8_models_use_builtin_attention_and_known_architectures() -> None:
    cj = tiny_version()[0]
    assert ms.hf_config_from_json(cj)._attn_implementation == "sdpa"
    assert ms.model_from_config(cj).config._attn_implementation == "sdpa"
    evil = json.dumps({**json.loads(cj), "architectures": ["EvilForCausalLM"]})
    with pytest.raises(ManifestError, match="architectures"):
        ms.parse_model_config(evil)
    # checkpoint metadata is tolerated and dropped, never passed on
    meta = json.dumps({**json.loads(cj), "transformers_version": "5.0", "torch_dtype": "float32"})
    assert "transformers_version" not in ms.parse_model_config(meta)
    kept, dropped = ms.allowed_part({**json.loads(cj), "is_llama_config": True, "attn_implementation": "x"})
    assert dropped == ["attn_implementation", "is_llama_config"] and ms.parse_model_config(ms.config_json(kept))


def test_a8_node_runs_with_the_model_hub_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf_constants

    for var in OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    # the operator's explicit override leaves the environment alone
    model_hub_offline(False)
    assert not is_offline() and all(v not in os.environ for v in OFFLINE_VARS)
    # a node, started for real (its hub is not there: it is stopped while it retries)
    node = Node(NodeConfig(hub=f"/ip4/127.0.0.1/tcp/9/p2p/{HUB.peer_id}", data_dir=tmp_path, engine="transformers"))

    async def main() -> None:
        with trio.move_on_after(1.5):
            await node.run()

    trio.run(main)
    assert all(os.environ[v] == "1" for v in OFFLINE_VARS)
    assert hf_constants.HF_HUB_OFFLINE is True and is_offline()
    assert "huggingface_hub.constants" in sys.modules


def test_task_meter_follows_a_running_task_between_tokens() -> None:
    """Issue 19 item 4: the task's progress line says how far generation is, token by token."""
    from echo2.node.generate import TaskMeter
    from echo2.node.progress import NodeSteps, Progress

    eng = TransformersEngine(device="cpu")
    cj, arts, sd = tiny_version()
    eng.load_version(1, cj, arts, sd)
    task = Task(task_id="t", node_id=HUB.peer_id, prompts=[[5, 6], [7], [8, 9, 10]], group_size=2, max_new_tokens=6,
                temperature=1.0, top_p=1.0, seed=9, min_version=0, max_version_lag=0, deadline=0.0)
    meter = TaskMeter(6, 6)
    out = io.StringIO()
    steps = NodeSteps(Progress("json", out=out))
    steps.task("t", 3, 2, 6, meter)
    seen: list[tuple[int, int]] = []

    def stop() -> bool:  # asked between tokens: the meter is already counting this call's steps
        seen.append((meter.samples_done, meter.step))
        return False

    comps, rows = generate_bounded(eng, task, 2, stop, meter)  # 2 samples per engine call: 3 calls
    assert rows == 2 and meter.samples_done == 6 and meter.tokens_done == sum(len(c.token_ids) for c in comps)
    assert {d for d, _ in seen} == {0, 2, 4} and max(s for _, s in seen) >= 1  # counted inside each call
    assert engine_hook_cleared(eng)
    steps.p._say(steps.p.message, steps.p.fields, again=True)  # what the watcher says while it runs
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["event"] == "task" and f"6 of 6 samples done ({meter.tokens_done} tokens)" in line["message"]


def engine_hook_cleared(eng: TransformersEngine) -> bool:
    return getattr(eng, "interrupt", None) is None


def test_a_version_over_the_disk_cap_pauses_the_node_with_the_reason(tmp_path: Path) -> None:
    """Issue 19: a version this node cannot store is not silently dropped: the node pauses (the hub
    hears why, with no reputation cost), and a version that loads later clears it."""
    node = make_node(tmp_path, budget_MiB=256)
    node._on_version_refused(7, "needs 3,000,000 bytes on disk, the disk cap leaves 1,000")
    d = node.pauser.current
    assert node.pauser.paused and d.code == "disk" and "version 7" in d.reason and "disk cap" in d.reason and d.relay
    node.pauser.clear_block()  # what a version that loads does
    assert not node.pauser.paused
