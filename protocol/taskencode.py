"""A Task the hub built, written straight as canonical msgpack (:func:`.messages.task_payload`).

Its map is built already in canonical (UTF-8 byte) key order with each value checked to be of the
plain type the canonical encoder passes through unchanged, so msgpack packs it at once, as
``rows.encode_groups`` does for stored rows: the generic walk (``to_wire``, then canonical's copy
and sort of every map) cost 10.5 us a task against 4.5 here, once per heartbeat and per result
(`echo2 bench intake`, cProfile of the heartbeat phase: ~6% of the hub's CPU a heartbeat). Any
value of another type makes :func:`pack` answer None, and the caller uses the generic encoder,
which says what is wrong: the bytes are always exactly ``canonical.encode(task.to_wire())``.
"""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING

import msgpack

from .canonical import INT_MAX, INT_MIN

if TYPE_CHECKING:
    from .messages import Task


def pack(task: Task) -> bytes | None:
    """The canonical bytes of ``task``, or None where the generic encoder must decide."""
    fast = task_map(task)
    if fast is None:
        return None
    try:
        return msgpack.packb(fast, use_bin_type=True, use_single_float=False)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return None  # a str without a UTF-8 form, say


def _wire_float(v: object) -> float | None:
    """``v`` as Float.wire puts it on the wire when it is a finite int or float, else None."""
    if type(v) is int or type(v) is float:
        f = float(v)  # type: ignore[arg-type]  # (narrowed by the line above)
        return f if math.isfinite(f) else None
    return None


_INT_TYPE = {int}
#: the Task fields written, in canonical key order (messages.py checks them against Task.SPEC at import)
KEYS = ("deadline", "group_size", "max_new_tokens", "max_version_lag", "min_version", "node_id", "prompts",
        "seed", "task_id", "temperature", "top_p")


def task_map(task: Task) -> dict[str, object] | None:
    """The Task's wire map in canonical (UTF-8 byte) key order, or None where a value is not of
    the plain type the fast path takes (the generic encoder then decides)."""
    ints = (task.group_size, task.max_new_tokens, task.max_version_lag, task.min_version, task.seed)
    deadline, temperature, top_p = _wire_float(task.deadline), _wire_float(task.temperature), _wire_float(task.top_p)
    if (set(map(type, ints)) != _INT_TYPE or min(ints) < INT_MIN or max(ints) > INT_MAX or deadline is None
            or temperature is None or top_p is None or type(task.node_id) is not str or type(task.task_id) is not str):
        return None
    prompts = []
    try:
        for p in task.prompts:
            if type(p) is not list and type(p) is not tuple:
                return None
            # int64 ids or bools, else TypeError / OverflowError (the generic encoder then decides):
            # one C loop, ~3x cheaper than checking each id's type and the list's min and max
            array("q", p)
            prompts.append(list(p))
    except (TypeError, OverflowError):
        return None
    return {
        "deadline": deadline,
        "group_size": task.group_size,
        "max_new_tokens": task.max_new_tokens,
        "max_version_lag": task.max_version_lag,
        "min_version": task.min_version,
        "node_id": task.node_id,
        "prompts": prompts,
        "seed": task.seed,
        "task_id": task.task_id,
        "temperature": temperature,
        "top_p": top_p,
    }
