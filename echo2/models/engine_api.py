"""What every rollout engine shares: the ``Engine`` interface, its error, and the request checks.

Its own module so that ``engine`` (transformers, and the factory) and ``engine_vllm`` both import
it without importing each other.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from echo2.protocol.errors import MeaningError
from echo2.protocol.messages import Completion


class EngineError(MeaningError):
    """The engine cannot run this task (no model loaded, token out of vocabulary, too long)."""

    code = "engine"


class Interrupted(EngineError):
    """The caller asked the engine to stop (the node paused by its owner's preferences)."""

    code = "interrupted"


@runtime_checkable
class Engine(Protocol):
    name: str
    version: int | None

    def load_version(
        self,
        version: int,
        model_config_json: str,
        artifacts: dict[str, bytes],
        state_dict: dict[str, torch.Tensor],
    ) -> None: ...

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Completion]: ...


def validate_request(
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    vocab_size: int,
) -> None:
    """Engine-side checks a schema cannot do (the Task schema already bounds sizes)."""
    if not prompts:
        raise EngineError("no prompts")
    if group_size < 1 or max_new_tokens < 1:
        raise EngineError("group_size and max_new_tokens must be >= 1")
    if not (temperature >= 0.0) or not (0.0 < top_p <= 1.0):
        raise EngineError(f"bad sampling settings temperature={temperature} top_p={top_p}")
    for i, p in enumerate(prompts):
        if not p:
            raise EngineError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise EngineError(f"prompt {i} has a token id outside the vocabulary (size {vocab_size})")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an engine failure means "too much at once" (a smaller batch may work): Python's
    MemoryError, torch's OutOfMemoryError (CUDA), and the CPU allocator's RuntimeError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)[:2000].lower()
        return "not enough memory" in text or "out of memory" in text or "failed to allocate" in text
    return False
