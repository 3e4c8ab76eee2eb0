"""Training rows: a prompt's group of completions with hub-computed rewards, and their stored form.

Pure data: intake builds them from a Result, the training room trains on them, and the store keeps
their encoding until a checkpoint covers the step that trained them (so a restart loses none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from echo2.protocol import canonical
from echo2.protocol.errors import MeaningError


@dataclass(slots=True)
class Sample:
    """One completion of a prompt as reported by a node, with its hub-computed reward.

    Slotted, and a packed result's ids an ``array('i')``: each result's samples wait in the buffer
    until a step takes them, and every container among them is walked by each younger garbage
    collection meanwhile (at 10,000 nodes, ~650 results/s: gen-0 and gen-1 collections were ~90 us
    of the hub's CPU a result and up to 10 ms of its loop at once; `echo2 bench intake`, trio
    instrument). The instance's ``__dict__`` was one more container to walk, and a list of ids
    one whose walk visits each of its ints; an array's walk visits none."""

    # the completion's token ids: a list, or for a packed result an array('i') over the received
    # int32 bytes (one copy, no int objects; a reward function gets them as lists, rewards.py)
    token_ids: Sequence[int]
    # behaviour log-probs, one per token, from the node: a list, or for a packed result an
    # array('f') over the received float32 bytes (a copy, not 3.6 M float objects: tolist cost 0.145 s)
    logprobs: Sequence[float]
    reward: float
    version: int  # policy version the node sampled with
    node_id: str = ""  # who produced it (for per-node verification figures)
    finish_reason: str = "stop"
    # each reward function's own value (before weighting) by function name; a function that
    # returned None (does not apply) is absent: TRL's rewards/<name>/mean and /std
    reward_parts: dict[str, float] = field(default_factory=dict)
    # the int32 ids and float32 log-probs as a PackedResult carried them (None for a list-form
    # Result): what the store keeps, as received
    packed: tuple[bytes | memoryview, bytes | memoryview] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> tuple[Any, ...]:
        # a memoryview does not pickle (the learner's ranks get their groups pickled,
        # distributed.py): the packed arrays travel as bytes, the views stay the hub's
        packed = None if self.packed is None else (bytes(self.packed[0]), bytes(self.packed[1]))
        return (self.token_ids, self.logprobs, self.reward, self.version, self.node_id, self.finish_reason,
                self.reward_parts, packed)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self.token_ids, self.logprobs, self.reward, self.version, self.node_id, self.finish_reason,
         self.reward_parts, self.packed) = state


def _stored_arrays(s: Sample) -> dict[str, Any]:
    """A sample's tokens and log-probs as the store keeps them: packed little-endian bytes (ids
    int32; log-probs float32 as received, or float64 for a list-form result, exact either way).
    Canonically encoding them as 3 M msgpack numbers cost 7.5 s for a 36 MB result (cProfile)."""
    if s.packed is not None:
        return {"token_ids": s.packed[0], "logprobs": s.packed[1], "lp_dtype": "f4"}
    return {"token_ids": np.asarray(s.token_ids, dtype="<i4").tobytes(),
            "logprobs": np.asarray(s.logprobs, dtype="<f8").tobytes(), "lp_dtype": "f8"}


def _sample_from_store(s: dict[str, Any]) -> Sample:
    if isinstance(s.get("token_ids"), bytes):  # packed (issue 20); older payloads hold lists
        kw = dict(s)
        lp_dtype = kw.pop("lp_dtype")
        kw["token_ids"] = np.frombuffer(kw["token_ids"], dtype="<i4").tolist()
        kw["logprobs"] = np.frombuffer(kw["logprobs"], dtype="<f4" if lp_dtype == "f4" else "<f8").tolist()
        return Sample(**kw)
    return Sample(**s)


@dataclass(slots=True)
class Group:
    """A prompt and its G completions (the GRPO group)."""

    prompt_ids: list[int]
    samples: list[Sample]


def encode_groups(groups: list[Group]) -> bytes:
    """Accepted rollouts as stored for a restart (hub-computed rewards included): exactly
    ``canonical.encode`` of the stored form (:func:`encode_groups_generic`), built with its maps
    already in canonical key order and its values checked here, so msgpack packs it at once: the
    generic walk over every sample's map was 0.16 ms of a small result's ~1 ms (cProfile)."""
    try:
        return msgpack.packb([_stored_group(g) for g in groups], use_bin_type=True, use_single_float=False)
    except (ValueError, OverflowError, TypeError, UnicodeEncodeError):
        return encode_groups_generic(groups)  # an odd value: the generic encoder says what is wrong


def _finite(x: Any) -> float:
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"non-finite float {v!r}")
    return v


def _stored_group(g: Group) -> dict[str, Any]:
    ids = g.prompt_ids
    if type(ids) is not list or (ids and set(map(type, ids)) != {int}):
        raise TypeError("prompt ids")
    return {"prompt_ids": ids, "samples": [_stored_sample(s) for s in g.samples]}


def _stored_sample(s: Sample) -> dict[str, Any]:
    arr = _stored_arrays(s)
    if (type(s.node_id) is not str or type(s.finish_reason) is not str or type(s.version) is not int
            or any(type(k) is not str for k in s.reward_parts)):
        raise TypeError("sample fields")
    # keys in canonical (UTF-8 byte) order, as canonical.encode sorts them
    return {"finish_reason": s.finish_reason, "logprobs": bytes(arr["logprobs"]), "lp_dtype": arr["lp_dtype"],
            "node_id": s.node_id, "reward": _finite(s.reward),
            "reward_parts": {k: _finite(s.reward_parts[k]) for k in sorted(s.reward_parts)},
            "token_ids": bytes(arr["token_ids"]), "version": s.version}


def encode_groups_generic(groups: list[Group]) -> bytes:
    """The stored form through the generic canonical encoder (what :func:`encode_groups` equals)."""
    return canonical.encode(
        [
            {
                "prompt_ids": list(g.prompt_ids),
                "samples": [
                    {
                        **_stored_arrays(s),
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
        return [Group(prompt_ids=list(g["prompt_ids"]), samples=[_sample_from_store(s) for s in g["samples"]])
                for g in raw]
    except (TypeError, KeyError, ValueError) as exc:
        raise MeaningError(f"stored result payload is malformed: {exc}") from exc
