"""Verification before training (BRIEF section 7; issue 15, A5).

Every group a batch takes from the buffer is checked *before* the step: a row's reported
log-probs are recomputed under the exact weights its node was sent (the published version it
names, as the publisher keeps it) and must match within the hub's tolerance. A node with one
failing row has all its groups of the batch dropped (one forged row proves it lies), so a forged
row never reaches the loss; the training room reports the node's worst difference and the fleet
punishes it as before.

Which rows are checked: by default all of them. With ``fraction`` < 1 each node gets
``ceil(fraction * its rows)`` rows (at least one) drawn by the hub's secret RNG
(``random.SystemRandom``, seeded by the OS, unseen by any node) over *all* its rows of the
batch, so the order in which a node lists its samples, or which it puts first, decides nothing.

The reference works with any publication dtype: the published tensors (bf16 by default) are
loaded into a float32 shadow model and the log-probs recomputed in float32. Measured on the tiny
test models (hidden 64/128/256, 2-4 layers, 32 completions of 16 tokens, temperature 1): a node
whose engine computes in float32 on the bf16-published weights (the CPU transformers engine)
differs from this reference by at most 9.5e-7 per token, far inside the default tolerance of
1e-3; an engine that computes in bf16 itself (vLLM on a GPU) differs by up to 7.7e-3, so a
swarm of those needs ``logprob_tolerance`` of about 1e-2 (a forged shift of 0.5 is still 50x
that). Comparing against the learner's own float32 master weights instead would differ by the
bf16 rounding of every weight, which is why that check was switched off for bf16 publication.

A version the publisher no longer keeps cannot be checked: its groups are dropped, unblamed.
HoldsVersion is a dispatch hint only: a node that claims a version it does not hold can return
only rows that fail this check at that version, so the lie costs it its reputation and never
costs the hub a training row (see the issue-15 notes in the report).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from echo2.models import lora, statedict

from .learner import Learner
from .rows import Group

if TYPE_CHECKING:
    from .distributed import ShardedLearner


@dataclass
class Checked:
    """The outcome of checking one batch's groups (indices into the list checked)."""

    kept: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)  # a node of theirs failed the check
    unverifiable: list[int] = field(default_factory=list)  # their version's weights are gone
    worst: dict[str, float] = field(default_factory=dict)  # node -> worst |Δlogprob| checked
    failed: set[str] = field(default_factory=set)  # nodes over the tolerance
    rows_checked: int = 0


def pick_rows(groups: Sequence[Group], fraction: float, rng: random.Random) -> list[tuple[int, int]]:
    """(group, sample) indices to check: all rows when ``fraction`` >= 1, else per node
    ``ceil(fraction * n)`` of its ``n`` rows (at least one) drawn by ``rng`` over all of them."""
    every = [(gi, si) for gi, g in enumerate(groups) for si, s in enumerate(g.samples) if s.token_ids]
    if fraction >= 1.0:
        return every
    by_node: dict[str, list[tuple[int, int]]] = {}
    for gi, si in every:
        by_node.setdefault(groups[gi].samples[si].node_id, []).append((gi, si))
    out: list[tuple[int, int]] = []
    for rows in by_node.values():
        k = min(len(rows), max(1, math.ceil(fraction * len(rows))))
        out.extend(rng.sample(rows, k))
    return sorted(out)


class Verifier:
    """Checks groups against the published versions. ``weights(v)`` gives version ``v``'s
    published state dict (None when no longer kept). Runs in a worker thread."""

    def __init__(
        self,
        learner: Learner | ShardedLearner,
        weights: Callable[[int], dict[str, torch.Tensor] | None],
        tolerance: float,
        *,
        fraction: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self.learner = learner
        self.weights = weights
        self.tolerance = tolerance
        self.fraction = fraction
        self.rng = rng if rng is not None else random.SystemRandom()
        self._shadow: Any = None  # float32 model holding the published weights of one version
        self._shadow_version: int | None = None
        self.rows_checked = 0
        self.rows_rejected = 0  # rows of dropped groups
        self.rows_unverifiable = 0

    def _model_for(self, version: int) -> torch.nn.Module | None:
        if self._shadow_version == version:
            return self._shadow
        sd = self.weights(version)
        if sd is None:
            return None
        if self._shadow is None:
            self._shadow = copy.deepcopy(self.learner.model).eval().requires_grad_(False)
        # a LoRA version's names are publication names: base + adapter (echo2.models.lora); the
        # shadow is a copy of the learner's inner model, adapters included, so strict loading
        # checks that the version holds exactly base + this adapter
        sd = lora.to_model_names(self._shadow, sd)
        self._shadow.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in sd.items()})
        self._shadow_version = version
        return self._shadow

    def check(self, groups: Sequence[Group]) -> Checked:
        out = Checked()
        picked = pick_rows(groups, self.fraction, self.rng)
        gone: set[int] = set()
        by_version: dict[int, list[tuple[int, int]]] = {}
        for gi, si in picked:
            by_version.setdefault(groups[gi].samples[si].version, []).append((gi, si))
        for version in sorted(by_version):
            rows = by_version[version]
            model = self._model_for(version)
            if model is None:
                gone.update(gi for gi, _ in rows)
                continue
            ref = self.learner.reference_logprobs(model, [(groups[gi].prompt_ids, groups[gi].samples[si].token_ids) for gi, si in rows])
            for (gi, si), r in zip(rows, ref, strict=True):
                smp = groups[gi].samples[si]
                if len(smp.logprobs) != len(r):
                    diff = math.inf
                else:
                    diff = max((abs(a - b) for a, b in zip(r, smp.logprobs, strict=True)), default=0.0)
                    if math.isnan(diff) or any(math.isnan(b) for b in smp.logprobs):
                        diff = math.inf  # NaN compares false with any tolerance
                out.worst[smp.node_id] = max(out.worst.get(smp.node_id, 0.0), diff)
                if not diff <= self.tolerance:
                    out.failed.add(smp.node_id)
            out.rows_checked += len(rows)
        for gi, g in enumerate(groups):
            if any(s.node_id in out.failed for s in g.samples):
                out.rejected.append(gi)
                self.rows_rejected += len(g.samples)
            elif gi in gone:
                out.unverifiable.append(gi)
                self.rows_unverifiable += len(g.samples)
            else:
                out.kept.append(gi)
        self.rows_checked += out.rows_checked
        return out


def published_weights(publisher: Any) -> Callable[[int], dict[str, torch.Tensor] | None]:
    """``weights(v)`` over a PolicyPublisher's kept versions (the bytes nodes were sent)."""

    def weights(version: int) -> dict[str, torch.Tensor] | None:
        pub = publisher.recent.get(version)
        if pub is None or not pub.has_data:
            return None
        sd: dict[str, torch.Tensor] = statedict.assemble(pub.packed.manifest, pub.packed.raw_chunks)
        return sd

    return weights
