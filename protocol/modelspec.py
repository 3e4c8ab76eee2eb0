"""Model specification shared by the learner hub and the nodes: the pure part.

A policy version travels as (model_config JSON text, small artifacts such as tokenizer.json, state
dict). This module holds what needs no model library: the byte tokenizer's special tokens, the
tiny config used when no model hub is reachable (brief section 10), canonical config text, and the
checks on a received config. Turning these into a tokenizer and a ``transformers`` model is
``echo2.models.spec``.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ManifestError

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Artifacts a node may receive inside a manifest; mirrors the Manifest limits in API.md.
MAX_ARTIFACT_BYTES = 8 * 1024 * 1024
MAX_ARTIFACTS = 16
# Config keys that describe a saved checkpoint rather than the architecture; they trip some
# transformers versions, so they are dropped before a config is used.
CHECKPOINT_ONLY_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "quantization_config")
# Small text files of an HF model directory worth shipping (weights travel as the state dict).
LOCAL_ARTIFACT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)
# Architectures we know to be plain causal LMs that work with our sampling loop; anything else is
# refused rather than instantiated from a (signed, but still remote) config.
SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral", "gpt2", "phi3", "gemma", "gemma2"})


def tiny_config(
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    vocab: int = BYTE_VOCAB_SIZE,
    max_pos: int = 256,
    arch: str = "qwen2",
) -> dict[str, Any]:
    """A small causal-LM config dict (HF config.json keys) for the byte tokenizer.

    hidden 128 / 2 layers is ~0.5 M parameters, the size the brief measured GRPO learning at.
    """
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"tiny_config: unsupported arch {arch!r} (qwen2 or llama)")
    if hidden % heads:
        raise ValueError("tiny_config: hidden must be divisible by heads")
    return {
        "model_type": arch,
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "use_cache": True,
    }


def config_json(config: dict[str, Any]) -> str:
    """Canonical JSON text of a config dict (sorted keys, so equal configs give equal text)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def artifacts_for(config: dict[str, Any], tokenizer_json_bytes: bytes) -> tuple[str, dict[str, bytes]]:
    """(model_config JSON text, artifacts) to put in a manifest."""
    return config_json(config), {"tokenizer.json": bytes(tokenizer_json_bytes)}


def parse_model_config(model_config_json: str) -> dict[str, Any]:
    """Parse and sanity-check a model config JSON text; ManifestError when unusable."""
    try:
        d = json.loads(model_config_json)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"model_config is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ManifestError("model_config must be a JSON object")
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ManifestError(f"model_config: unsupported model_type {mt!r}")
    return d
