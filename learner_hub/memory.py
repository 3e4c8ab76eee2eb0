"""What the learner will need in memory, per rank, before a byte of the model is loaded (issue 17).

A full fine-tune's memory is set by arithmetic, not by measurement: ``P`` parameters in float32
are ``4P`` bytes, their gradients ``4P'`` (``P'`` = the trainable ones: all of them, or the LoRA
adapters), AdamW's two moments ``8P'``; FSDP2 shards all three over the ``N`` ranks. On top come
the activations of one micro-batch of ``T`` tokens (the logits, ``T x V``, dominate a small model
with a large vocabulary: SmolLM2's 49,152 entries make 16k tokens of float32 logits 3.2 GB), the
layers FSDP2 gathers to compute one block, and a KL reference when ``kl_coef > 0``. The hub
process holds what it publishes and verifies with (the packed versions it keeps, a float32
shadow for verification).

The sans-IO part (:func:`plan`) takes counts and returns bytes; :func:`count_params` builds the
model on the meta device (no memory) to count, and :func:`available_bytes` reads what a rank can
have. The hub prints the plan at start-up and refuses a rank that cannot hold its share, naming
the terms and the options that shrink them, rather than being OOM-killed mid-step.

Activations use the per-layer estimate of Korthikanti et al. (2022), ``34 s b h`` bytes at 16-bit
(so ``17 T h`` elements), without the ``5 a s^2 b`` attention term (SDPA does not materialise the
score matrix); activation checkpointing keeps one ``T x h`` input per layer plus one layer's
recompute. It is an estimate and says so; the first terms are exact.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model (counted on the meta device)."""

    params: int
    trainable: int  # all params for a full fine-tune; the adapters' for LoRA
    layers: int
    hidden: int
    vocab: int
    largest_layer_params: int  # the biggest decoder block: what FSDP2 gathers to compute it


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per learner rank and in the hub process, by term."""

    ranks: int
    rank_terms: dict[str, int] = field(default_factory=dict)
    hub_terms: dict[str, int] = field(default_factory=dict)

    @property
    def per_rank(self) -> int:
        return sum(self.rank_terms.values())

    @property
    def hub(self) -> int:
        return sum(self.hub_terms.values())

    def describe(self) -> str:
        def fmt(terms: Mapping[str, int]) -> str:
            return ", ".join(f"{k} {v / GiB:.2f}" for k, v in terms.items() if v)

        return (
            f"learner memory per rank ({self.ranks} rank{'s' if self.ranks > 1 else ''}): "
            f"{self.per_rank / GiB:.2f} GiB ({fmt(self.rank_terms)}); hub process: {self.hub / GiB:.2f} GiB "
            f"({fmt(self.hub_terms)})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks, "per_rank_bytes": self.per_rank, "hub_bytes": self.hub,
            "rank_terms": dict(self.rank_terms), "hub_terms": dict(self.hub_terms),
        }


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan(
    shape: ModelShape,
    *,
    ranks: int = 1,
    micro_batch_tokens: int = 16384,
    compute_dtype: str = "float32",
    publish_dtype: str = "bfloat16",
    kl_reference: bool = False,
    lora: bool = False,
    activation_checkpointing: bool = False,
    kept_versions: int = 3,
    step_tokens: int = 0,
) -> MemoryPlan:
    """The memory plan for one configuration. ``kept_versions``: published versions whose bytes
    the publisher keeps (staleness + 2, see publisher.py); ``step_tokens``: the most padded tokens
    one step can hold (rows x longest row), which caps a micro-batch below its budget (0: no cap)."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    n, p, pt = ranks, shape.params, shape.trainable
    cb = _DTYPE_BYTES.get(compute_dtype, 4)
    pb = _DTYPE_BYTES.get(publish_dtype, 4)
    shard = lambda b: math.ceil(b / n)  # noqa: E731
    terms: dict[str, int] = {
        "parameters": shard(4 * p),  # float32 master weights (LoRA: the frozen base too)
        "gradients": shard(4 * pt),
        "adamw": shard(8 * pt),
    }
    if n > 1:
        # FSDP2 all-gathers the block it computes and prefetches the next: two blocks unsharded
        terms["gathered_blocks"] = 2 * shape.largest_layer_params * cb
    if kl_reference and not lora:  # LoRA's reference is the same base with adapters off
        terms["kl_reference"] = shard(4 * p)
    t = min(micro_batch_tokens, step_tokens) if step_tokens > 0 else micro_batch_tokens
    h = shape.hidden
    per_layer = 17 * t * h * cb
    if activation_checkpointing:
        acts = shape.layers * t * h * cb + per_layer
    else:
        acts = shape.layers * per_layer
    terms["activations_est"] = acts
    # logits in the compute dtype and their gradient; the float32 log-softmax is chunked
    # (spec.LOGPROB_CHUNK_POSITIONS) so its share is bounded and counted in the estimate above
    terms["logits"] = 2 * t * shape.vocab * cb
    published = (pt if lora else p) * pb
    hub: dict[str, int] = {
        # each kept version: its raw chunks and their encodings (zstd never beats raw by much on
        # trained float weights, so count both at the raw size); version 0 of a LoRA policy is the base
        "published_versions": kept_versions * 2 * published + (2 * p * pb if lora else 0),
        "verify_shadow": 4 * p,  # float32 model the verifier loads a published version into
    }
    if n > 1:
        # rank 0 gathers the full state dict (CPU offloaded) to hand it to the hub for publication
        terms["publish_gather"] = 4 * (pt if lora else p)
        hub["model_template"] = 4 * p  # the hub's copy the verifier's shadow is made from
    return MemoryPlan(n, terms, hub)


def available_bytes(device: str = "cpu", *, local_ranks: int = 1) -> int:
    """What one rank can have: a CUDA device's free memory, or on CPU the machine's available
    memory (``MemAvailable``; cgroup limit when smaller) shared by the local ranks and the hub."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    avail = _meminfo_available()
    limit = _cgroup_limit()
    if limit is not None:
        avail = min(avail, limit)
    return avail // max(1, local_ranks)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def _lora_targets(lora: Any) -> list[str] | str:
    if lora is None:
        return []
    tm = lora.get("target_modules") if isinstance(lora, Mapping) else getattr(lora, "target_modules", None)
    return tm or "all-linear"


def _lora_rank(lora: Any) -> int:
    r = lora.get("r") if isinstance(lora, Mapping) else getattr(lora, "r", None)
    return int(r or 16)


def lora_trainable(linears: Iterable[tuple[str, int, int]], targets: list[str] | str, r: int) -> int:
    """Adapter parameters: ``r (in + out)`` per targeted linear layer (``all-linear``: every
    linear but the output head, as peft does)."""
    total = 0
    for name, fan_in, fan_out in linears:
        leaf = name.rsplit(".", 1)[-1]
        if targets == "all-linear" or targets == ["all-linear"]:
            hit = leaf != "lm_head"
        else:
            hit = leaf in targets or name in targets
        if hit:
            total += r * (fan_in + fan_out)
    return total


def count_params(model_config_json: str, lora: Any = None) -> ModelShape:
    """Count a model's parameters on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from echo2.models import spec as modelspec

    hf = modelspec.hf_config_from_json(model_config_json)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=modelspec.BUILTIN_ATTENTION)
    # tied embeddings are one tensor: parameters() yields it once
    params = sum(p.numel() for p in model.parameters())
    linears = [(n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    layers_mod = getattr(getattr(model, "model", model), "layers", None)
    blocks = list(layers_mod) if layers_mod is not None else []
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=params)
    trainable = lora_trainable(linears, _lora_targets(lora), _lora_rank(lora)) if lora else params
    return ModelShape(
        params=params, trainable=trainable, layers=max(1, len(blocks)),
        hidden=int(getattr(hf, "hidden_size", 0) or 0), vocab=int(getattr(hf, "vocab_size", 0) or 0),
        largest_layer_params=largest,
    )


class LearnerMemoryError(RuntimeError):
    """A learner rank cannot hold its share of the configured model."""


#: the terms that scale with the micro-batch's tokens (an estimate); the others are exact
ACTIVATION_TERMS = ("activations_est", "logits")


def check(mem: MemoryPlan, available: int, *, what: str = "a rank", micro_batch_tokens: int = 0) -> str | None:
    """Refuse a plan whose model state (parameters, gradients, AdamW, reference, gathers: exact
    figures) does not fit in ``available``, naming the terms and the remedies. When only the
    activation estimate at the full micro-batch budget overflows, return a warning with the
    ``micro_batch_tokens`` that would fit instead: the budget is a worst case that a step of
    short rows never reaches (examples/arith's SmolLM2 steps run in ~3 GB where the budget's
    worst case is 14 GB), so refusing on it would turn away configurations that run."""
    state = sum(v for k, v in mem.rank_terms.items() if k not in ACTIVATION_TERMS)
    acts = mem.per_rank - state
    if state > available:
        top = sorted(mem.rank_terms.items(), key=lambda kv: -kv[1] if kv[0] not in ACTIVATION_TERMS else 0)[:3]
        raise LearnerMemoryError(
            f"{what} needs {state / GiB:.2f} GiB for the model's state alone (plus ~{acts / GiB:.2f} GiB of "
            f"activations) but has {available / GiB:.2f} GiB available (largest terms: "
            f"{', '.join(f'{k} {v / GiB:.2f} GiB' for k, v in top)}). Shrink it with learner_procs = N "
            "(FSDP2 shards parameters, gradients and AdamW state N ways) or a lora table (trains adapters "
            "only); memory_check = false skips this check"
        )
    if mem.per_rank <= available:
        return None
    hint = ""
    if micro_batch_tokens > 0 and acts > 0:
        fit = int(micro_batch_tokens * (available - state) / acts)
        hint = f"; micro_batch_tokens = {max(64, fit)} would fit"
    return (
        f"{what}: a micro-batch at the full budget may need ~{mem.per_rank / GiB:.2f} GiB where "
        f"{available / GiB:.2f} GiB is available (activations are an estimate; short rows need less){hint}"
    )


__all__ = [
    "ACTIVATION_TERMS", "GiB", "LearnerMemoryError", "MemoryPlan", "ModelShape", "available_bytes", "check", "count_params",
    "lora_trainable", "plan",
]
