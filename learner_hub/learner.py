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

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from .grpo import group_advantages, grpo_loss
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
    mismatch_by_node: dict[str, float] = field(default_factory=dict)  # max per node id
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


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
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported compute dtype {dtype}")
        if publish_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported publish dtype {publish_dtype}")
        if kl_coef and ref_model is None:
            raise ValueError("kl_coef > 0 needs a ref_model")
        # The update itself is deterministic; the seed is recorded (checkpoints) for the caller's
        # sampling, and the global torch RNG is left alone.
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.eval()
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None
        self.tok = tokenizer_handle
        self.pad_id = int(tokenizer_handle.pad_id)
        self.lr = lr
        self.clip_eps = clip_eps
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
        computed in ``dtype`` (the learner's compute dtype unless given)."""
        b = len(rows)
        lens = [len(p) + len(c) for p, c in rows]
        lc = max((len(c) for _, c in rows), default=0)
        width = max(lens)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        # Index of the logit that predicts completion token j of row i: len(prompt_i) - 1 + j.
        pred_pos = torch.zeros((b, max(lc, 1)), dtype=torch.long)
        targets = torch.full((b, max(lc, 1)), self.pad_id, dtype=torch.long)
        cmask = torch.zeros((b, max(lc, 1)), dtype=torch.float32)
        for i, (p, c) in enumerate(rows):
            if not p:
                raise ValueError("empty prompt")
            n = len(p) + len(c)
            ids[i, :n] = torch.tensor(list(p) + list(c), dtype=torch.long)
            attn[i, :n] = 1
            k = len(c)
            if k:
                pred_pos[i, :k] = torch.arange(len(p) - 1, len(p) - 1 + k)
                targets[i, :k] = torch.tensor(list(c), dtype=torch.long)
                cmask[i, :k] = 1.0
        pos = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(b, width)
        ids, attn, pos = ids.to(self.device), attn.to(self.device), pos.to(self.device)
        pred_pos, targets, cmask = pred_pos.to(self.device), targets.to(self.device), cmask.to(self.device)
        with _autocast(self.device, dtype or self.dtype):
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
        logits = out.logits
        # Only the completion positions are needed: gather them before the vocab-wide softmax so
        # a large-vocab model does not materialise [B, L, V] float32 twice.
        hidden = logits.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        scaled = hidden / self.temperature
        lse = torch.logsumexp(scaled, dim=-1)
        tok_logit = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        logp = (tok_logit - lse) * cmask
        return logp[:, :lc], cmask[:, :lc]

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
        t0 = time.perf_counter()
        v_before = self.version
        rows: list[tuple[list[int], list[int]]] = []
        behav: list[list[float]] = []
        advs: list[float] = []
        rewards: list[float] = []
        versions: list[int] = []
        nodes: list[str] = []
        zero_groups = 0
        for g in groups:
            if not g.samples:
                continue
            r = torch.tensor([float(s.reward) for s in g.samples], dtype=torch.float64)
            a = group_advantages(r)
            if bool((a == 0).all()):
                zero_groups += 1
            for s, adv in zip(g.samples, a.tolist(), strict=True):
                if len(s.token_ids) != len(s.logprobs):
                    raise ValueError("sample has token_ids and logprobs of different lengths")
                rows.append((list(g.prompt_ids), list(s.token_ids)))
                behav.append([float(x) for x in s.logprobs])
                advs.append(float(adv))
                rewards.append(float(s.reward))
                versions.append(int(s.version))
                nodes.append(s.node_id)
        if not rows:
            raise ValueError("step() needs at least one sample")
        total_tokens = sum(len(c) for _, c in rows)

        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {"loss": 0.0, "pg": 0.0, "ratio": 0.0, "clip": 0.0, "klr": 0.0, "klb": 0.0}
        ratio_max = 0.0
        mismatch: list[tuple[int, float]] = []  # (row index, max abs diff)
        for chunk in self._micro_batches(rows):
            mb_rows = [rows[i] for i in chunk]
            mb_tok = sum(len(c) for _, c in mb_rows)
            if mb_tok == 0:
                continue
            logp_new, mask = self._batch_logprobs(self.model, mb_rows)
            lb = torch.zeros_like(logp_new)
            for j, i in enumerate(chunk):
                if behav[i]:
                    lb[j, : len(behav[i])] = torch.tensor(behav[i], dtype=lb.dtype)
            logp_ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    logp_ref, _ = self._batch_logprobs(self.ref_model, mb_rows)
            adv_t = torch.tensor([advs[i] for i in chunk], dtype=torch.float32, device=self.device)
            loss, st = grpo_loss(
                logp_new,
                lb,
                adv_t,
                mask,
                clip_eps=self.clip_eps,
                kl_coef=self.kl_coef,
                logp_ref=logp_ref,
                use_importance_ratio=self.use_importance_ratio,
            )
            w = mb_tok / total_tokens  # token share: sum of micro-batch means == global token mean
            (loss * w).backward()
            acc["loss"] += float(loss.detach()) * w
            acc["pg"] += st.pg_loss * w
            acc["ratio"] += st.ratio_mean * w
            acc["clip"] += st.clip_frac * w
            acc["klr"] += st.kl_ref * w
            acc["klb"] += st.kl_behaviour * w
            ratio_max = max(ratio_max, st.ratio_max)
            with torch.no_grad():
                diff = ((logp_new.detach() - lb).abs() * mask).max(dim=1).values
                for j, i in enumerate(chunk):
                    if versions[i] == v_before and rows[i][1]:
                        mismatch.append((i, float(diff[j])))

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.max_grad_norm and self.max_grad_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            norms = [p.grad.detach().norm() for p in params if p.grad is not None]
            gn = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
        grad_norm = float(gn)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("learner: non-finite grad norm at version %d; step skipped", v_before)
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
            ratio_mean=acc["ratio"],
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
            mismatch_by_node=by_node,
            seconds=time.perf_counter() - t0,
        )
        return stats

    # ------------------------------------------------------------------ publishing / checkpoints

    @torch.no_grad()
    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """Contiguous CPU tensors in ``publish_dtype`` (floating tensors only are cast)."""
        out: dict[str, Tensor] = {}
        for k, v in self.model.state_dict().items():
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
