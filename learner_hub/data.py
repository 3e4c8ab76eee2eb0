"""Prompts from a dataset: local files read with HF ``datasets``, rendered, length-checked, drawn in
seeded epochs whose position survives a hub restart.

Everything that can be wrong with a dataset (a file that does not parse, a missing column, a prompt
that is neither a string nor a list of messages, a conversational dataset with a model that has no
chat template) is found here, at hub start-up, and raised as a :class:`ConfigError` naming the file,
the column and the problem: a hub never dies on a bad row half-way through a run.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, DatasetSpec
from .recipe import Message, PromptItem

log = logging.getLogger(__name__)

#: the store's meta key holding the draw position (epoch, index) of the training split
POSITION_KEY = "prompt_position"

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

Rows = Sequence[Mapping[str, Any]]


# --- loading ------------------------------------------------------------------------------------------
def load_rows(path: str | Path, split: str) -> Rows:
    """One split of a local dataset: a data file (json/jsonl, parquet, csv, arrow; the file *is* the
    split), a ``save_to_disk`` folder (a Dataset, or a DatasetDict holding ``split``) or a folder of
    data files named after their splits (``train.jsonl``, ``test.jsonl``)."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"dataset {p}: no such file or folder")
    try:
        if p.is_file():
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise ConfigError(f"dataset {p}: unknown file type {p.suffix!r}; use one of {', '.join(sorted(_BUILDERS))}")
            ds: Any = datasets.load_dataset(builder, data_files={"train": str(p)}, split="train")
        elif (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            ds = datasets.load_from_disk(str(p))
        else:
            ds = datasets.load_dataset(str(p))
    except ConfigError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for a file that does not parse
        raise ConfigError(f"dataset {p}: cannot be read: {type(exc).__name__}: {_first_line(exc)}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"dataset {p}: no split {split!r}; it has {', '.join(ds) or 'none'}")
        ds = ds[split]
    rows: Rows = ds
    return rows


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def check_prompt(value: Any, where: str) -> str | list[Message]:
    """A prompt as the dataset holds it: a string or a non-empty list of {"role", "content"} strings."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ConfigError(f"{where}: message {i} must be {{\"role\": str, \"content\": str}}, got {_short(m)}")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(f"{where}: must be a string or a list of {{\"role\", \"content\"}} messages, got {_short(value)}")


def _short(v: Any) -> str:
    r = repr(v)
    return (r[:80] + "...") if len(r) > 80 else r


# --- rendering ----------------------------------------------------------------------------------------
class Renderer:
    """Prompt -> (text, token ids) with the policy's tokenizer.

    A plain prompt is encoded as its literal text; like TRL's GRPOTrainer (``add_special_tokens=False``)
    no bos is put in front, unless ``add_bos`` (the built-in tasks, tuned with one). A
    conversational one goes through the model's chat template (``add_generation_prompt=True``,
    transformers' own jinja rendering) and is encoded as ``apply_chat_template(tokenize=True)``
    does: the template writes the special tokens itself, so they are parsed as such and no bos is
    added. The template comes from the model's artifacts (``tokenizer_config.json`` or
    ``chat_template.jinja``), the files that also travel to nodes.
    """

    def __init__(
        self, tok: Any, artifacts: Mapping[str, bytes] | None = None, system_prompt: str = "", add_bos: bool = False
    ) -> None:
        self.tok, self.add_bos = tok, add_bos
        self.system_prompt = system_prompt
        self._template = _chat_template(artifacts or {})
        self._artifacts = artifacts or {}
        self._hf: Any = None

    @property
    def has_template(self) -> bool:
        return bool(self._template)

    def render(self, prompt: str | list[Message]) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tok.encode(prompt, add_bos=self.add_bos))
        messages = list(prompt)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = str(self._chat().apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return text, list(self.tok.tokenizer.encode(text, add_special_tokens=False).ids)

    def _chat(self) -> Any:
        if self._hf is None:
            if not self._template:
                raise ConfigError(
                    "the model has no chat template (none in tokenizer_config.json or chat_template.jinja), so a "
                    "conversational dataset cannot be rendered: use plain-text prompts or a model with a chat template"
                )
            from transformers import PreTrainedTokenizerFast

            specials = {k: v for k, v in _json(self._artifacts, "tokenizer_config.json").items()
                        if k in ("bos_token", "eos_token", "pad_token", "unk_token") and v is not None}
            self._hf = PreTrainedTokenizerFast(tokenizer_object=self.tok.tokenizer, **specials)
            self._hf.chat_template = self._template
        return self._hf


def _json(artifacts: Mapping[str, bytes], name: str) -> dict[str, Any]:
    import json

    try:
        d = json.loads(artifacts[name].decode("utf-8")) if name in artifacts else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def _chat_template(artifacts: Mapping[str, bytes]) -> str:
    if "chat_template.jinja" in artifacts:
        return artifacts["chat_template.jinja"].decode("utf-8", "replace")
    t = _json(artifacts, "tokenizer_config.json").get("chat_template") or _json(artifacts, "chat_template.json").get(
        "chat_template")
    if isinstance(t, list):  # several named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else ""


# --- the prompt source --------------------------------------------------------------------------------
@dataclass
class Prepared:
    """The rows of one split that fit the prompt budget."""

    rows: Rows
    keep: list[int]  # indices into rows of the prompts within max_prompt_tokens
    skipped: int  # prompts longer than max_prompt_tokens


def prepare(rows: Rows, prompt_column: str, renderer: Renderer, max_prompt_tokens: int, name: str) -> Prepared:
    """Check every prompt once and keep those within the budget (logged once, with the count)."""
    columns = _columns(rows)
    if columns is not None and prompt_column not in columns:
        raise ConfigError(f"dataset {name}: no column {prompt_column!r} (prompt_column); it has {', '.join(columns)}")
    keep: list[int] = []
    for i, value in enumerate(_prompt_values(rows, prompt_column, name)):
        prompt = check_prompt(value, f"dataset {name}: row {i}, column {prompt_column!r}")
        if len(renderer.render(prompt)[1]) <= max_prompt_tokens:
            keep.append(i)
    skipped = len(rows) - len(keep)
    if skipped:
        log.warning("dataset %s: %d of %d prompts are longer than max_prompt_tokens=%d and are skipped",
                    name, skipped, len(rows), max_prompt_tokens)
    if not keep:
        raise ConfigError(f"dataset {name}: no prompt fits max_prompt_tokens={max_prompt_tokens} ({len(rows)} rows)")
    return Prepared(rows, keep, skipped)


def _prompt_values(rows: Rows, column: str, name: str) -> Iterable[Any]:
    if _columns(rows) is not None:
        # an HF Dataset: one column read, not a decoded row per prompt
        return rows[column]  # type: ignore[call-overload,no-any-return]
    missing = next((i for i, row in enumerate(rows) if column not in row), None)
    if missing is not None:
        raise ConfigError(f"dataset {name}: row {missing} has no column {column!r} (prompt_column)")
    return (row[column] for row in rows)


def _columns(rows: Rows) -> list[str] | None:
    names = getattr(rows, "column_names", None)
    return list(names) if names is not None else None


def make_item(rows: Rows, i: int, prompt_column: str, renderer: Renderer) -> PromptItem:
    row = dict(rows[i])
    prompt = check_prompt(row.pop(prompt_column), f"row {i}")
    text, ids = renderer.render(prompt)
    return PromptItem(text=text, prompt=prompt, row=row, index=i, ids=tuple(ids))


class PromptSource:
    """Draws prompts in epochs: epoch ``e`` visits every kept row once, in the order of a permutation
    seeded with ``seed + e``. ``(epoch, index)`` is the whole state, so a restart that restores it
    continues the same sequence: nothing repeated or skipped within an epoch."""

    def __init__(self, prepared: Prepared, prompt_column: str, renderer: Renderer, seed: int, name: str) -> None:
        self.prepared, self.prompt_column, self.renderer = prepared, prompt_column, renderer
        self.seed, self.name = seed, name
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.prepared.keep)

    @property
    def skipped(self) -> int:
        return self.prepared.skipped

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def draw(self, n: int) -> list[PromptItem]:
        out = []
        for _ in range(n):
            if self.index >= len(self):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
                log.info("dataset %s: epoch %d begins", self.name, self.epoch)
            row_i = self.prepared.keep[self._order[self.index]]
            self.index += 1
            out.append(make_item(self.prepared.rows, row_i, self.prompt_column, self.renderer))
        return out

    # --- the position, as the store keeps it ----------------------------------------------------------
    def position(self) -> dict[str, Any]:
        # size and name identify the split: a position saved for another dataset means nothing here
        return {"epoch": self.epoch, "index": self.index, "size": len(self), "name": self.name, "seed": self.seed}

    def restore(self, saved: Any) -> bool:
        """Continue from a saved :meth:`position`; False (and a fresh start) if it belongs to another
        dataset, size or seed."""
        if not isinstance(saved, dict):
            return False
        mine = self.position()
        if any(saved.get(k) != mine[k] for k in ("size", "name", "seed")):
            log.warning("dataset %s: the saved position %s is for another dataset; starting at epoch 0", self.name, saved)
            return False
        epoch, index = saved.get("epoch"), saved.get("index")
        if not (isinstance(epoch, int) and isinstance(index, int) and epoch >= 0 and 0 <= index <= len(self)):
            log.warning("dataset %s: unusable saved position %s; starting at epoch 0", self.name, saved)
            return False
        self.epoch, self.index = epoch, index
        self._order = self._permutation(epoch)
        log.info("dataset %s: resuming at epoch %d, prompt %d of %d", self.name, epoch, index, len(self))
        return True


def first_items(prepared: Prepared, n: int, prompt_column: str, renderer: Renderer) -> list[PromptItem]:
    """The first ``n`` prompts of a split that fit the budget, in file order (an eval set)."""
    return [make_item(prepared.rows, i, prompt_column, renderer) for i in prepared.keep[:n]]


def spec_name(spec: DatasetSpec, split: str) -> str:
    return f"{spec.path}[{split}]"

