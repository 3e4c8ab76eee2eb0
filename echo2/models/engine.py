"""Rollout engines: turn (policy version, prompts, sampling settings) into completions.

Contract (API.md, ``echo2.models.engine``): for every sampled token the engine reports
``log_softmax(logits / T)[token]`` in float32, with top-p NOT applied, so the learner's
teacher-forced recompute at the same temperature matches within ~1e-5 in fp32 and the hub can
check a node's reported behaviour log-probs.  ``T == 0`` means greedy decoding; its log-probs are
then reported at ``T = 1`` (what ``modelspec.teacher_forced_batch``, the one teacher-forced
implementation, computes for T == 0). A hub only dispatches ``top_p == 1`` (its config refuses
truncated sampling), so the reported log-probs are those of the distribution sampled from.
The eos token is included in ``token_ids`` (with its log-prob) so the learner trains on stopping.
Generation is deterministic for a (version, prompts, settings, seed) on one machine.

Engines are blocking; callers run them through ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from echo2.protocol.errors import ManifestError
from echo2.protocol.messages import Completion

from . import lora
from . import spec as modelspec
from .engine_api import Engine, EngineError, Interrupted, validate_request

__all__ = ["Engine", "EngineError", "TransformersEngine", "check_state_dict", "select_engine", "validate_request"]

log = logging.getLogger(__name__)


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """ManifestError unless ``state_dict`` has exactly the model's names and shapes."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ManifestError(
            f"state dict does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for k, want in expected.items():
        got = state_dict[k]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ManifestError(f"tensor {k}: shape {shape}, model needs {tuple(want.shape)}")
        if got.is_floating_point() != want.is_floating_point():
            raise ManifestError(f"tensor {k}: dtype {got.dtype} does not fit {want.dtype}")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TransformersEngine:
    """Plain-PyTorch sampler over a ``transformers`` causal LM (CPU or a single GPU).

    One batched forward per generated token over all prompts x group_size rows, left padded,
    with a KV cache; the model is built once and later versions are loaded in place.  Not
    thread-safe: the caller serialises ``load_version`` and ``generate`` (one worker thread).
    """

    name = "transformers"

    def __init__(self, device: str = "auto", dtype: torch.dtype = torch.float32) -> None:
        self.device = _resolve_device(device)
        self.dtype = dtype
        self.version: int | None = None
        self.model: Any = None
        self.model_config_json: str | None = None
        self.tokenizer: modelspec.TokenizerHandle | None = None
        self._artifacts: dict[str, bytes] = {}
        self._adapter: bytes | None = None
        self._vocab_size = 0
        self._cache_kw = "past_key_values"
        self._has_logits_to_keep = False
        # checked between generated tokens: True stops the call (Interrupted), e.g. a node whose
        # owner's preferences paused it hands its task back at once instead of finishing it
        self.interrupt: Callable[[], bool] | None = None

    @property
    def engine_version(self) -> str:
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}"

    # ------------------------------------------------------------------ loading
    def load_version(
        self,
        version: int,
        model_config_json: str,
        artifacts: dict[str, bytes],
        state_dict: dict[str, torch.Tensor],
    ) -> None:
        # Everything is prepared first and committed at the end, so a refused version leaves the
        # engine serving the previous one.
        tokenizer = self.tokenizer
        if tokenizer is None or artifacts != self._artifacts:
            tokenizer = modelspec.load_tokenizer(artifacts)
        model = self.model
        adapter = artifacts.get(lora.ADAPTER_CONFIG)  # a LoRA version: base + adapter (lora.py)
        rebuilt = model is None or model_config_json != self.model_config_json or adapter != self._adapter
        if rebuilt:
            model = modelspec.model_from_config(model_config_json, dtype=self.dtype)
            if adapter is not None:
                # peft injects the adapter layers into the model itself and sampling runs them
                # unmerged, the computation the learner and the hub's verifier make: measured on
                # the tiny model after 3 steps, 4.8e-7 from the verifier's recompute (merged:
                # 9.5e-7, as good); unmerged was chosen because a new version then only loads
                # tensors, where merging would need the unmerged base kept (a second copy)
                try:
                    model = lora.wrap_from_artifact(model, adapter)
                except ValueError as exc:
                    raise ManifestError(f"version {version}: {exc}") from None
            model = model.to(self.device)
        state_dict = lora.to_model_names(model, state_dict)
        # Checked before touching the weights: load_state_dict copies what matches before it
        # raises, which would leave a half-loaded model behind.
        check_state_dict(model, state_dict)
        model.load_state_dict(state_dict, strict=True)
        if rebuilt:
            params = inspect.signature(model.forward).parameters
            # transformers 5.24 renamed the forward kwarg past_key_values -> cache.
            self._cache_kw = "cache" if "cache" in params else "past_key_values"
            self._has_logits_to_keep = "logits_to_keep" in params
            self._vocab_size = int(model.config.vocab_size)
            self.model = model
            self.model_config_json = model_config_json
            self._adapter = adapter
        model.eval()
        self.tokenizer = tokenizer
        self._artifacts = dict(artifacts)
        self.version = version
        log.info("engine loaded version %d on %s", version, self.device)

    # ------------------------------------------------------------------ sampling
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        kw: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            "use_cache": True,
        }
        if cache is not None:
            kw[self._cache_kw] = cache
        if self._has_logits_to_keep:
            kw["logits_to_keep"] = 1
        return self.model(**kw)

    @staticmethod
    def _cache_of(out: Any) -> Any:
        c = getattr(out, "cache", None)
        return c if c is not None else getattr(out, "past_key_values", None)

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Completion]:
        if self.model is None or self.tokenizer is None:
            raise EngineError("no policy version loaded")
        validate_request(prompts, group_size, max_new_tokens, temperature, top_p, self._vocab_size)
        with torch.inference_mode():
            return self._generate(prompts, group_size, max_new_tokens, temperature, top_p, seed)

    def _generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Completion]:
        assert self.tokenizer is not None
        dev = self.device
        rows = [i for i in range(len(prompts)) for _ in range(group_size)]
        b = len(rows)
        plen = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_id
        ids = torch.full((b, plen), pad, dtype=torch.long)
        mask = torch.zeros((b, plen), dtype=torch.long)
        for r, pi in enumerate(rows):
            p = prompts[pi]
            ids[r, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, plen - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        stop = torch.tensor(sorted(self.tokenizer.stop_ids), dtype=torch.long, device=dev)

        gen = torch.Generator(device=dev)
        gen.manual_seed(int(seed))
        greedy = temperature <= 0.0
        t = 1.0 if greedy else float(temperature)

        out = self._forward(ids, mask, pos, None)
        cache = self._cache_of(out)
        logits = out.logits[:, -1, :].float()
        next_pos = pos[:, -1:] + 1
        tokens = torch.empty((b, max_new_tokens), dtype=torch.long, device=dev)
        logps = torch.empty((b, max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)
        ones = torch.ones((b, 1), dtype=mask.dtype, device=dev)
        steps = 0
        for step in range(max_new_tokens):
            if self.interrupt is not None and self.interrupt():
                raise Interrupted(f"stopped after {step} of {max_new_tokens} tokens")
            lp = torch.log_softmax(logits / t, dim=-1)
            if greedy:
                tok = logits.argmax(dim=-1)
            else:
                tok = self._sample(lp, top_p, gen)
            # Finished rows keep running (one batched forward is cheaper than reshaping the cache)
            # but emit pad, which is never reported.
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            tokens[:, step] = tok
            logps[:, step] = lp.gather(1, tok[:, None])[:, 0]
            is_stop = torch.isin(tok, stop) & ~done
            lengths = torch.where(is_stop, torch.full_like(lengths, step + 1), lengths)
            done = done | is_stop
            steps = step + 1
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            mask = torch.cat([mask, ones], dim=1)
            out = self._forward(tok[:, None], mask, next_pos, cache)
            cache = self._cache_of(out)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        tok_l = tokens[:, :steps].cpu().tolist()
        lp_l = logps[:, :steps].cpu().tolist()
        len_l = lengths.cpu().tolist()
        done_l = done.cpu().tolist()
        result: list[Completion] = []
        for r, pi in enumerate(rows):
            n = min(int(len_l[r]), steps)
            # -0.0 / tiny positive rounding is clamped: the schema requires logprob <= 0.
            lps = [min(float(x), 0.0) for x in lp_l[r][:n]]
            result.append(
                Completion(
                    prompt_index=pi,
                    token_ids=[int(x) for x in tok_l[r][:n]],
                    logprobs=lps,
                    finish_reason="stop" if done_l[r] else "length",
                )
            )
        return result

    @staticmethod
    def _sample(lp: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
        probs = lp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sp.cumsum(-1) - sp) >= top_p
            sp = sp.masked_fill(drop, 0.0)
            choice = torch.multinomial(sp, 1, generator=gen)
            return si.gather(1, choice)[:, 0]
        return torch.multinomial(probs, 1, generator=gen)[:, 0]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def select_engine(name: str = "auto", *, device: str = "auto", dtype: torch.dtype | None = None) -> Engine:
    """Build an engine: "transformers", "vllm", or "auto" (vLLM when importable and a GPU is present)."""
    if name == "auto":
        name = "vllm" if vllm_available() and torch.cuda.is_available() else "transformers"
    if name == "transformers":
        return TransformersEngine(device=device, dtype=dtype or torch.float32)
    if name == "vllm":
        from .engine_vllm import VLLMEngine

        return VLLMEngine(dtype=dtype or torch.bfloat16)
    raise ValueError(f"unknown engine {name!r} (auto, transformers or vllm)")
