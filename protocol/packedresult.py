"""``PackedResult``: a Result whose token ids and log-probs travel as packed little-endian arrays.

Why (issue 20, item 3, measured with ``echo2 bench intake --big-result-MB 36`` under cProfile): a
33 MB list-of-numbers :class:`~echo2.protocol.messages.Result` (3.1 M tokens) cost the hub ~9 s of
process CPU, almost all of it per-token Python: re-encoding the rows for SQLite (canonical
``_normalize``, ~7.5 s profiled), the log-prob check (``logprob_problem``, 2.1 s), the vocabulary
and stop-token scans (2.3 s), float lists for the store (0.65 s). Here each completion's token ids
are int32 LE bytes and its log-probs float32 LE bytes; the receiver checks them by length and with
numpy range checks over the whole array (C loops), never per element in Python.

The envelope rules are unchanged: the signature covers the bytes as received, checked before the
payload is decoded; msgspec reads each ``bytes`` field as one copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .schema import INT64_MAX, Bytes, Float, Int, List, Message, Nested, PeerId, Record, Spec, Str, _fail

# the same bounds as messages.py (not imported: messages.py registers this module's type)
_TOKEN_ID_MAX = 2**31 - 1
_MAX_NEW_TOKENS = 8192
_MAX_COMPLETIONS = 256 * 64
_MiB = 1024 * 1024

IDS_DTYPE = np.dtype("<i4")
LOGPROBS_DTYPE = np.dtype("<f4")
_ARRAY_MAX = _MAX_NEW_TOKENS * 4  # bytes of one completion's ids (or log-probs)


def token_array(data: bytes) -> np.ndarray:
    """The int32 token ids packed in ``data`` (a read-only view, no copy)."""
    return np.frombuffer(data, dtype=IDS_DTYPE)


def logprob_array(data: bytes) -> np.ndarray:
    """The float32 log-probs packed in ``data`` (a read-only view, no copy)."""
    return np.frombuffer(data, dtype=LOGPROBS_DTYPE)


def pack_ids(ids: object) -> bytes:
    """Token ids (any int sequence or array) as int32 LE bytes; ValueError outside int32's range."""
    a = np.asarray(ids, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError("token ids must be one-dimensional")
    if a.size and (int(a.min()) < 0 or int(a.max()) > _TOKEN_ID_MAX):
        raise ValueError("token id outside [0, 2**31 - 1]")
    return a.astype(IDS_DTYPE).tobytes()


def pack_logprobs(lps: object) -> bytes:
    """Log-probs (any float sequence or array) as float32 LE bytes."""
    a = np.asarray(lps, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError("log-probs must be one-dimensional")
    return a.astype(LOGPROBS_DTYPE).tobytes()


@dataclass(frozen=True)
class PackedCompletion(Record):
    SPEC: ClassVar[dict[str, Spec]] = {
        "prompt_index": Int(0, INT64_MAX),
        "token_ids": Bytes(max_len=_ARRAY_MAX),
        "logprobs": Bytes(max_len=_ARRAY_MAX),
        "finish_reason": Str(16, choices=("stop", "length")),
    }
    prompt_index: int
    token_ids: bytes  # int32 little-endian, one per token
    logprobs: bytes  # float32 little-endian, one per token
    finish_reason: str

    def _check_fields(self, path: str) -> None:
        # lengths first (nothing is read before its size is known), then whole-array checks
        if len(self.token_ids) % 4:
            raise _fail(f"{path}.token_ids", f"{len(self.token_ids)} bytes is not a whole number of int32 ids")
        if len(self.logprobs) != len(self.token_ids):
            raise _fail(path, f"{len(self.logprobs)} bytes of logprobs for {len(self.token_ids)} bytes of "
                              "token_ids (must match: 4 bytes each)")
        ids = token_array(self.token_ids)
        if ids.size and int(ids.min()) < 0:
            raise _fail(f"{path}.token_ids", f"token id {int(ids.min())} is negative")
        lps = logprob_array(self.logprobs)
        bad = ~(lps <= 0.0)  # NaN compares false: caught here too
        if bad.any():
            i = int(np.argmax(bad))
            raise _fail(f"{path}.logprobs", f"log-prob {i} is {float(lps[i])!r} (must be finite and <= 0)")
        if not np.isfinite(lps).all():
            i = int(np.argmax(~np.isfinite(lps)))
            raise _fail(f"{path}.logprobs", f"log-prob {i} is {float(lps[i])!r} (must be finite)")

    @classmethod
    def fast_check_all(cls, comps: list[PackedCompletion]) -> bool:
        """Whether every one of ``comps`` passes :meth:`_check_fields`, checked over the whole
        list at once (the fast decoder's vouching step, :mod:`.fastdecode`): one join and four
        reductions for a result instead of ~10 numpy calls per completion (67 -> ~10 us for a
        small result of 8 x 64 tokens). Only vouches: on False the reference path names the fault."""
        for c in comps:
            n = len(c.token_ids)
            if n & 3 or len(c.logprobs) != n:
                return False
        ids = token_array(b"".join([c.token_ids for c in comps]))
        if ids.size and int(ids.min()) < 0:
            return False
        lps = logprob_array(b"".join([c.logprobs for c in comps]))
        if not lps.size:
            return True
        # a NaN makes min and max NaN (not finite); -inf makes min not finite; +inf or > 0 fails max
        return math.isfinite(float(lps.min())) and float(lps.max()) <= 0.0

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) // 4


@dataclass(frozen=True)
class PackedResult(Message):
    """Result, second wire form (its own type and domain, so a v1 Result reads as before): the
    same fields, completions packed."""

    TYPE: ClassVar[str] = "packed_result"
    MAX_SIZE: ClassVar[int] = 64 * _MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "task_id": Str(64),
        "task_hash": Bytes(size=32),
        "node_id": PeerId(),
        "version": Int(0, INT64_MAX),
        "completions": List(Nested(PackedCompletion), _MAX_COMPLETIONS),
        "started_at": Float(),
        "gen_seconds": Float(0.0),
        "tokens": Int(0, INT64_MAX),
    }
    task_id: str
    task_hash: bytes
    node_id: str
    version: int
    completions: list[PackedCompletion]
    started_at: float
    gen_seconds: float
    tokens: int

