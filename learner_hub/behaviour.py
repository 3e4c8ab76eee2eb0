"""What a behaviour log-prob (a node's report for one sampled token) must be to enter training.

One rule, shared by intake (which punishes a node reporting otherwise) and the learner (which
drops such a row should one reach it anyway), so the two cannot drift. Pure; intake's form works
on a numpy array in one pass (a per-element Python loop cost 2.1 s on a 3.1 M-token result).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Lowest credible log-prob of a sampled token. A token is drawn with probability e^lp; at a
#: floor of -1e4 that is e^-10000, which no sampler ever draws (a 49k vocabulary at T = 0.1 gives
#: well above -1e3). Below it a report is a lie or a bug, and clamping it instead would turn it
#: into a ratio large enough to dominate, or silently skip, a step.
LOGPROB_FLOOR = -1e4


def logprob_problem(logprobs: Sequence[float]) -> str | None:
    """Why these behaviour log-probs cannot be trained on, or None when they can."""
    for i, lp in enumerate(logprobs):
        if not math.isfinite(lp):
            return f"log-prob {i} is {lp!r} (must be finite)"
        if lp < LOGPROB_FLOOR:
            return f"log-prob {i} is {lp!r}, below the floor {LOGPROB_FLOOR:g}"
        if lp > 0.0:
            return f"log-prob {i} is {lp!r} (must be <= 0)"
    return None


def logprob_array_problem(logprobs: np.ndarray) -> str | None:
    """:func:`logprob_problem` over a numpy array, with whole-array checks: the same verdict and
    message (the first bad element's)."""
    lps = np.asarray(logprobs, dtype=np.float64)
    bad = ~((lps >= LOGPROB_FLOOR) & (lps <= 0.0))  # NaN fails both comparisons
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    msg = logprob_problem([float(lps[i])])
    assert msg is not None
    return msg.replace("log-prob 0 ", f"log-prob {i} ", 1)
