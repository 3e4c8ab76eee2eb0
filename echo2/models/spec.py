"""Model plumbing shared by the learner hub and the nodes: tokenizer, model, reference log-probs.

The pure half of the model specification (special tokens, the tiny config, config checks) is
``echo2.protocol.modelspec``; its names are re-exported here so model code needs one import.
This module turns (model_config JSON text, artifacts) into a tokenizer and a ``transformers``
model, and builds the byte-level tokenizer used when no model hub is reachable (brief section 10).

Everything here is deterministic and offline: the byte tokenizer is built in code, models are
created with ``from_config`` (random init driven by the caller's torch seed) and only local
directories are ever loaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from echo2.protocol.errors import ManifestError
from echo2.protocol.modelspec import (
    BOS_TOKEN,
    BUILTIN_ATTENTION,
    BYTE_VOCAB_SIZE,
    CHECKPOINT_ONLY_KEYS,
    EOS_TOKEN,
    LOCAL_ARTIFACT_FILES,
    MAX_ARTIFACT_BYTES,
    MAX_ARTIFACTS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    SUPPORTED_MODEL_TYPES,
    allowed_part,
    artifacts_for,
    config_json,
    parse_model_config,
    tiny_config,
)

# A transformers PreTrainedModel. Any to mypy: transformers wraps PreTrainedModel.to() in a
# decorator that mypy reads as taking a model, so every caller's ``model.to(device)`` would fail.
Model: TypeAlias = Any

__all__ = [
    "BOS_TOKEN", "BYTE_VOCAB_SIZE", "EOS_TOKEN", "MAX_ARTIFACTS", "MAX_ARTIFACT_BYTES", "PAD_TOKEN",
    "SPECIAL_TOKENS", "SUPPORTED_MODEL_TYPES", "TokenizerHandle", "artifacts_for", "build_byte_tokenizer",
    "config_json", "hf_config_from_json", "load_local_model", "local_model_config", "load_tokenizer", "model_from_config",
    "parse_model_config", "teacher_forced_batch", "teacher_forced_logprobs", "tiny_config", "tokenizer_json",
]

log = logging.getLogger(__name__)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the one the ByteLevel pre-tokenizer uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: "<pad>"=0, "<bos>"=1, "<eos>"=2, byte b -> id 3 + b, no merges.

    A BPE model without merges over the 256 ByteLevel symbols maps every byte of the UTF-8 text to
    exactly one id, so any text round-trips.  Special tokens are registered as added tokens so
    ``token_to_id`` finds them; ``TokenizerHandle.encode`` keeps literal "<eos>" text as bytes.
    """
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[b2u[b]] = len(SPECIAL_TOKENS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    # use_regex=False: no word splitting is needed without merges; add_prefix_space=False keeps
    # encode/decode an exact inverse.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_json() -> bytes:
    """The byte tokenizer serialized as tokenizer.json bytes (a manifest artifact)."""
    return build_byte_tokenizer().to_str().encode("utf-8")


def hf_config_from_json(model_config_json: str) -> Any:
    """A transformers PretrainedConfig from config JSON text (no network, no remote code).

    Only allow-listed keys pass (``parse_model_config``), and the attention is forced to the
    built-in one: a config never chooses code (A8)."""
    from transformers import AutoConfig

    d = dict(parse_model_config(model_config_json))
    model_type = d.pop("model_type")
    for k in CHECKPOINT_ONLY_KEYS:
        d.pop(k, None)
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as e:  # a hostile config may trip transformers anywhere: it is refused, never a crash
        raise ManifestError(f"model_config rejected by transformers: {type(e).__name__}: {str(e)[:200]}") from e
    cfg._attn_implementation = BUILTIN_ATTENTION
    return cfg


def model_from_config(model_config_json: str, dtype: torch.dtype = torch.float32) -> Model:
    """A randomly initialised model (init drawn from the caller's torch RNG), in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config_from_json(model_config_json)
    try:
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation=BUILTIN_ATTENTION, trust_remote_code=False
        )
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # e.g. zero heads, an unknown activation or rope type
        raise ManifestError(f"model_config does not build a model: {type(e).__name__}: {str(e)[:200]}") from e
    model.eval()
    return model


@dataclass
class TokenizerHandle:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with the special ids looked up by token."""

    tokenizer: Tokenizer
    pad_id: int
    bos_id: int | None
    eos_id: int
    # All ids that end a completion (eos plus any extra from generation_config.json).
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # Literal "<eos>" in user text must stay bytes, never become the control token.
        prev = self.tokenizer.encode_special_tokens
        self.tokenizer.encode_special_tokens = True
        try:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        finally:
            self.tokenizer.encode_special_tokens = prev
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def decode_batch(self, seqs: list[list[int]], skip_special: bool = True) -> list[str]:
        """:meth:`decode` of many sequences in one call into the tokenizer."""
        lists = seqs if all(type(x) is list for x in seqs) else [list(x) for x in seqs]  # no copy of lists
        return [str(t) for t in self.tokenizer.decode_batch(lists, skip_special_tokens=skip_special)]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


def _token_name(v: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as str or as {"content": str, ...}.
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _json_artifact(artifacts: dict[str, bytes], name: str) -> dict[str, Any]:
    raw = artifacts.get(name)
    if raw is None:
        return {}
    try:
        d = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"artifact {name} is not valid JSON: {e}") from e
    return d if isinstance(d, dict) else {}


def load_tokenizer(artifacts: dict[str, bytes]) -> TokenizerHandle:
    """Tokenizer from manifest artifacts (needs "tokenizer.json"); ManifestError if unusable.

    Special tokens: names from tokenizer_config.json when present (real HF models), else the
    byte tokenizer's "<pad>", "<bos>", "<eos>"; ids are always looked up by token.
    """
    raw = artifacts.get("tokenizer.json")
    if raw is None:
        raise ManifestError("artifacts lack tokenizer.json")
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception subclasses for bad JSON
        raise ManifestError(f"tokenizer.json does not load: {e}") from e
    tcfg = _json_artifact(artifacts, "tokenizer_config.json")

    def lookup(key: str, default: str) -> int | None:
        name = _token_name(tcfg.get(key)) or default
        return tok.token_to_id(name)

    eos_id = lookup("eos_token", EOS_TOKEN)
    if eos_id is None:
        raise ManifestError("tokenizer has no eos token")
    bos_id = lookup("bos_token", BOS_TOKEN)
    pad_id = lookup("pad_token", PAD_TOKEN)
    if pad_id is None:
        # Left padding is masked out, so any id works; eos is the usual stand-in.
        pad_id = eos_id
    stop = {eos_id}
    gen = _json_artifact(artifacts, "generation_config.json")
    g_eos = gen.get("eos_token_id")
    for x in g_eos if isinstance(g_eos, list) else [g_eos]:
        if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < tok.get_vocab_size(True):
            stop.add(x)
    return TokenizerHandle(
        tokenizer=tok, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id, stop_ids=frozenset(stop)
    )


def local_model_config(path: str | os.PathLike[str]) -> str:
    """The published config JSON of a local HF model directory (architecture keys only), read
    without loading weights: the hub sizes its learner from it before it loads anything."""
    p = os.fspath(path)
    with open(os.path.join(p, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for k in CHECKPOINT_ONLY_KEYS:
        cfg.pop(k, None)
    cfg, dropped = allowed_part(cfg)
    if dropped:
        log.info("%s: config keys %s are not published (nodes accept architecture keys only)", p, dropped)
    model_config = config_json(cfg)
    parse_model_config(model_config)
    return model_config


def load_local_model(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[Model, str, dict[str, bytes]]:
    """Load a local HF model directory: (model in eval mode, config JSON text, small artifacts).

    The directory needs config.json, tokenizer.json and weights (safetensors); nothing is fetched.
    """
    from transformers import AutoModelForCausalLM

    p = os.fspath(path)
    model_config = local_model_config(p)
    artifacts: dict[str, bytes] = {}
    for name in LOCAL_ARTIFACT_FILES:
        fp = os.path.join(p, name)
        if not os.path.isfile(fp):
            continue
        size = os.path.getsize(fp)
        if size > MAX_ARTIFACT_BYTES:
            raise ManifestError(f"{name} is {size} bytes, over the {MAX_ARTIFACT_BYTES}-byte artifact limit")
        with open(fp, "rb") as f:
            artifacts[name] = f.read()
    if "tokenizer.json" not in artifacts:
        raise ManifestError(f"{p} has no tokenizer.json")
    model = AutoModelForCausalLM.from_pretrained(
        p, dtype=dtype, local_files_only=True, attn_implementation=BUILTIN_ATTENTION, trust_remote_code=False
    )
    model.eval()
    return model, model_config, artifacts


#: positions whose vocabulary-wide float32 log-softmax is held at once (BRIEF section 11: SmolLM2's
#: 49k vocabulary makes a [64, 96, V] float32 softmax 1.2 GB; 2048 positions are ~400 MB)
LOGPROB_CHUNK_POSITIONS = 2048
#: positions whose entropy is computed at once (two extra vocabulary-wide float32 copies each)
ENTROPY_CHUNK_POSITIONS = 256


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    import contextlib

    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def teacher_forced_batch(
    model: torch.nn.Module,
    rows: list[tuple[list[int], list[int]]] | Any,
    *,
    pad_id: int,
    temperature: float,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    entropy_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """THE teacher-forced log-probs of each row's completion: ``([B, Lc] logp, [B, Lc] mask)``.

    ``logp[i, j] = log_softmax(logits / T)[completion_i[j]]`` in float32 (T <= 0, greedy, is scored
    at T = 1, as the engines report it), top-p not applied. Rows are *right* padded with plain
    position ids ``0..n-1``: under a causal mask a real token never attends to a later padding
    position, so each row's log-probs equal an unpadded forward pass's. The forward runs under
    autocast when ``dtype`` is a half type. Only the completion positions' logits are gathered,
    and the vocabulary-wide log-sum-exp runs over at most ``LOGPROB_CHUNK_POSITIONS`` of them at
    a time. Gradients flow unless the caller disables them.

    With ``entropy_out`` (a list), the entropy of each completion position's distribution,
    ``-sum(p log p)`` of ``softmax(logits / T)`` (``[B, Lc]``, float32, detached, 0 on padding:
    TRL's ``entropy``) is appended to it, from the same chunks (one more exp-and-sum over each;
    no second forward pass).
    """
    if device is None:
        device = next(model.parameters()).device
    t = float(temperature) if temperature > 0 else 1.0
    b = len(rows)
    lc = max((len(c) for _, c in rows), default=0)
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    # Index of the logit that predicts completion token j of row i: len(prompt_i) - 1 + j.
    pred_pos = torch.zeros((b, max(lc, 1)), dtype=torch.long)
    targets = torch.full((b, max(lc, 1)), pad_id, dtype=torch.long)
    cmask = torch.zeros((b, max(lc, 1)), dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        if not p:
            raise ValueError("teacher_forced_logprobs: empty prompt")
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(list(p) + list(c), dtype=torch.long)
        attn[i, :n] = 1
        k = len(c)
        if k:
            pred_pos[i, :k] = torch.arange(len(p) - 1, len(p) - 1 + k)
            targets[i, :k] = torch.tensor(list(c), dtype=torch.long)
            cmask[i, :k] = 1.0
    pos = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(b, width)
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    pred_pos, targets, cmask = pred_pos.to(device), targets.to(device), cmask.to(device)
    with _autocast(device, dtype):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    step = max(1, LOGPROB_CHUNK_POSITIONS // max(b, 1))
    parts, ents = [], []
    for j0 in range(0, pred_pos.shape[1], step):
        pp = pred_pos[:, j0 : j0 + step]
        h = logits.gather(1, pp.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float() / t
        tok = h.gather(-1, targets[:, j0 : j0 + step].unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(h, dim=-1)
        parts.append(tok - lse)
        if entropy_out is not None:
            # H = lse - sum(p * h), p = softmax(h), over a few positions at a time: the softmax
            # and product are vocabulary-wide copies (SmolLM2: 196 KB per position in float32)
            with torch.no_grad():
                split = max(1, ENTROPY_CHUNK_POSITIONS // max(b, 1))
                for hs, ls in zip(h.detach().split(split, dim=1), lse.detach().split(split, dim=1), strict=True):
                    ents.append(ls - (torch.softmax(hs, dim=-1) * hs).sum(-1))
    logp = torch.cat(parts, dim=1) * cmask
    if entropy_out is not None:
        entropy_out.append((torch.cat(ents, dim=1) * cmask)[:, :lc])
    return logp[:, :lc], cmask[:, :lc]


@torch.inference_mode()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> list[float]:
    """Reference log-probs of ``completion_ids`` after ``prompt_ids``: one row of
    :func:`teacher_forced_batch` (the one place they are computed), in the model's own dtype."""
    if not prompt_ids:
        raise ValueError("teacher_forced_logprobs: empty prompt")
    if not completion_ids:
        return []
    pad = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
    logp, _ = teacher_forced_batch(model, [(list(prompt_ids), list(completion_ids))], pad_id=pad, temperature=temperature)
    return [float(x) for x in logp[0].tolist()]
