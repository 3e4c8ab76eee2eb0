"""Training rows: a prompt's group of completions with hub-computed rewards, and their stored form.

Pure data: intake builds them from a Result, the training room trains on them, and the store keeps
their encoding until a checkpoint covers the step that trained them (so a restart loses none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2.protocol import canonical
from echo2.protocol.errors import MeaningError


@dataclass
class Sample:
    """One completion of a prompt as reported by a node, with its hub-computed reward."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per token, from the node
    reward: float
    version: int  # policy version the node sampled with
    node_id: str = ""  # who produced it (for per-node verification figures)
    finish_reason: str = "stop"
    # each reward function's own value (before weighting) by function name; a function that
    # returned None (does not apply) is absent: TRL's rewards/<name>/mean and /std
    reward_parts: dict[str, float] = field(default_factory=dict)


@dataclass
class Group:
    """A prompt and its G completions (the GRPO group)."""

    prompt_ids: list[int]
    samples: list[Sample]


def encode_groups(groups: list[Group]) -> bytes:
    """Accepted rollouts as stored for a restart (hub-computed rewards included)."""
    return canonical.encode(
        [
            {
                "prompt_ids": list(g.prompt_ids),
                "samples": [
                    {
                        "token_ids": list(s.token_ids),
                        "logprobs": [float(x) for x in s.logprobs],
                        "reward": float(s.reward),
                        "version": int(s.version),
                        "node_id": s.node_id,
                        "finish_reason": s.finish_reason,
                        "reward_parts": {k: float(v) for k, v in s.reward_parts.items()},
                    }
                    for s in g.samples
                ],
            }
            for g in groups
        ]
    )


def decode_groups(payload: bytes) -> list[Group]:
    raw = canonical.decode(payload, max_size=1 << 30)
    try:
        return [Group(prompt_ids=list(g["prompt_ids"]), samples=[Sample(**s) for s in g["samples"]]) for g in raw]
    except (TypeError, KeyError) as exc:
        raise MeaningError(f"stored result payload is malformed: {exc}") from exc
