"""``echo2 hub export``: a policy version of a hub directory as a Hugging Face model directory.

What the hub keeps of its weights is its checkpoints (``checkpoints/step-N.pt``: the learner's
float32 master weights, or the name of a sharded ``step-N.dcp`` folder beside it); published
versions travel to nodes as packed deltas and are not kept on the hub's disk. So the versions
that can be exported are the checkpointed ones (every ``checkpoint_every`` steps and the last,
the newest three of them: the store's ``keep_checkpoints``). The weights are written in the run's ``publish_dtype``
by default: that cast of the master weights is the very policy nodes sampled and evaluations
measured (bit for bit); ``dtype="float32"`` writes the master weights themselves.

Export only reads: hub.toml, the checkpoint files, and the SQLite store opened read-only
(``mode=ro``), so it runs beside a live hub (WAL readers do not block the writer) or after it
stopped, and never changes the hub directory. The new directory is written beside ``out`` under
a temporary name and renamed into place, so a failed export leaves nothing half-written.

Layout. A full fine-tune: ``config.json``, ``model.safetensors`` (sharded with
``model.safetensors.index.json`` above ``max_shard_size``, by ``save_pretrained``),
``generation_config.json``, the run's tokenizer files (chat template included) and a model card.
A LoRA run: the adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``)
at the top, whose ``base_model_name_or_path`` is the run's local base directory or, for the
built-in tiny model (built in code, its base lives only in the checkpoint), ``base/`` written
beside it; with ``merge`` the merged full model is at the top and the adapter in ``adapter/``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, HubConfig, load_config
from .export_card import model_card

log = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: extra tokenizer files of a local model directory worth carrying (LOCAL_ARTIFACT_FILES is what
#: travels to nodes; transformers 5 keeps a chat template in its own file)
_EXTRA_TOKENIZER_FILES = ("chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


class ExportError(RuntimeError):
    """The export cannot be made (no such version, no checkpoint, not a hub directory)."""


@dataclass
class ExportResult:
    out: Path
    step: int
    dtype: str
    lora: bool
    merged: bool
    files: list[str] = field(default_factory=list)
    note: str = ""


# --- reading the hub directory (read-only) -----------------------------------------------------------

def read_store(hub_dir: Path) -> dict[str, Any]:
    """Evaluations and published versions from hub.sqlite, opened read-only (``mode=ro``): the
    running hub's WAL writer is never blocked and the file is never written. Empty when the hub
    has no database yet."""
    db_path = hub_dir / "hub.sqlite"
    out: dict[str, Any] = {"evaluations": [], "versions": []}
    if not db_path.exists():
        return out
    # No -wal beside the file: no hub has it open (a WAL writer keeps one), and a plain read-only
    # open would create -wal and -shm (measured: both appeared after an export of a stopped hub);
    # immutable=1 reads the file as it is and creates nothing.
    live = db_path.with_name(db_path.name + "-wal").exists()
    uri = f"{db_path.resolve().as_uri()}?mode=ro" + ("" if live else "&immutable=1")
    db = sqlite3.connect(uri, uri=True, timeout=10.0)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "evaluations" in tables:
            keys = ("step", "wall_s", "mean_reward", "accuracy", "n", "excluded")
            rows = db.execute("SELECT step, wall_s, mean_reward, accuracy, n, excluded FROM evaluations ORDER BY step")
            out["evaluations"] = [dict(zip(keys, r, strict=True)) for r in rows]
        if "versions" in tables:
            out["versions"] = [int(r[0]) for r in db.execute("SELECT version FROM versions ORDER BY version")]
    finally:
        db.close()
    return out


def checkpoints(hub_dir: Path) -> dict[int, Path]:
    """step -> checkpoint file; the directory, not the table, is the truth (checkpointstore.py)."""
    d = hub_dir / "checkpoints"
    if not d.is_dir():
        return {}
    return {int(m.group(1)): p for p in d.iterdir() if (m := _CKPT_RE.match(p.name))}


def choose_step(
    available: list[int], evaluations: list[dict[str, Any]], version: int | None, best_eval: bool
) -> tuple[int, str]:
    """The step to export and a note on the choice. ``best_eval``: the best evaluation (accuracy,
    then mean reward, then the later step) among checkpointed steps."""
    if not available:
        raise ExportError("the hub directory has no checkpoint yet (checkpoints/step-N.pt): nothing to export")
    if version is not None:
        if version not in available:
            raise ExportError(f"version {version} has no checkpoint; checkpointed versions: {sorted(available)} "
                              "(the hub checkpoints every checkpoint_every steps and keeps the newest three)")
        return version, f"version {version} as asked"
    if not best_eval:
        return max(available), f"the newest checkpointed version ({max(available)})"

    def key(e: dict[str, Any]) -> tuple[float, float, int]:
        acc, mean = e.get("accuracy"), e.get("mean_reward")
        return (-1.0 if acc is None else float(acc), float("-inf") if mean is None else float(mean), int(e["step"]))

    scored = [e for e in evaluations if e.get("accuracy") is not None or e.get("mean_reward") is not None]
    if not scored:
        raise ExportError("--best-eval: the store holds no evaluation (set eval_every in hub.toml)")
    usable = [e for e in scored if int(e["step"]) in available]
    if not usable:
        raise ExportError(f"--best-eval: no evaluated step has a checkpoint (evaluated: {[e['step'] for e in scored]}, "
                          f"checkpointed: {sorted(available)}); make eval_every a multiple of checkpoint_every")
    best = max(usable, key=key)
    note = f"the best evaluation among checkpointed versions (step {best['step']}: accuracy {best.get('accuracy')}, " \
           f"mean reward {best.get('mean_reward')})"
    overall = max(scored, key=key)
    if key(overall) > key(best):
        note += f"; the best overall, step {overall['step']}, has no checkpoint left"
        log.warning("export: %s", note)
    return int(best["step"]), note


def find_config(hub_dir: Path, config: Path | None) -> tuple[HubConfig, str]:
    """The run's HubConfig and the text of its hub.toml (``hub_dir/hub.toml`` unless given)."""
    path = config if config is not None else hub_dir / "hub.toml"
    if not path.is_file():
        raise ExportError(f"{path} not found: export needs the run's hub.toml (give it with --config)")
    try:
        return load_config(path), path.read_text()
    except ConfigError as exc:
        raise ExportError(f"{path}: {exc.message}") from exc


def open_checkpoint(hub_dir: Path, evaluations: list[dict[str, Any]], version: int | None,
                    best_eval: bool) -> tuple[int, str, Path, dict[str, Any]]:
    """Choose the step and map its checkpoint at once: a running hub prunes old checkpoints
    (measured: the newest of three was gone 70 s later, while a loaded machine built the model),
    and a mapped file stays readable after its unlink. A default choice pruned between listing
    and mapping is made again."""
    for attempt in range(3):
        ckpts = checkpoints(hub_dir)
        step, why = choose_step(sorted(ckpts), evaluations, version, best_eval)
        try:
            state = torch.load(ckpts[step], map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            if version is not None or attempt == 2:
                raise ExportError(f"the checkpoint of version {step} was pruned by the running hub as export read it") from None
            continue
        if not isinstance(state, dict):
            raise ExportError(f"{ckpts[step]} does not hold a checkpoint")
        return step, why, ckpts[step], state
    raise AssertionError("unreachable")


def load_master_weights(ckpt: Path, state: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The learner's float32 weights at a checkpoint, under ``model``'s own names: a one-process
    ``step-N.pt`` (``state``, as loaded), or the ``step-N.dcp`` folder it names (read without a
    process group, as a one-process learner resumes it: shardckpt.py)."""
    if "dcp" in state:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        msd = get_model_state_dict(model)
        sd: dict[str, Any] = {"model": msd}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(ckpt.parent / str(state["dcp"])))
        return dict(sd["model"])
    if "model" not in state:
        raise ExportError(f"{ckpt} holds no model weights")
    return dict(state["model"])


# --- building the model and its tokenizer ---------------------------------------------------------------

def _base_model(cfg: HubConfig) -> tuple[Any, Path | None]:
    """A float32 model of the run's architecture (weights about to be replaced) and the local
    directory it comes from (None for the tiny model, built in code)."""
    from echo2.models import gguf
    from echo2.models import spec as modelspec

    if cfg.model == "tiny":
        conf = modelspec.tiny_config(hidden=cfg.tiny_hidden, layers=cfg.tiny_layers)
        model_config, _ = modelspec.artifacts_for(conf, modelspec.tokenizer_json())
        model = modelspec.model_from_config(model_config)
        tok = modelspec.load_tokenizer({"tokenizer.json": modelspec.tokenizer_json()})
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = tok.bos_id, tok.eos_id, tok.pad_id
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        return model, None
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    src = Path(gguf.resolve_model(cfg.model)).resolve()
    hf_conf = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(hf_conf, dtype=torch.float32, attn_implementation=modelspec.BUILTIN_ATTENTION,
                                             trust_remote_code=False)
    if (src / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(src, local_files_only=True)
    return model, src


def write_tokenizer(cfg: HubConfig, src: Path | None, out: Path) -> None:
    """The tokenizer the run used: a local model's files as they are (its chat template
    included); for the tiny model its byte tokenizer (spec.py) saved by transformers."""
    if src is not None:
        from echo2.models.spec import LOCAL_ARTIFACT_FILES

        for name in (*LOCAL_ARTIFACT_FILES, *_EXTRA_TOKENIZER_FILES):
            if name != "generation_config.json" and (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        return
    from transformers import PreTrainedTokenizerFast

    from echo2.models import spec as modelspec

    # the built-in tasks put <bos> before every prompt (recipe.py); transformers rebuilds this
    # tokenizer as its model type's class on load (Qwen2Tokenizer: same ids for every byte, no
    # <bos> template), so the card says so rather than a post-processor that would be dropped
    fast = PreTrainedTokenizerFast(tokenizer_object=modelspec.build_byte_tokenizer(), bos_token=modelspec.BOS_TOKEN,
                                   eos_token=modelspec.EOS_TOKEN, pad_token=modelspec.PAD_TOKEN, padding_side="left")
    fast.save_pretrained(out)


# --- the export itself ----------------------------------------------------------------------------------

def export(
    hub_dir: Path,
    out: Path,
    *,
    version: int | None = None,
    best_eval: bool = False,
    merge: bool = False,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    config: Path | None = None,
    force: bool = False,
) -> ExportResult:
    """Write one checkpointed policy version of ``hub_dir`` as a Hugging Face model directory."""
    hub_dir = Path(hub_dir)
    if not (hub_dir / "hub.sqlite").exists() and not (hub_dir / "checkpoints").is_dir():
        raise ExportError(f"{hub_dir} is not a hub directory (no hub.sqlite, no checkpoints/)")
    if version is not None and best_eval:
        raise ExportError("give --version or --best-eval, not both")
    cfg, toml_text = find_config(hub_dir, config)
    if merge and not cfg.lora.enabled:
        raise ExportError("--merge applies to a LoRA run (lora = {r = ...} in hub.toml); this run trained the whole model")
    out = Path(out)
    if out.resolve() == hub_dir.resolve() or out.resolve() in hub_dir.resolve().parents:
        raise ExportError(f"--out {out} would replace the hub directory {hub_dir}: choose another folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ExportError(f"{out} exists and is not empty (use --force to replace it)")
    dt = dtype or cfg.publish_dtype
    if dt not in _DTYPES:
        raise ExportError(f"dtype {dt!r}: one of {', '.join(_DTYPES)}")
    store = read_store(hub_dir)
    step, why, ckpt, state = open_checkpoint(hub_dir, store["evaluations"], version, best_eval)

    model, src = _base_model(cfg)
    peft_model: Any = None
    if cfg.lora.enabled:
        from echo2.models import lora

        lo = cfg.lora
        peft_model = lora.wrap(model, r=lo.r, alpha=lo.alpha, target_modules=lo.target_modules, dropout=lo.dropout)
        model = peft_model.get_base_model()  # the learner's (and the checkpoint's) names
    weights = load_master_weights(ckpt, state, model)
    model.load_state_dict(weights, strict=True)
    del weights, state

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the model folder the exporter's only
    try:
        res = ExportResult(out=out, step=step, dtype=dt, lora=peft_model is not None, merged=merge, note=why)
        if peft_model is None:
            model.to(_DTYPES[dt]).save_pretrained(tmp, max_shard_size=max_shard_size)
            write_tokenizer(cfg, src, tmp)
        else:
            _write_lora(cfg, peft_model, src, tmp, out, dt, merge, max_shard_size)
        (tmp / "README.md").write_text(model_card(cfg, toml_text, step, dt, why, store, res.lora, merge, src))
        res.files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported step %d of %s to %s (%s, %s)", step, hub_dir, out, dt, why)
    return res


def _write_lora(cfg: HubConfig, peft_model: Any, src: Path | None, tmp: Path, out: Path, dt: str, merge: bool,
                max_shard_size: str) -> None:
    """Adapter (peft's format), base (tiny only) and, with ``merge``, the merged model."""
    import copy

    torch_dt = _DTYPES[dt]
    adapter_dir = tmp / "adapter" if merge else tmp
    if merge:
        # merged in float32 from the master weights, then cast once: no bf16 rounding inside the sum
        merged = copy.deepcopy(peft_model).merge_and_unload()
        merged.to(torch_dt).save_pretrained(tmp, max_shard_size=max_shard_size)
        write_tokenizer(cfg, src, tmp)
        del merged
    peft_model.to(torch_dt)
    # the base a loader fetches: the run's local model, or base/ beside the adapter (final path)
    base_ref = str(src) if src is not None else str((out / "base").resolve())
    peft_model.peft_config["default"].base_model_name_or_path = base_ref
    adapter_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # peft looks for the base's config.json to tell whether the vocabulary changed; base/ is
        # written just below, and echo2's LoRA never trains the embeddings (adapters on linear layers)
        warnings.filterwarnings("ignore", message="Could not find a config file")
        peft_model.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").unlink(missing_ok=True)  # peft's empty card; ours is written at the top
    write_tokenizer(cfg, src, adapter_dir)
    if src is None:
        base = peft_model.unload()  # the frozen base, adapters removed
        base.save_pretrained(tmp / "base", max_shard_size=max_shard_size)
        write_tokenizer(cfg, src, tmp / "base")


__all__ = ["ExportError", "ExportResult", "checkpoints", "choose_step", "export", "load_master_weights", "open_checkpoint", "read_store"]
