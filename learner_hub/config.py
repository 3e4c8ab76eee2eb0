"""Hub configuration: a commented TOML file written by ``echo2 hub init``."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from echo2.protocol.errors import Echo2Error


class ConfigError(Echo2Error):
    """Hub configuration is invalid."""

    code = "config"


@dataclass
class HubConfig:
    dir: str = "."
    # networking
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    data_port: int = 0
    status_port: int = 0
    upload_limit_MBps: float = 0.0
    admission: str = "open"
    # model and task
    model: str = "tiny"
    tiny_hidden: int = 128
    tiny_layers: int = 2
    task: str = "copy"
    dataset: str = ""
    dtype: str = "float32"
    publish_dtype: str = "bfloat16"
    # GRPO
    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 16
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 5e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    seed: int = 0
    # bounded staleness
    staleness: int = 1
    task_deadline_s: float = 30.0
    task_target_s: float = 2.0
    node_silence_s: float = 0.0
    # dissemination
    chunk_bytes: int = 0
    broadcast: str = "star"
    activation: str = "cost"
    activation_margin: float = 1.25
    full_every: int = 10
    exit_when_done: bool = False
    checkpoint_every: int = 10
    logprob_tolerance: float = 1e-3
    relay_report_quorum: int = 2
    allowlist: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def validate(self) -> None:
        if self.activation not in ("cost", "all"):
            raise ConfigError(f"activation must be cost or all, not {self.activation!r}")
        if self.broadcast not in ("pipelined", "star"):
            raise ConfigError(f"broadcast must be pipelined or star, not {self.broadcast!r}")
        if self.admission not in ("open", "allowlist", "token"):
            raise ConfigError(f"admission must be open, allowlist or token, not {self.admission!r}")
        if self.staleness < 0:
            raise ConfigError("staleness must be >= 0")
        if self.group_size < 2:
            raise ConfigError("group_size must be >= 2 (GRPO needs a group to normalise against)")
        if self.prompts_per_step < 1 or self.steps < 0:
            raise ConfigError("prompts_per_step must be >= 1 and steps >= 0")
        if self.dtype not in ("float32", "bfloat16") or self.publish_dtype not in ("float32", "bfloat16"):
            raise ConfigError("dtype and publish_dtype must be float32 or bfloat16")
        if not (0 < self.top_p <= 1) or self.temperature <= 0:
            raise ConfigError("need 0 < top_p <= 1 and temperature > 0")
        if self.relay_report_quorum < 1:
            raise ConfigError("relay_report_quorum must be >= 1")


def load_config(path: str | Path) -> HubConfig:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from exc
    known = {f.name for f in fields(HubConfig)}
    hub = raw.get("hub", raw)
    unknown = set(hub) - known
    if unknown:
        raise ConfigError(f"unknown config keys in {p}: {', '.join(sorted(unknown))}")
    cfg = HubConfig(**hub)
    if not Path(cfg.dir).is_absolute():
        cfg.dir = str((p.parent / cfg.dir).resolve())
    cfg.validate()
    return cfg


_TEMPLATE = """\
# echo2 learner hub configuration (written by `echo2 hub init`).
[hub]
dir = {dir!r}               # hub directory: key, hub.addrs, status, checkpoints
listen_host = {listen_host!r}   # libp2p control plane; use 0.0.0.0 to accept remote nodes
listen_port = {listen_port}              # 0 = pick a free port
data_port = {data_port}                # TCP data plane for policy chunks (0 = free port)
status_port = {status_port}              # status/metrics HTTP on 127.0.0.1 (0 = off or free)
upload_limit_MBps = {upload_limit_MBps}      # emulate/cap the hub uplink (0 = unlimited)
admission = {admission!r}          # open | allowlist | token

model = {model!r}              # "tiny" (built in code) or a local Hugging Face model directory
tiny_hidden = {tiny_hidden}
tiny_layers = {tiny_layers}
task = {task!r}               # copy | reverse | arith | jsonl
dataset = {dataset!r}               # JSONL with question/answer fields when task = "jsonl"
dtype = {dtype!r}          # training dtype: float32 | bfloat16
publish_dtype = {publish_dtype!r}  # dtype of published policy versions (bfloat16 compresses deltas well)

steps = {steps}                 # learner steps to run
prompts_per_step = {prompts_per_step}       # prompts per learner step; B = prompts_per_step * group_size
group_size = {group_size}             # G completions per prompt (GRPO group)
max_new_tokens = {max_new_tokens}
temperature = {temperature}
top_p = {top_p}
lr = {lr}
clip_eps = {clip_eps}
kl_coef = {kl_coef}
seed = {seed}

staleness = {staleness}              # S: rollouts made with version v are trained on at steps v..v+S
task_deadline_s = {task_deadline_s}      # a task not answered by then is reassigned
task_target_s = {task_target_s}         # tasks are sized to take about this long on their node
node_silence_s = {node_silence_s}        # drop a node silent this long (0 = default, 30 s)

chunk_bytes = {chunk_bytes}            # 0 = packing default
activation = {activation!r}          # cost: free nodes + cheapest cover of R* among paid ones | all
activation_margin = {activation_margin}    # R* = margin * B / T_train
broadcast = {broadcast!r}      # pipelined (peer-assisted relay trees) | star (hub sends to every node)
full_every = {full_every}             # a full snapshot every K versions bounds delta chains
exit_when_done = {exit_when_done}   # stop the hub after `steps`
checkpoint_every = {checkpoint_every}       # checkpoint policy, optimizer and step every K steps (restart resumes)
logprob_tolerance = {logprob_tolerance}   # node log-probs must match the learner's recompute within this
relay_report_quorum = {relay_report_quorum}    # distinct peers reporting corrupt relayed chunks that ban a relay
allowlist = {allowlist_toml}              # peer IDs admitted in allowlist mode (also: echo2 hub admit PEER_ID)
"""


def render_config(cfg: HubConfig) -> str:
    values = asdict(cfg)
    values["exit_when_done"] = "true" if cfg.exit_when_done else "false"
    values["allowlist_toml"] = "[" + ", ".join(f'"{p}"' for p in cfg.allowlist) + "]"
    return _TEMPLATE.format(**values)
