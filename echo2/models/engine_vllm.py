"""vLLM rollout engine for GPU nodes (optional extra ``echo2[vllm]``; imported lazily).

The engine is built once from a local model directory written from the manifest (config.json,
artifacts, model.safetensors); later versions with the same config are loaded in place without
restarting vLLM: the new weights are written over model.safetensors and every worker re-reads
them with ``llm.collective_rpc("reload_weights")`` (the pattern of vLLM's own RL example
https://docs.vllm.ai/en/latest/examples/rl/skip_loading_weights_in_engine_init/ ), falling back
to handing the tensors to the model's ``load_weights`` through ``LLM.apply_model`` (what TRL's
colocated GRPO mode does with ``model_runner.model.load_weights``).  The prefix cache is reset
afterwards, since cached KV blocks were computed with the old weights.

Log-probs: the engine is created with ``logprobs_mode="processed_logprobs"`` so the reported value
is the log-prob after temperature scaling, which equals ``log_softmax(logits / T)[token]`` when
``top_p == 1`` (the usual RL setting).  With ``top_p < 1`` vLLM's processed log-probs are
renormalised over the nucleus, which differs from the echo2 contract; the engine logs a warning.
A hub never asks for it: hub.toml refuses ``top_p < 1`` and ``top_k > 0`` at load (issue 16,
``config.check_sampling``), because the learner's ratio is of the untruncated distribution.
Each (prompt, sample) is its own request with a seed derived from the task seed, so generation is
reproducible for a seed (up to vLLM's batch-composition numerics).

LoRA versions (``adapter_config.json`` among the artifacts; ``echo2.models.lora``): the base goes
into model.safetensors as above, vLLM is built with ``enable_lora=True`` (``max_lora_rank`` the
smallest rank vLLM supports that holds the adapter's), and each version's adapter is written as a
peft directory (adapter_config.json + adapter_model.safetensors, peft's tensor names) and named
in every request by a ``LoRARequest`` with an id of its own, so vLLM never serves a cached older
adapter under a new version; the previous adapter is removed from the engine. vLLM applies the
adapter unmerged in the engine's dtype (bf16 here), so a hub verifying such nodes needs the
``logprob_tolerance`` of any bf16 engine (about 1e-2, verify.py). Written against vLLM's LoRA API
(``vllm.lora.request.LoRARequest``, ``LLM(enable_lora=..., max_lora_rank=..., max_loras=...)``);
tested only where a GPU is lent (tests/test_lora.py, marked gpu).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any

import torch

from echo2.fsutil import atomic_write_path
from echo2.protocol.errors import ManifestError
from echo2.protocol.messages import Completion

from . import lora
from . import spec as modelspec
from .engine_api import EngineError, validate_request

log = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15
#: ranks vLLM's LoRA kernels accept for max_lora_rank (vLLM's LoRAConfig check)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank ``r``."""
    for k in _VLLM_LORA_RANKS:
        if k >= r:
            return k
    raise ManifestError(f"LoRA rank {r} is above vLLM's largest supported rank {_VLLM_LORA_RANKS[-1]}")


def split_lora(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base under the plain model's names, adapter under peft's saved names) of a published LoRA
    version: ``~lora.model.layers.0.self_attn.q_proj.lora_A.default.weight`` becomes
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (what peft's
    save_pretrained writes and vLLM's LoRA loader reads)."""
    base: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if k.startswith(lora.ADAPTER_PREFIX):
            name = k[len(lora.ADAPTER_PREFIX):].replace(f".{lora.ADAPTER_NAME}.", ".")
            adapter["base_model.model." + name] = v
        else:
            base[k] = v
    return base, adapter


def derive_seed(seed: int, row: int) -> int:
    """Per-request seed: distinct for every (prompt, sample) row, fixed for a task seed."""
    return (int(seed) + (row + 1) * _SEED_MIX) % (2**63)


def _save_safetensors(state_dict: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    # clone() breaks storage sharing (tied embeddings), which safetensors refuses to write.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    atomic_write_path(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}), mode=0o644)


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        gpu_memory_utilization: float = 0.85,
        workdir: str | None = None,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        import vllm  # noqa: F401  (fail early, at construction, when the extra is missing)

        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.max_model_len = max_model_len
        self._tmp = tempfile.TemporaryDirectory(prefix="echo2-vllm-") if workdir is None else None
        self.workdir = workdir if workdir is not None else self._tmp.name  # type: ignore[union-attr]
        self.version: int | None = None
        self.llm: Any = None
        self.model_config_json: str | None = None
        self.tokenizer: modelspec.TokenizerHandle | None = None
        self._vocab_size = 0
        self._max_len = 0
        self._lora_rank = 0  # max_lora_rank vLLM was built with (0: built without LoRA)
        self._lora: Any = None  # the LoRARequest of the loaded version's adapter
        self._base: dict[str, torch.Tensor] | None = None  # base weights vLLM holds (LoRA mode)

    @property
    def engine_version(self) -> str:
        import vllm

        return f"vllm {vllm.__version__}"

    @property
    def model_dir(self) -> str:
        return os.path.join(self.workdir, "model")

    def _write_model_dir(self, model_config_json: str, artifacts: dict[str, bytes]) -> dict[str, Any]:
        cfg = modelspec.parse_model_config(model_config_json)
        os.makedirs(self.model_dir, exist_ok=True)
        for name, data in artifacts.items():
            # Artifact names come from the network: only plain file names are written.
            if os.path.basename(name) != name or name.startswith(".") or name == "config.json":
                raise ManifestError(f"artifact name {name!r} is not a plain file name")
            with open(os.path.join(self.model_dir, name), "wb") as f:
                f.write(data)
        with open(os.path.join(self.model_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        return cfg

    def load_version(
        self,
        version: int,
        model_config_json: str,
        artifacts: dict[str, bytes],
        state_dict: dict[str, torch.Tensor],
    ) -> None:
        raw_adapter = artifacts.get(lora.ADAPTER_CONFIG)
        if raw_adapter is None:
            if self.llm is not None and model_config_json == self.model_config_json and not self._lora_rank:
                self._update_weights(state_dict)
            else:
                self._start(model_config_json, artifacts, state_dict)
            self._lora, self._base = None, None
        else:
            self._load_lora(version, model_config_json, artifacts, state_dict, raw_adapter)
        self.version = version
        log.info("vllm engine loaded version %d", version)

    def _load_lora(
        self, version: int, model_config_json: str, artifacts: dict[str, bytes], state_dict: dict[str, torch.Tensor],
        raw_adapter: bytes,
    ) -> None:
        from vllm.lora.request import LoRARequest

        try:
            conf = lora.parse_adapter_config(raw_adapter)
        except ValueError as exc:
            raise ManifestError(f"version {version}: {exc}") from None
        base, adapter = split_lora(state_dict)
        if not adapter:
            raise ManifestError(f"version {version}: {lora.ADAPTER_CONFIG} without adapter tensors")
        rank = vllm_lora_rank(int(conf["r"]))
        same_engine = self.llm is not None and model_config_json == self.model_config_json and self._lora_rank >= rank
        if not same_engine:
            self._start(model_config_json, {k: v for k, v in artifacts.items() if k != lora.ADAPTER_CONFIG}, base,
                        lora_rank=rank)
        elif self._base is None or set(base) != set(self._base) or any(not torch.equal(base[k], self._base[k]) for k in base):
            self._update_weights(base)  # the base is frozen in a LoRA run: normally never taken
        self._base = base
        path = os.path.join(self.workdir, f"adapter-v{version}")
        os.makedirs(path, exist_ok=True)
        doc = json.loads(raw_adapter)
        doc["base_model_name_or_path"] = self.model_dir
        with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f)
        _save_safetensors(adapter, os.path.join(path, "adapter_model.safetensors"))
        old = self._lora
        # a fresh integer id per version: vLLM caches adapters by id
        self._lora = LoRARequest(f"echo2-v{version}", version + 1, path)
        if old is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            old_path = os.path.join(self.workdir, f"adapter-v{old.lora_int_id - 1}")
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(old_path, name))
            with contextlib.suppress(OSError):
                os.rmdir(old_path)

    def _start(
        self, model_config_json: str, artifacts: dict[str, bytes], state_dict: dict[str, torch.Tensor],
        *, lora_rank: int = 0,
    ) -> None:
        from vllm import LLM

        if self.llm is not None:
            # A new architecture: drop the old engine before building the next one.
            self.llm = None
            torch.cuda.empty_cache()
        cfg = self._write_model_dir(model_config_json, artifacts)
        _save_safetensors(state_dict, os.path.join(self.model_dir, "model.safetensors"))
        self.tokenizer = modelspec.load_tokenizer(artifacts)
        self._vocab_size = int(cfg.get("vocab_size", self.tokenizer.vocab_size))
        self._max_len = int(self.max_model_len or cfg.get("max_position_embeddings", 2048))
        self.llm = LLM(
            model=self.model_dir,
            dtype=str(self.dtype).removeprefix("torch."),
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self._max_len,
            enforce_eager=self.enforce_eager,
            # Prompts arrive as token ids and outputs leave as token ids: no tokenizer needed.
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            seed=0,
            trust_remote_code=False,  # the config came from the network (A8)
            **({"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1} if lora_rank else {}),
        )
        self.model_config_json = model_config_json
        self._lora_rank = lora_rank

    def _update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        assert self.llm is not None
        _save_safetensors(state_dict, os.path.join(self.model_dir, "model.safetensors"))
        try:
            self.llm.collective_rpc("reload_weights")
        except (AttributeError, NotImplementedError, RuntimeError, ValueError) as e:
            log.info("reload_weights unavailable (%s); using apply_model(load_weights)", e)
            items = [(k, v.detach().to("cpu")) for k, v in state_dict.items()]
            self.llm.apply_model(lambda model: model.load_weights(iter(items)))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Completion]:
        from vllm import SamplingParams

        if self.llm is None or self.tokenizer is None:
            raise EngineError("no policy version loaded")
        validate_request(prompts, group_size, max_new_tokens, temperature, top_p, self._vocab_size)
        if max(len(p) for p in prompts) + max_new_tokens > self._max_len:
            raise EngineError(f"prompt + max_new_tokens exceeds the model's {self._max_len} positions")
        if top_p < 1.0:
            log.warning("vllm engine: top_p=%s < 1, reported log-probs are nucleus-renormalised", top_p)
        stop_ids = sorted(self.tokenizer.stop_ids)
        rows = [i for i in range(len(prompts)) for _ in range(group_size)]
        reqs = [{"prompt_token_ids": list(prompts[pi])} for pi in rows]
        params = [
            SamplingParams(
                n=1,
                temperature=float(temperature),
                top_p=float(top_p),
                max_tokens=int(max_new_tokens),
                seed=derive_seed(seed, r),
                logprobs=0,  # 0 = only the sampled token's log-prob
                stop_token_ids=stop_ids,
                detokenize=False,
            )
            for r in range(len(rows))
        ]
        kw = {"lora_request": self._lora} if self._lora is not None else {}
        outs = self.llm.generate(reqs, params, use_tqdm=False, **kw)
        result: list[Completion] = []
        for pi, out in zip(rows, outs, strict=True):
            o = out.outputs[0]
            ids = [int(t) for t in o.token_ids]
            lps: list[float] = []
            for tok, entry in zip(ids, o.logprobs or [], strict=False):
                lp = entry[tok].logprob
                lps.append(min(float(lp), 0.0))
            if len(lps) != len(ids):
                raise EngineError("vllm returned fewer log-probs than tokens")
            stopped = bool(ids) and ids[-1] in self.tokenizer.stop_ids
            result.append(
                Completion(
                    prompt_index=pi,
                    token_ids=ids,
                    logprobs=lps,
                    finish_reason="stop" if stopped else "length",
                )
            )
        return result
