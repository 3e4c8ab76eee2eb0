"""What this machine has (for the Announce and ``echo2 node doctor``) and whether a model fits.

The probe never fails: a broken CUDA install, a missing ``nvidia-smi`` or an unreadable
``/proc`` each leave their fields empty rather than stopping a node that could still run on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GiB = 1024**3
NVIDIA_SMI_TIMEOUT_S = 5.0

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "int8": 1,
    "fp8": 1,
    "float8": 1,
}


@dataclass(frozen=True)
class Hardware:
    accelerator: str
    accelerator_count: int
    accelerator_memory_bytes: int
    cpu_model: str
    cpu_cores: int
    ram_bytes: int
    free_disk_bytes: int
    os: str = ""
    python: str = ""
    accelerator_source: str = ""  # "torch", "nvidia-smi" or "" (none found)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()[:120]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "unknown")[:120]


def _cpu_cores() -> int:
    # The cores this process may use (cgroup/affinity), not the host's total.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _torch_accelerator() -> tuple[str, int, int]:
    try:
        import torch

        if torch.cuda.is_available():
            count = int(torch.cuda.device_count())
            props = torch.cuda.get_device_properties(0)
            return str(props.name)[:120], count, int(props.total_memory)
    except Exception as exc:  # a broken CUDA install must not stop a CPU node
        log.debug("torch CUDA probe failed: %r", exc)
    return "", 0, 0


def parse_nvidia_smi(text: str) -> tuple[str, int, int]:
    """``name, memory.total`` CSV lines (MiB, no units) -> (name of GPU 0, count, bytes of GPU 0)."""
    rows: list[tuple[str, int]] = []
    for line in text.strip().splitlines():
        name, sep, mem = line.rpartition(",")
        if not sep:
            continue
        try:
            rows.append((name.strip()[:120], int(float(mem.strip()) * 1024 * 1024)))
        except ValueError:
            continue
    if not rows:
        return "", 0, 0
    return rows[0][0], len(rows), rows[0][1]


def _nvidia_smi_accelerator() -> tuple[str, int, int]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "", 0, 0
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %r", exc)
        return "", 0, 0
    if out.returncode != 0:
        return "", 0, 0
    return parse_nvidia_smi(out.stdout)


def probe(data_dir: Path) -> Hardware:
    accel, count, mem = _torch_accelerator()
    source = "torch" if count else ""
    if not count:
        # torch may be a CPU build on a GPU machine (or CUDA broken): nvidia-smi still tells
        # the operator what is there, which is what doctor reports.
        accel, count, mem = _nvidia_smi_accelerator()
        source = "nvidia-smi" if count else ""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    return Hardware(
        accelerator=accel,
        accelerator_count=count,
        accelerator_memory_bytes=mem,
        cpu_model=_cpu_model(),
        cpu_cores=_cpu_cores(),
        ram_bytes=_ram_bytes(),
        free_disk_bytes=int(shutil.disk_usage(data_dir).free),
        os=f"{platform.system()} {platform.release()}"[:120],
        python=platform.python_version(),
        accelerator_source=source,
    )


# --- does a model fit? -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    params: int
    layers: int
    kv_bytes_per_token_per_byte: int  # KV cache elements per token (multiply by dtype bytes)


def _int(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def estimate_model_size(config: dict[str, Any]) -> ModelSize:
    """Parameter count of a decoder-only HF config (no weights needed).

    embeddings V·H (twice when the LM head is untied) + per layer: attention (q, o: H·Hq;
    k, v: H·Hkv, biases for qwen2) + MLP (3·H·I gated, 2·H·I for gpt2-style, times experts)
    + norms. Within a few percent of the real count for llama/qwen/mistral/gemma/gpt2.
    """
    cfg = dict(config.get("text_config") or config)
    model_type = str(config.get("model_type", ""))
    v = _int(cfg, "vocab_size")
    h = _int(cfg, "hidden_size", "n_embd", "d_model")
    n_layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head", default=1)
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=h // max(heads, 1))
    inter = _int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    experts = _int(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=1)
    if not (v and h and n_layers):
        raise ValueError("model config lacks vocab_size / hidden_size / num_hidden_layers")
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
    q = heads * head_dim
    kv = kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h
    if model_type in ("qwen2", "gpt2"):
        attn += q + 2 * kv + (h if model_type == "gpt2" else 0)
    gated = model_type != "gpt2"
    mlp = (3 if gated else 2) * h * inter * experts
    if model_type == "gpt2":
        mlp += inter + h  # c_fc and c_proj biases
    if experts > 1:
        mlp += h * experts  # router
    norms = 2 * h * (2 if model_type == "gpt2" else 1)
    per_layer = attn + mlp + norms
    emb = v * h * (1 if tied else 2)
    pos = _int(cfg, "n_positions", default=0) * h if model_type == "gpt2" else 0
    params = emb + pos + n_layers * per_layer + h
    return ModelSize(params=params, layers=n_layers, kv_bytes_per_token_per_byte=2 * n_layers * kv)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fits(
    model_config_json: str,
    dtype: str,
    memory_bytes: int,
    *,
    kv_tokens: int = 16 * 16 * 512,
    overhead: float = 1.2,
) -> tuple[bool, int, str]:
    """Whether the model fits in ``memory_bytes`` (GPU memory, or RAM on a CPU node).

    needed = params · bytes(dtype) · overhead (activations, allocator slack, CUDA context)
             + KV cache for ``kv_tokens`` tokens in flight (default: 16 prompts × 16 samples ×
             512 tokens, a typical task).
    Returns (ok, needed bytes, a message that says what to do when it does not fit).
    """
    try:
        config = json.loads(model_config_json)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        size = estimate_model_size(config)
    except (ValueError, TypeError) as exc:
        return False, 0, f"cannot read the model config: {exc}"
    b = DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
    if b is None:
        return False, 0, f"unknown dtype {dtype!r} (one of {sorted(DTYPE_BYTES)})"
    weights = size.params * b
    kv = size.kv_bytes_per_token_per_byte * b * max(0, kv_tokens)
    needed = int(weights * overhead + kv)
    what = (
        f"{size.params / 1e6:.1f} M params × {b} B ({dtype}) = {_gib(weights)} weights, "
        f"+{round((overhead - 1) * 100)}% overhead, + {_gib(kv)} KV cache for {kv_tokens} tokens"
    )
    if memory_bytes <= 0:
        return False, needed, f"needs ~{_gib(needed)} ({what}), but the available memory is unknown"
    if needed <= memory_bytes:
        return True, needed, f"fits: needs ~{_gib(needed)} of {_gib(memory_bytes)} ({what})"
    hint = "bfloat16 halves the weights" if b > 2 else "a device with more memory"
    return (
        False,
        needed,
        f"does not fit: needs ~{_gib(needed)} but only {_gib(memory_bytes)} is available ({what}); "
        f"use {hint}, fewer samples in flight, or a smaller model",
    )


def python_summary() -> str:
    return f"Python {platform.python_version()} ({sys.executable})"
