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
# transformers versions, so the hub drops them from a local model's config before publishing it.
CHECKPOINT_ONLY_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "quantization_config")
# The harmless part of those: a received config may carry them, and they are dropped on parsing.
# (quantization_config is not among them: a node refuses it, since it selects loader code.)
METADATA_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "_name_or_path"})
# The only keys a received config may have (A8): the architecture of the supported model types,
# nothing that selects code. Left out on purpose: attn_implementation and every other *_implementation
# (transformers resolves a hub repo name there through its kernels loader, which fetches code),
# auto_map (remote code), quantization_config, return_dict / output_* (change what forward
# returns), add_cross_attention, and the label/task keys a causal LM does not use.
ALLOWED_CONFIG_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "original_max_position_embeddings", "rms_norm_eps", "layer_norm_epsilon", "hidden_act", "hidden_activation",
    "activation_function", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "attention_dropout", "initializer_range",
    "pretraining_tp", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "use_bidirectional_attention",
    "pad_token_id", "bos_token_id", "eos_token_id", "use_cache",
    # gpt2's names for the same things
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx", "attn_pdrop", "embd_pdrop", "resid_pdrop",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "summary_type",
    "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
})
# The model classes of SUPPORTED_MODEL_TYPES: vLLM picks its model class by `architectures`.
SUPPORTED_ARCHITECTURES = frozenset({
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel",
    "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
})
# Bounds on the sizes a config may state (A7), far above any model a node could hold: checked
# before a model library sees the config, since building even the config object allocates per
# layer (transformers makes a list of num_hidden_layers layer types). Whether the model fits is
# the node's own check against its memory budget, afterwards.
MAX_CONFIG_DIMS: dict[str, int] = {
    "num_hidden_layers": 512, "n_layer": 512,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "n_head": 1024,
    "hidden_size": 65536, "n_embd": 65536, "head_dim": 4096,
    "intermediate_size": 1 << 20, "n_inner": 1 << 20,
    "vocab_size": 1 << 21,
    "max_position_embeddings": 1 << 22, "original_max_position_embeddings": 1 << 22,
    "n_positions": 1 << 22, "n_ctx": 1 << 22, "sliding_window": 1 << 22, "max_window_layers": 512,
}
MAX_CONFIG_LIST = 512  # layer_types, architectures, eos_token_id lists
#: The attention every model is built with: a kernel shipped inside torch, never one named by a config.
BUILTIN_ATTENTION = "sdpa"
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
    unknown = sorted(k for k in d if k not in ALLOWED_CONFIG_KEYS and k not in METADATA_KEYS)
    if unknown:
        shown = ", ".join(repr(k[:64]) for k in unknown[:5])
        raise ManifestError(f"model_config: key {shown} is not allowed (a node accepts only architecture keys)")
    for key, cap in MAX_CONFIG_DIMS.items():
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= cap):
            raise ManifestError(f"model_config: {key} = {str(v)[:40]} is outside 1..{cap}")
    for key, v in d.items():
        if isinstance(v, (list, dict)) and len(v) > MAX_CONFIG_LIST:
            raise ManifestError(f"model_config: {key} has {len(v)} entries (at most {MAX_CONFIG_LIST})")
    arch = d.get("architectures")
    if arch is not None and (
        not isinstance(arch, list) or not arch or any(a not in SUPPORTED_ARCHITECTURES for a in arch)
    ):
        raise ManifestError(f"model_config: unsupported architectures {str(arch)[:120]}")
    return {k: v for k, v in d.items() if k not in METADATA_KEYS}


def allowed_part(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the config without keys a node would refuse, the keys dropped): what a hub publishes of a
    local model's config.json, whose extra keys (e.g. SmolLM2's is_llama_config) change nothing."""
    kept = {k: v for k, v in config.items() if k in ALLOWED_CONFIG_KEYS}
    return kept, sorted(k for k in config if k not in ALLOWED_CONFIG_KEYS)
