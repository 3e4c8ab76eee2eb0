"""The GRPO learner: holds the policy and its optimizer, turns groups of rollouts into steps.

Numerics, chosen so the learner's log-probs are comparable with what nodes report:

* Master weights and AdamW state are always float32. ``dtype`` is the *compute* dtype: with
  ``torch.bfloat16`` the forward pass runs under CPU/CUDA autocast; with float32 it runs plainly.
* Log-probs are ``log_softmax(logits / temperature)`` of each completion token, computed in
  float32 from a teacher-forced forward pass over ``prompt + completion``. Rows are *right*
  padded and use plain position ids ``0..n-1``: under a causal mask a real token never attends to
  a later padding position, so each row's log-probs equal those of an unpadded forward pass.
* The model stays in eval mode (no dropout), so the recompute is deterministic and matches the
  sampler at the same version; gradients flow regardless of the mode.
* Loss: :func:`echo2.learner_hub.grpo.grpo_loss` with a global token mean over all completion
  tokens of the step; micro-batches are weighted by their token share so accumulating them gives
  exactly the full-batch gradient.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from echo2.models import lora
from echo2.models import spec as modelspec

from .behaviour import logprob_problem
from .grpo import LOG_RATIO_CLAMP, LOSS_TYPES, Normaliser, batch_advantages, grpo_loss
from .rows import Group, Sample

logger = logging.getLogger(__name__)


def grad_sq_sum(grads: Sequence[Tensor], chunk: int = 1 << 24) -> Tensor:
    """Σ g² over ``grads`` (a DTensor's local shard only), accumulated in float64. Why: on
    SmolLM2-135M torch's float32 ``clip_grad_norm_`` was 1.7e-5 off the exact norm, more than the
    1e-5 by which the sharded learner (whose shards sum differently) must agree with this one.
    ``vector_norm(dtype=float64)`` is exact to 1e-13 and took 0.37 s for 108 M values here
    (float32: 0.04 s; ``.double().pow(2).sum()``: 2.7 s); ``chunk`` bounds any float64 copy."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        flat = (g.to_local() if isinstance(g, DTensor) else g).detach().reshape(-1)
        for part in flat.split(chunk):
            total += torch.linalg.vector_norm(part, dtype=torch.float64).square()
    return total


class _TokenizerLike(Protocol):
    pad_id: int
    eos_id: int


@dataclass
class StepStats:
    version: int  # learner version after the step
    loss: float
    pg_loss: float
    reward_mean: float
    reward_std: float
    ratio_mean: float
    ratio_max: float
    clip_frac: float
    kl_ref: float
    kl_behaviour: float
    grad_norm: float
    tokens: int
    sequences: int
    groups: int
    zero_adv_groups: int  # groups whose rewards were all equal (no learning signal)
    staleness_mean: float  # mean (learner version before the step - behaviour version)
    # Verification: rows sampled with exactly the learner's pre-step version; per row the max
    # |logp_learner - logp_node| over its tokens, then the mean and max of those.
    mismatch_rows: int
    mismatch_mean: float
    mismatch_max: float
    active_rows: int = 0  # rows that entered the loss (non-zero advantage, not masked, sound log-probs)
    masked_truncated: int = 0  # rows left out by mask_truncated_completions
    bad_rows: int = 0  # rows left out for a non-finite or below-floor behaviour log-prob
    is_weight_mean: float = 1.0  # mean truncated importance weight (max_is_ratio > 0)
    mismatch_by_node: dict[str, float] = field(default_factory=dict)  # max per node id
    seconds: float = 0.0
    # TRL's figures (trainmetrics.py names them). clip_low + clip_high = clip_frac.
    clip_low: float = 0.0
    clip_high: float = 0.0
    entropy: float = 0.0  # mean entropy of the policy at each completion token of the step (before it)
    # the learner's log-probs before the step against the nodes' (every sound row, stale ones
    # included): exp(logp_learner - logp_node) per token, and |logp_learner - logp_node|
    is_ratio_min: float = 1.0
    is_ratio_mean: float = 1.0
    is_ratio_max: float = 1.0
    logp_diff_mean: float = 0.0
    logp_diff_max: float = 0.0
    input_tokens: int = 0  # prompt + completion tokens of the step's rows (TRL's num_tokens counts these)
    staleness_max: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StepPlan:
    """One step's rows and what the loss needs of them, computed before any model work."""

    v_before: int
    groups: int
    rows: list[tuple[list[int], list[int]]] = field(default_factory=list)
    behav: list[list[float]] = field(default_factory=list)
    advs: list[float] = field(default_factory=list)
    active: list[bool] = field(default_factory=list)
    sound: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    zero_groups: int = 0
    masked_trunc: int = 0
    bad_rows: int = 0
    norm: Normaliser = field(default_factory=Normaliser)


@dataclass
class PassResult:
    """What the passes over some micro-batches add to the step's figures (additive over ranks)."""

    acc: dict[str, float] = field(
        default_factory=lambda: {"loss": 0.0, "pg": 0.0, "ratio": 0.0, "clip": 0.0, "klr": 0.0, "klb": 0.0, "isw": 0.0,
                                 "clip_low": 0.0, "clip_high": 0.0,
                                 # sums and token counts of the first pass's figures over all rows
                                 "ent": 0.0, "ent_tok": 0.0, "isr": 0.0, "lpd": 0.0, "samp_tok": 0.0}
    )
    ratio_max: float = 0.0
    is_ratio_min: float = math.inf
    is_ratio_max: float = 0.0
    logp_diff_max: float = 0.0
    grad_norm: float = 0.0
    mismatch: list[tuple[int, float]] = field(default_factory=list)  # (row index, max |Δlogp|)


@torch.no_grad()
def _first_pass_figures(res: PassResult, logp_old: Tensor, lb: Tensor, mask: Tensor, sound: Tensor, entropy: Tensor | None) -> None:
    """Add one micro-batch's monitoring figures to ``res`` (no effect on the loss): the policy's
    entropy over its completion tokens, and TRL's sampling figures between the learner's
    log-probs before the step (``logp_old``) and the node's (``lb``) over the tokens of sound
    rows: the importance ratio ``exp(logp_old - lb)`` and ``|logp_old - lb|``. For a row made
    with the current version they show the sampler's numerical mismatch; for a stale row, how
    far the policy has moved since, which the clipped ratio corrects (BRIEF section 7)."""
    if entropy is not None:
        res.acc["ent"] += float((entropy * mask).sum())
        res.acc["ent_tok"] += float(mask.sum())
    m = mask * sound.unsqueeze(-1)
    sel = m > 0
    if not bool(sel.any()):
        return
    d = (logp_old - lb)[sel]
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    res.acc["isr"] += float(ratio.sum())
    res.acc["lpd"] += float(d.abs().sum())
    res.acc["samp_tok"] += float(sel.sum())
    res.is_ratio_min = min(res.is_ratio_min, float(ratio.min()))
    res.is_ratio_max = max(res.is_ratio_max, float(ratio.max()))
    res.logp_diff_max = max(res.logp_diff_max, float(d.abs().max()))


class Learner:
    """GRPO learner over a ``transformers`` causal LM.

    ``tokenizer_handle`` needs ``pad_id`` (used for padding only; padded positions are masked).
    ``version`` starts at 0 (the initial weights) and grows by one per :meth:`step`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_handle: _TokenizerLike,
        *,
        lr: float = 3e-4,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        temperature: float = 1.0,
        dtype: torch.dtype = torch.float32,
        publish_dtype: torch.dtype = torch.float32,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        use_importance_ratio: bool = True,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        micro_batch_tokens: int = 16384,
        device: str | torch.device | None = None,
        ref_model: torch.nn.Module | None = None,
        epsilon_high: float = 0.0,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        max_is_ratio: float = 0.0,
        mask_truncated_completions: bool = False,
        num_iterations: int = 1,
        max_completion_length: int = 0,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported compute dtype {dtype}")
        if publish_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported publish dtype {publish_dtype}")
        if kl_coef and ref_model is None:
            raise ValueError("kl_coef > 0 needs a ref_model")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {loss_type!r}")
        if loss_type == "dr_grpo" and max_completion_length < 1:
            raise ValueError("loss_type dr_grpo needs max_completion_length (the hub's max_new_tokens)")
        if scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
        if num_iterations < 1:
            raise ValueError("num_iterations must be >= 1")
        # The update itself is deterministic; the seed is recorded (checkpoints) for the caller's
        # sampling, and the global torch RNG is left alone.
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.eval()
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None
        self.tok = tokenizer_handle
        self.pad_id = int(tokenizer_handle.pad_id)
        self.lr = lr
        self.clip_eps = clip_eps  # TRL's epsilon
        self.epsilon_high = epsilon_high if epsilon_high > 0 else clip_eps
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.max_is_ratio = max_is_ratio
        self.mask_truncated_completions = mask_truncated_completions
        self.num_iterations = num_iterations
        self.max_completion_length = max_completion_length
        self.kl_coef = kl_coef
        self.temperature = float(temperature) if temperature > 0 else 1.0
        self.dtype = dtype
        self.publish_dtype = publish_dtype
        self.max_grad_norm = max_grad_norm
        self.seed = seed
        self.use_importance_ratio = use_importance_ratio
        self.micro_batch_tokens = micro_batch_tokens
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
        )
        self.version = 0

    # ------------------------------------------------------------------ log-probs

    def _batch_logprobs(
        self,
        model: torch.nn.Module,
        rows: Sequence[tuple[Sequence[int], Sequence[int]]],
        dtype: torch.dtype | None = None,
        entropy_out: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Teacher-forced log-probs of each row's completion: ``([B, Lc] logp, [B, Lc] mask)``,
        computed in ``dtype`` (the learner's compute dtype unless given) by
        :func:`echo2.models.spec.teacher_forced_batch`, the one implementation (which also
        appends the per-token entropy to ``entropy_out`` when given)."""
        return modelspec.teacher_forced_batch(
            model, [(list(p), list(c)) for p, c in rows], pad_id=self.pad_id, temperature=self.temperature,
            dtype=dtype or self.dtype, device=self.device, entropy_out=entropy_out,
        )

    @torch.no_grad()
    def recompute_logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """The learner's current log-probs of one completion (for verification)."""
        if not completion_ids:
            return []
        logp, _ = self._batch_logprobs(self.model, [(prompt_ids, completion_ids)])
        return [float(x) for x in logp[0].tolist()]

    @torch.no_grad()
    def recompute_logprobs_batch(
        self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        out: list[list[float]] = []
        for chunk in self._micro_batches(rows):
            logp, _ = self._batch_logprobs(self.model, [rows[i] for i in chunk])
            for j, i in enumerate(chunk):
                out.append([float(x) for x in logp[j, : len(rows[i][1])].tolist()])
        return out

    @torch.no_grad()
    def reference_logprobs(
        self, model: torch.nn.Module, rows: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        """Log-probs of ``rows`` under ``model`` (on the learner's device) computed in float32,
        whatever the learner's compute dtype: the verification reference (see verify.py)."""
        out: list[list[float]] = []
        for chunk in self._micro_batches(rows):
            logp, _ = self._batch_logprobs(model, [rows[i] for i in chunk], dtype=torch.float32)
            for j, i in enumerate(chunk):
                out.append([float(x) for x in logp[j, : len(rows[i][1])].tolist()])
        return out

    def _micro_batches(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Iterator[list[int]]:
        """Indices in micro-batches whose padded size stays under ``micro_batch_tokens``."""
        cur: list[int] = []
        width = 0
        for i, (p, c) in enumerate(rows):
            w = max(width, len(p) + len(c))
            if cur and w * (len(cur) + 1) > self.micro_batch_tokens:
                yield cur
                cur, w = [], len(p) + len(c)
            cur.append(i)
            width = w
        if cur:
            yield cur

    # ------------------------------------------------------------------ training

    def step(self, groups: Sequence[Group]) -> StepStats:
        """One GRPO step over ``groups``: ``num_iterations`` optimiser passes (see grpo.py for the
        loss). Rows that cannot teach (zero advantage, masked truncation, unsound behaviour
        log-probs) enter no normaliser; a step where none can moves no weight (AdamW's momentum
        and decay included) but still counts as a version."""
        t0 = time.perf_counter()
        plan = self.plan(groups)
        part = self.run_passes(plan, self.plan_chunks(plan))
        self.version += 1
        return self.step_stats(plan, part, time.perf_counter() - t0)

    def plan(self, groups: Sequence[Group]) -> StepPlan:
        """The step's rows, advantages and global normaliser (no model work). The sharded learner
        (distributed.py) computes it once on rank 0 and hands each rank its slice of it."""
        p = StepPlan(v_before=self.version, groups=len(groups))
        kept = [g for g in groups if g.samples]
        group_advs = batch_advantages(
            [torch.tensor([float(s.reward) for s in g.samples], dtype=torch.float64) for g in kept], self.scale_rewards
        )
        for g, a in zip(kept, group_advs, strict=True):
            if bool((a == 0).all()):
                p.zero_groups += 1
            for s, adv in zip(g.samples, a.tolist(), strict=True):
                if len(s.token_ids) != len(s.logprobs):
                    raise ValueError("sample has token_ids and logprobs of different lengths")
                sound = logprob_problem(s.logprobs) is None
                if not sound:
                    p.bad_rows += 1
                    logger.warning("learner: row from %s has unsound behaviour log-probs; left out", s.node_id)
                truncated = self.mask_truncated_completions and s.finish_reason == "length"
                p.masked_trunc += int(truncated)
                p.sound.append(sound)
                p.rows.append((list(g.prompt_ids), list(s.token_ids)))
                # an unsound row's log-probs never reach a tensor: NaN * 0 is still NaN
                p.behav.append([float(x) for x in s.logprobs] if sound else [0.0] * len(s.logprobs))
                p.advs.append(float(adv))
                p.active.append(sound and not truncated and adv != 0.0 and bool(s.token_ids))
                p.rewards.append(float(s.reward))
                p.versions.append(int(s.version))
                p.nodes.append(s.node_id)
        if not p.rows:
            raise ValueError("step() needs at least one sample")
        p.norm = Normaliser(
            self.loss_type, sum(p.active), sum(len(c) for (_, c), on in zip(p.rows, p.active, strict=True) if on),
            self.max_completion_length,
        )
        return p

    def plan_chunks(self, plan: StepPlan) -> tuple[list[list[int]], list[list[int]]]:
        """(teaching micro-batches, forward-only micro-batches) as row indices of ``plan``.

        Rows that cannot teach (a group whose rewards are all equal, masked, unsound) add nothing
        to the gradient, so they go in micro-batches of their own that run forward only, without
        autograd (their log-probs still feed the mismatch figures): on SmolLM2-135M a full-model
        backward costs 30-120 s a step here, and most groups of a hard task have zero advantage.
        Rows with an empty completion add nothing at all and enter no micro-batch (every rank of
        a sharded learner must run the same number of forwards, so none may be skipped later)."""
        rows = plan.rows
        on_idx = [i for i, a in enumerate(plan.active) if a]
        off_idx = [i for i, a in enumerate(plan.active) if not a and rows[i][1]]
        on = [[on_idx[j] for j in c] for c in self._micro_batches([rows[i] for i in on_idx])]
        off = [[off_idx[j] for j in c] for c in self._micro_batches([rows[i] for i in off_idx])]
        return on, off

    def run_passes(self, plan: StepPlan, chunks: tuple[list[list[int]], list[list[int]]]) -> PassResult:
        """The ``num_iterations`` optimiser passes over ``chunks`` (teaching, forward-only): the one
        place the GRPO loss meets the model. An empty chunk is a placeholder that runs a forward
        (and, when teaching, a backward) of one padding row with zero weight: a rank of the
        sharded learner with fewer micro-batches than another runs those so that every rank
        joins the same FSDP collectives."""
        rows, behav, active, norm = plan.rows, plan.behav, plan.active, plan.norm
        work = [(c, True) for c in chunks[0]] + [(c, False) for c in chunks[1]]
        res = PassResult()
        old: list[Tensor | None] = [None] * len(work)  # π_old: the first pass's log-probs, detached
        ref: list[Tensor | None] = [None] * len(work)  # the frozen reference's, computed once
        dummy = [([self.pad_id], [self.pad_id])]
        for it in range(self.num_iterations if norm.rows else 1):
            self.optimizer.zero_grad(set_to_none=True)
            for ci, (chunk, teaches) in enumerate(work):
                if not teaches and it > 0:
                    continue
                if not chunk:
                    with torch.enable_grad() if teaches else torch.no_grad():
                        logp_pad, _ = self._batch_logprobs(self.model, dummy)
                    if teaches:
                        if it == 0 and self.ref_model is not None:
                            with torch.no_grad():
                                self._batch_logprobs(self.ref_model, dummy)
                        (logp_pad * 0.0).sum().backward()
                    continue
                mb_rows = [rows[i] for i in chunk]
                ent: list[Tensor] | None = [] if it == 0 else None
                with torch.enable_grad() if teaches else torch.no_grad():
                    logp_new, mask = self._batch_logprobs(self.model, mb_rows, entropy_out=ent)
                lb = torch.zeros_like(logp_new)
                for j, i in enumerate(chunk):
                    if behav[i]:
                        lb[j, : len(behav[i])] = torch.tensor(behav[i], dtype=lb.dtype)
                if it == 0:
                    old[ci] = logp_new.detach()
                    sound = torch.tensor([plan.sound[i] for i in chunk], dtype=mask.dtype, device=self.device)
                    _first_pass_figures(res, logp_new.detach(), lb, mask, sound, ent[0] if ent else None)
                on = torch.tensor([active[i] for i in chunk], dtype=mask.dtype, device=self.device)
                if it == 0 and self.ref_model is not None and teaches:
                    with torch.no_grad():
                        ref[ci], _ = self._batch_logprobs(self.ref_model, mb_rows)
                adv_t = torch.tensor([plan.advs[i] for i in chunk], dtype=torch.float32, device=self.device)
                loss, st = grpo_loss(
                    logp_new, lb, adv_t, mask * on.unsqueeze(-1), clip_eps=self.clip_eps, kl_coef=self.kl_coef,
                    logp_ref=ref[ci], use_importance_ratio=self.use_importance_ratio, epsilon_high=self.epsilon_high,
                    logp_old=old[ci], max_is_ratio=self.max_is_ratio, norm=norm,
                )
                # the normaliser is the whole step's: micro-batch losses add up to the batch loss
                if teaches:
                    loss.backward()
                if it > 0:
                    continue
                w = st.tokens / max(norm.tokens, 1)  # token share, for the token-mean statistics
                acc = res.acc
                acc["loss"] += float(loss.detach())
                acc["pg"] += st.pg_loss
                acc["ratio"] += st.ratio_mean * w
                acc["clip"] += st.clip_frac * w
                acc["klr"] += st.kl_ref * w
                acc["klb"] += st.kl_behaviour * w
                acc["isw"] += st.is_weight_mean * w
                acc["clip_low"] += st.clip_low * w
                acc["clip_high"] += st.clip_high * w
                res.ratio_max = max(res.ratio_max, st.ratio_max if st.tokens else 0.0)
                with torch.no_grad():
                    diff = ((logp_new.detach() - lb).abs() * mask).max(dim=1).values
                    for j, i in enumerate(chunk):
                        if plan.versions[i] == plan.v_before and rows[i][1] and plan.sound[i]:
                            res.mismatch.append((i, float(diff[j])))
            gn = self._clip_grads()
            res.grad_norm = gn if it == 0 else res.grad_norm
            if not norm.rows:
                pass  # nothing could teach: a zero gradient would still move AdamW's state
            elif math.isfinite(gn):
                self.optimizer.step()
            else:
                logger.warning("learner: non-finite grad norm at version %d pass %d; pass skipped", plan.v_before, it)
        self.optimizer.zero_grad(set_to_none=True)
        return res

    def step_stats(self, plan: StepPlan, part: PassResult, seconds: float) -> StepStats:
        """The step's figures from its plan and its (merged) pass results; ``self.version`` is the
        version after the step."""
        acc, mismatch, norm = part.acc, part.mismatch, plan.norm
        by_node: dict[str, float] = {}
        for i, d in mismatch:
            by_node[plan.nodes[i]] = max(by_node.get(plan.nodes[i], 0.0), d)
        rt = torch.tensor(plan.rewards, dtype=torch.float64)
        versions = plan.versions
        return StepStats(
            version=self.version,
            loss=acc["loss"],
            pg_loss=acc["pg"],
            reward_mean=float(rt.mean()),
            reward_std=float(rt.std(unbiased=False)),
            ratio_mean=acc["ratio"] if norm.tokens else 1.0,
            ratio_max=part.ratio_max,
            clip_frac=acc["clip"],
            kl_ref=acc["klr"],
            kl_behaviour=acc["klb"],
            grad_norm=part.grad_norm,
            tokens=sum(len(c) for _, c in plan.rows),
            sequences=len(plan.rows),
            groups=plan.groups,
            zero_adv_groups=plan.zero_groups,
            staleness_mean=float(sum(plan.v_before - v for v in versions) / len(versions)),
            mismatch_rows=len(mismatch),
            mismatch_mean=float(sum(d for _, d in mismatch) / len(mismatch)) if mismatch else 0.0,
            mismatch_max=max((d for _, d in mismatch), default=0.0),
            active_rows=norm.rows,
            masked_truncated=plan.masked_trunc,
            bad_rows=plan.bad_rows,
            is_weight_mean=acc["isw"] if norm.tokens else 1.0,
            mismatch_by_node=by_node,
            seconds=seconds,
            clip_low=acc["clip_low"],
            clip_high=acc["clip_high"],
            entropy=acc["ent"] / acc["ent_tok"] if acc["ent_tok"] else 0.0,
            is_ratio_min=part.is_ratio_min if acc["samp_tok"] else 1.0,
            is_ratio_mean=acc["isr"] / acc["samp_tok"] if acc["samp_tok"] else 1.0,
            is_ratio_max=part.is_ratio_max if acc["samp_tok"] else 1.0,
            logp_diff_mean=acc["lpd"] / acc["samp_tok"] if acc["samp_tok"] else 0.0,
            logp_diff_max=part.logp_diff_max,
            input_tokens=sum(len(p) + len(c) for p, c in plan.rows),
            staleness_max=max(plan.v_before - v for v in versions),
        )

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = grad_sq_sum([p.grad for p in params if p.grad is not None]).sqrt().float()
        if self.max_grad_norm and self.max_grad_norm > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
        return float(total)

    # ------------------------------------------------------------------ publishing / checkpoints

    @torch.no_grad()
    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """Contiguous CPU tensors in ``publish_dtype`` (floating tensors only are cast), under
        publication names (a LoRA model's base and adapter tensors: ``echo2.models.lora``)."""
        out: dict[str, Tensor] = {}
        for k, v in lora.published_names(self.model.state_dict()).items():
            t = v.detach()
            if t.is_floating_point():
                t = t.to(self.publish_dtype)
            out[k] = t.to("cpu").contiguous().clone()
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to resume training: weights (fp32), optimizer state, version."""
        return {
            "version": self.version,
            "model": {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()},
            # deep copy: state_dict() hands out the live moment tensors, which the next step mutates
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "seed": self.seed,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])


__all__ = ["Group", "Learner", "PassResult", "Sample", "StepPlan", "StepStats", "grad_sq_sum"]
