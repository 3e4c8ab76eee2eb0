"""What a node lets a hub make it allocate (A7): a model and a task, sized before they exist.

A hub (or whoever forges one) chooses the model config and every task's size; the node must
never be the one that finds out by running out of memory. So the node has a memory budget
(configured, or most of its RAM / accelerator memory), and checks against it, before allocating:

* a model: its weights (parameter count from the full config, defaults filled in, times the
  dtype's bytes, plus slack) must fit, else the version is refused (``model_too_large``);
* a task: one sample (KV cache over prompt + new tokens, the per-step logits and sampling
  buffers, the prompt's forward activations, the completion kept in Python) must fit in what the
  weights leave, and the whole result must fit the wire's result limit and the budget, else the
  task is declined (``too_large``); otherwise the task runs in batches of as many samples as fit.

Pure: numbers in, numbers out; the node measures, the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo2.protocol.errors import ManifestError, MeaningError
from echo2.protocol.wire import MAX_RESULT

from .hardware import DTYPE_BYTES, Hardware, estimate_model_size

GiB = 1024**3
MiB = 1024**2
#: Share of RAM (CPU engine) or accelerator memory the auto budget takes; the rest is the OS's,
#: the allocator's and the CUDA context's.
AUTO_BUDGET_FRACTION = 0.8
#: Weights are held once, plus what building and loading them costs on top (allocator slack).
WEIGHTS_OVERHEAD = 1.25
#: Per generated token kept on the host until the result is sent: a Python int and float in the
#: completion's lists, their list slots, the tensors' .tolist() copies and the encoded bytes.
HOST_BYTES_PER_TOKEN = 160
#: Encoded size of one completion in a Result: a token id is at most 5 bytes, a float64 log-prob 9.
WIRE_BYTES_PER_TOKEN = 14
WIRE_BYTES_PER_COMPLETION = 64
#: Slack on a sample's engine memory (transient copies: the KV cache grows by concatenation).
SAMPLE_OVERHEAD = 1.5


class ModelTooLarge(ManifestError):
    """The model of this version does not fit this node's memory budget."""

    code = "model_too_large"


class TaskTooLarge(MeaningError):
    """The task needs more memory than this node's budget allows (declined, not run)."""

    code = "too_large"


class OutOfMemory(MeaningError):
    """The engine ran out of memory even on one sample of the task."""

    code = "out_of_memory"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # how it was set, for messages: "configured", "80% of RAM", ...

    def __str__(self) -> str:
        return f"{_gib(self.bytes)} ({self.source})"


def memory_budget(hw: Hardware, *, configured_MiB: int = 0, on_accelerator: bool = False) -> Budget:
    """The configured budget, else a share of the memory the engine allocates from."""
    if configured_MiB > 0:
        return Budget(configured_MiB * MiB, "configured")
    if on_accelerator and hw.accelerator_memory_bytes > 0:
        return Budget(int(hw.accelerator_memory_bytes * AUTO_BUDGET_FRACTION),
                      f"{AUTO_BUDGET_FRACTION:.0%} of accelerator memory")
    if hw.ram_bytes > 0:
        return Budget(int(hw.ram_bytes * AUTO_BUDGET_FRACTION), f"{AUTO_BUDGET_FRACTION:.0%} of RAM")
    # memory unknown: a small budget that tiny models fit, rather than no bound at all
    return Budget(2 * GiB, "default (memory size unknown)")


def _dim(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


@dataclass(frozen=True)
class Footprint:
    """The sizes of a model that decide what it costs to hold it and to sample from it."""

    params: int
    dtype_bytes: int
    kv_elems_per_token: int  # keys and values of every layer, per token of context
    vocab: int
    hidden: int
    heads: int
    intermediate: int

    @property
    def weights_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def resident_bytes(self) -> int:
        return int(self.weights_bytes * WEIGHTS_OVERHEAD)

    def sample_bytes(self, prompt_len: int, new_tokens: int) -> int:
        """Engine memory for one sample: KV cache, per-step logits and sampling buffers (float32:
        logits, scaled, log-softmax, probabilities, sorted values and indices), the prompt's
        forward (hidden states, MLP intermediates, attention scores when no fused kernel), and the
        generated tokens and log-probs."""
        ctx = prompt_len + new_tokens
        kv = self.kv_elems_per_token * self.dtype_bytes * ctx
        step = self.vocab * 4 * 8
        prompt = prompt_len * (4 * self.hidden + 3 * self.intermediate) * 4 + self.heads * prompt_len * prompt_len * 4
        out = new_tokens * (8 + 4) + ctx * 8 * 2  # tokens, log-probs, attention mask, positions
        return int((kv + step + prompt + out) * SAMPLE_OVERHEAD)


def footprint(full_config: dict[str, Any], dtype: str) -> Footprint:
    """From a config with the library's defaults filled in (an absent key means the library's
    default, which may be large); ModelTooLarge when it cannot be sized."""
    b = DTYPE_BYTES.get(dtype.removeprefix("torch."))
    if b is None:
        raise ModelTooLarge(f"unknown dtype {dtype!r}")
    try:
        size = estimate_model_size(full_config)
    except (ValueError, TypeError) as exc:
        raise ModelTooLarge(f"cannot size the model: {exc}") from exc
    cfg = dict(full_config.get("text_config") or full_config)
    h = _dim(cfg, "hidden_size", "n_embd", "d_model")
    return Footprint(
        params=size.params,
        dtype_bytes=b,
        kv_elems_per_token=size.kv_bytes_per_token_per_byte,
        vocab=_dim(cfg, "vocab_size"),
        hidden=h,
        heads=_dim(cfg, "num_attention_heads", "n_head", default=1),
        intermediate=_dim(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h),
    )


def check_model(fp: Footprint, budget: Budget) -> None:
    """ModelTooLarge unless the weights, and one short sample, fit the budget."""
    need = fp.resident_bytes + fp.sample_bytes(1, 1)
    if need > budget.bytes:
        raise ModelTooLarge(
            f"model does not fit: {fp.params:,} parameters × {fp.dtype_bytes} B need ~{_gib(need)}, "
            f"this node's memory budget is {budget}"
        )


@dataclass(frozen=True)
class TaskPlan:
    rows: int  # prompts × samples
    batch_rows: int  # samples generated together (≤ rows)
    sample_bytes: int
    result_bytes: int


def plan_task(
    fp: Footprint,
    budget: Budget,
    *,
    prompts: int,
    group_size: int,
    prompt_len: int,
    max_new_tokens: int,
    rows_cap: int = 0,
    result_limit: int = MAX_RESULT,
) -> TaskPlan:
    """How to run a task in the budget (batch size), or TaskTooLarge saying what does not fit."""
    rows = prompts * group_size
    room = budget.bytes - fp.resident_bytes
    result_bytes = rows * (WIRE_BYTES_PER_COMPLETION + max_new_tokens * WIRE_BYTES_PER_TOKEN) + 4096
    if result_bytes > result_limit:
        raise TaskTooLarge(
            f"{prompts} prompts × {group_size} samples × {max_new_tokens} tokens make a result of up to "
            f"{_gib(result_bytes)}, over the {_gib(result_limit)} result limit"
        )
    host = rows * max_new_tokens * HOST_BYTES_PER_TOKEN
    sample = fp.sample_bytes(prompt_len, max_new_tokens)
    if host + sample > room:
        raise TaskTooLarge(
            f"{prompts} prompts (up to {prompt_len} tokens) × {group_size} samples × {max_new_tokens} new tokens "
            f"need ~{_gib(host)} for the completions and ~{_gib(sample)} per sample, but the model leaves "
            f"{_gib(max(room, 0))} of this node's memory budget {budget}"
        )
    batch = min(rows, (room - host) // sample)
    if rows_cap > 0:
        batch = min(batch, rows_cap)
    return TaskPlan(rows=rows, batch_rows=max(1, int(batch)), sample_bytes=sample, result_bytes=result_bytes)
