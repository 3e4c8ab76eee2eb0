"""LoRA policies (issue 17 item 3): one naming rule shared by the learner, the verifier and nodes.

A LoRA policy is a frozen base model plus trained adapter tensors, injected by peft into the base
model's own modules (``get_peft_model``); everyone here works on that *inner* model
(``PeftModel.get_base_model()``), whose forward applies the adapters, so the samplers and the one
teacher-forced implementation need no peft-specific code path.

Publication layout. A published LoRA version is base + adapter in one state dict:

- base tensors under the plain model's names (peft's ``.base_layer`` component removed), exactly
  the names a non-LoRA publication of the same model has;
- adapter tensors under ``ADAPTER_PREFIX`` + the inner model's name
  (``~lora.model.layers.0.self_attn.q_proj.lora_A.default.weight``).

Why not adapter tensors alone: a node that joins after version 0 would have no base, and the data
plane has no "send me version 0" request. With the prefix, which sorts after every base name
(``~`` is 0x7E, above letters and digits), the adapter bytes are the tail of the canonical flat
buffer: the base chunks are byte-identical in every version, the chunk store (content addressed by
raw hash) never fetches them twice, and a delta version costs the base only its zero-XOR frames
(packing: ``keep_unchanged``). A late joiner, lacking the parent, gets full encodings of
everything, base included, through the existing fallback. The manifest carries the adapter's
configuration as the artifact ``adapter_config.json`` (a peft-compatible subset), which is how a
node tells a LoRA version from a plain one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

ADAPTER_PREFIX = "~lora."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"
#: keys of adapter_config.json a node reads (the rest of peft's file is informational)
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias")
MAX_RANK = 4096


def is_adapter_key(name: str) -> bool:
    """True for peft's adapter tensors in the inner model's state dict (lora_A/lora_B/...)."""
    return any(part.startswith("lora_") for part in name.split("."))


def base_name(name: str) -> str:
    """The plain model's name of a wrapped base tensor (peft moves it under ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def published_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner model's state dict under publication names (identity for a model without LoRA)."""
    if not any(is_adapter_key(k) for k in state_dict):
        return dict(state_dict)  # a plain model keeps its names, whatever they contain
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        out[ADAPTER_PREFIX + k if is_adapter_key(k) else base_name(k)] = v
    return out


def is_lora_publication(names: Mapping[str, Any] | Any) -> bool:
    return any(str(k).startswith(ADAPTER_PREFIX) for k in names)


def to_model_names(model: torch.nn.Module, published: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A published state dict renamed to ``model``'s own keys (the inverse of ``published_names``
    for that model). Names the model lacks keep their published name, so ``load_state_dict``
    (strict) or ``check_state_dict`` reports them rather than this dropping them silently."""
    own = list(model.state_dict())
    if not any(is_adapter_key(k) for k in own):
        return dict(published)
    back = {ADAPTER_PREFIX + k if is_adapter_key(k) else base_name(k): k for k in own}
    return {back.get(k, k): v for k, v in published.items()}


def adapter_config_json(peft_model: Any) -> bytes:
    """The ``adapter_config.json`` artifact of a peft model's adapter: what a node needs to build
    the same LoRA layers (target modules resolved, so "all-linear" becomes the names it matched)."""
    c = peft_model.peft_config[ADAPTER_NAME]
    targets = c.target_modules
    doc = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(c.r),
        "lora_alpha": int(c.lora_alpha),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        "lora_dropout": float(c.lora_dropout),
        "bias": str(c.bias),
    }
    return json.dumps(doc, sort_keys=True).encode()


def parse_adapter_config(raw: bytes) -> dict[str, Any]:
    """The checked fields of an ``adapter_config.json`` artifact; ValueError if malformed."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{ADAPTER_CONFIG}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{ADAPTER_CONFIG}: not an object")
    cfg = {k: doc.get(k) for k in _CONFIG_KEYS}
    if not isinstance(cfg["r"], int) or not 0 < cfg["r"] <= MAX_RANK:
        raise ValueError(f"{ADAPTER_CONFIG}: r must be an integer in 1..{MAX_RANK}")
    a = cfg["lora_alpha"]
    if isinstance(a, float) and a.is_integer():
        a = cfg["lora_alpha"] = int(a)
    if not isinstance(a, int) or isinstance(a, bool) or not a > 0:
        raise ValueError(f"{ADAPTER_CONFIG}: lora_alpha must be an integer > 0")
    tm = cfg["target_modules"]
    if not (isinstance(tm, str) or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm))):
        raise ValueError(f"{ADAPTER_CONFIG}: target_modules must be a string or a list of strings")
    cfg["lora_dropout"] = float(cfg["lora_dropout"] or 0.0)
    cfg["bias"] = cfg["bias"] or "none"
    if cfg["bias"] != "none":
        raise ValueError(f"{ADAPTER_CONFIG}: bias {cfg['bias']!r}: only 'none' (bias tensors would be base tensors that train)")
    return cfg


def wrap(model: torch.nn.Module, *, r: int, alpha: int, target_modules: list[str] | str, dropout: float = 0.0) -> Any:
    """peft's ``get_peft_model`` over ``model`` (modified in place): only the adapters train.
    Returns the PeftModel; its ``get_base_model()`` is the inner model everyone runs."""
    from peft import LoraConfig, get_peft_model

    if isinstance(target_modules, list) and target_modules == ["all-linear"]:
        target_modules = "all-linear"
    conf = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=dropout, bias="none")
    return get_peft_model(model, conf, adapter_name=ADAPTER_NAME)


def wrap_from_artifact(model: torch.nn.Module, raw: bytes) -> torch.nn.Module:
    """The inner model of ``model`` wrapped as the ``adapter_config.json`` artifact says (a node)."""
    c = parse_adapter_config(raw)
    peft_model = wrap(model, r=c["r"], alpha=c["lora_alpha"], target_modules=c["target_modules"], dropout=c["lora_dropout"])
    inner: torch.nn.Module = peft_model.get_base_model()
    return inner


class AdapterOff(torch.nn.Module):
    """The KL reference of a LoRA learner: the same model with its adapters disabled (peft's
    ``disable_adapter()``), so the frozen base serves as the initial policy without a second copy.
    The model is held outside ``_modules`` so that ``.eval()``/``requires_grad_`` on this wrapper
    never reach the trained adapters."""

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        self.__dict__["_peft"] = peft_model

    def parameters(self, recurse: bool = True) -> Any:
        return self.__dict__["_peft"].parameters(recurse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        peft_model = self.__dict__["_peft"]
        with peft_model.disable_adapter():
            return peft_model.get_base_model()(*args, **kwargs)


__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_PREFIX", "AdapterOff", "adapter_config_json", "is_adapter_key", "is_lora_publication",
    "parse_adapter_config", "published_names", "to_model_names", "wrap", "wrap_from_artifact",
]
