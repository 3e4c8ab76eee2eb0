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
from .grpo import LOSS_TYPES, Normaliser, batch_advantages, grpo_loss
from .rows import Group, Sample

logger = logging.getLogger(__name__)


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
    ) -> tuple[Tensor, Tensor]:
        """Teacher-forced log-probs of each row's completion: ``([B, Lc] logp, [B, Lc] mask)``,
        computed in ``dtype`` (the learner's compute dtype unless given) by
        :func:`echo2.models.spec.teacher_forced_batch`, the one implementation."""
        return modelspec.teacher_forced_batch(
            model, [(list(p), list(c)) for p, c in rows], pad_id=self.pad_id, temperature=self.temperature,
            dtype=dtype or self.dtype, device=self.device,
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
        v_before = self.version
        rows: list[tuple[list[int], list[int]]] = []
        behav: list[list[float]] = []
        advs: list[float] = []
        active: list[bool] = []
        sound_rows: list[bool] = []
        rewards: list[float] = []
        versions: list[int] = []
        nodes: list[str] = []
        zero_groups = masked_trunc = bad_rows = 0
        kept = [g for g in groups if g.samples]
        group_advs = batch_advantages(
            [torch.tensor([float(s.reward) for s in g.samples], dtype=torch.float64) for g in kept], self.scale_rewards
        )
        for g, a in zip(kept, group_advs, strict=True):
            if bool((a == 0).all()):
                zero_groups += 1
            for s, adv in zip(g.samples, a.tolist(), strict=True):
                if len(s.token_ids) != len(s.logprobs):
                    raise ValueError("sample has token_ids and logprobs of different lengths")
                sound = logprob_problem(s.logprobs) is None
                if not sound:
                    bad_rows += 1
                    logger.warning("learner: row from %s has unsound behaviour log-probs; left out", s.node_id)
                truncated = self.mask_truncated_completions and s.finish_reason == "length"
                masked_trunc += int(truncated)
                sound_rows.append(sound)
                rows.append((list(g.prompt_ids), list(s.token_ids)))
                # an unsound row's log-probs never reach a tensor: NaN * 0 is still NaN
                behav.append([float(x) for x in s.logprobs] if sound else [0.0] * len(s.logprobs))
                advs.append(float(adv))
                active.append(sound and not truncated and adv != 0.0 and bool(s.token_ids))
                rewards.append(float(s.reward))
                versions.append(int(s.version))
                nodes.append(s.node_id)
        if not rows:
            raise ValueError("step() needs at least one sample")
        total_tokens = sum(len(c) for _, c in rows)
        norm = Normaliser(
            self.loss_type, sum(active), sum(len(c) for (_, c), on in zip(rows, active, strict=True) if on),
            self.max_completion_length,
        )
        # Rows that cannot teach (a group whose rewards are all equal, masked, unsound) add nothing to
        # the gradient, so they go in micro-batches of their own that run forward only, without
        # autograd (their log-probs still feed the mismatch figures): on SmolLM2-135M a full-model
        # backward costs 30-120 s a step here, and most groups of a hard task have zero advantage.
        on_idx = [i for i, a in enumerate(active) if a]
        off_idx = [i for i, a in enumerate(active) if not a]
        chunks = [[on_idx[j] for j in c] for c in self._micro_batches([rows[i] for i in on_idx])]
        chunks += [[off_idx[j] for j in c] for c in self._micro_batches([rows[i] for i in off_idx])]

        acc: dict[str, float] = {"loss": 0.0, "pg": 0.0, "ratio": 0.0, "clip": 0.0, "klr": 0.0, "klb": 0.0, "isw": 0.0}
        ratio_max = 0.0
        grad_norm = 0.0
        mismatch: list[tuple[int, float]] = []  # (row index, max abs diff)
        old: list[Tensor | None] = [None] * len(chunks)  # π_old: the first pass's log-probs, detached
        ref: list[Tensor | None] = [None] * len(chunks)  # the frozen reference's, computed once
        for it in range(self.num_iterations if norm.rows else 1):
            self.optimizer.zero_grad(set_to_none=True)
            for ci, chunk in enumerate(chunks):
                mb_rows = [rows[i] for i in chunk]
                if sum(len(c) for _, c in mb_rows) == 0:
                    continue
                teaches = any(active[i] for i in chunk)
                if not teaches and it > 0:
                    continue
                with torch.enable_grad() if teaches else torch.no_grad():
                    logp_new, mask = self._batch_logprobs(self.model, mb_rows)
                if it == 0:
                    old[ci] = logp_new.detach()
                lb = torch.zeros_like(logp_new)
                for j, i in enumerate(chunk):
                    if behav[i]:
                        lb[j, : len(behav[i])] = torch.tensor(behav[i], dtype=lb.dtype)
                on = torch.tensor([active[i] for i in chunk], dtype=mask.dtype, device=self.device)
                if it == 0 and self.ref_model is not None and teaches:
                    with torch.no_grad():
                        ref[ci], _ = self._batch_logprobs(self.ref_model, mb_rows)
                logp_ref = ref[ci]
                adv_t = torch.tensor([advs[i] for i in chunk], dtype=torch.float32, device=self.device)
                loss, st = grpo_loss(
                    logp_new, lb, adv_t, mask * on.unsqueeze(-1), clip_eps=self.clip_eps, kl_coef=self.kl_coef,
                    logp_ref=logp_ref, use_importance_ratio=self.use_importance_ratio, epsilon_high=self.epsilon_high,
                    logp_old=old[ci], max_is_ratio=self.max_is_ratio, norm=norm,
                )
                # the normaliser is the whole step's: micro-batch losses add up to the batch loss
                if teaches:
                    loss.backward()
                if it > 0:
                    continue
                w = st.tokens / max(norm.tokens, 1)  # token share, for the token-mean statistics
                acc["loss"] += float(loss.detach())
                acc["pg"] += st.pg_loss
                acc["ratio"] += st.ratio_mean * w
                acc["clip"] += st.clip_frac * w
                acc["klr"] += st.kl_ref * w
                acc["klb"] += st.kl_behaviour * w
                acc["isw"] += st.is_weight_mean * w
                ratio_max = max(ratio_max, st.ratio_max if st.tokens else 0.0)
                with torch.no_grad():
                    diff = ((logp_new.detach() - lb).abs() * mask).max(dim=1).values
                    for j, i in enumerate(chunk):
                        if versions[i] == v_before and rows[i][1] and sound_rows[i]:
                            mismatch.append((i, float(diff[j])))
            gn = self._clip_grads()
            grad_norm = gn if it == 0 else grad_norm
            if not norm.rows:
                pass  # nothing could teach: a zero gradient would still move AdamW's state
            elif math.isfinite(gn):
                self.optimizer.step()
            else:
                logger.warning("learner: non-finite grad norm at version %d pass %d; pass skipped", v_before, it)
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

        by_node: dict[str, float] = {}
        for i, d in mismatch:
            by_node[nodes[i]] = max(by_node.get(nodes[i], 0.0), d)
        rt = torch.tensor(rewards, dtype=torch.float64)
        stats = StepStats(
            version=self.version,
            loss=acc["loss"],
            pg_loss=acc["pg"],
            reward_mean=float(rt.mean()),
            reward_std=float(rt.std(unbiased=False)),
            ratio_mean=acc["ratio"] if norm.tokens else 1.0,
            ratio_max=ratio_max,
            clip_frac=acc["clip"],
            kl_ref=acc["klr"],
            kl_behaviour=acc["klb"],
            grad_norm=grad_norm,
            tokens=total_tokens,
            sequences=len(rows),
            groups=len(groups),
            zero_adv_groups=zero_groups,
            staleness_mean=float(sum(v_before - v for v in versions) / len(versions)),
            mismatch_rows=len(mismatch),
            mismatch_mean=float(sum(d for _, d in mismatch) / len(mismatch)) if mismatch else 0.0,
            mismatch_max=max((d for _, d in mismatch), default=0.0),
            active_rows=norm.rows,
            masked_truncated=masked_trunc,
            bad_rows=bad_rows,
            is_weight_mean=acc["isw"] if norm.tokens else 1.0,
            mismatch_by_node=by_node,
            seconds=time.perf_counter() - t0,
        )
        return stats

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.max_grad_norm and self.max_grad_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        norms = [p.grad.detach().norm() for p in params if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

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


__all__ = ["Group", "Learner", "Sample", "StepStats"]
