"""hub.toml: written by `echo2 hub init` with tomli-w, read back typed and validated."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from echo2.cli import main
from echo2.learner_hub.config import ConfigError, HubConfig, load_config, render_config


def test_render_load_roundtrip_with_awkward_strings(tmp_path: Path) -> None:
    cfg = HubConfig(dir=str(tmp_path / 'a "quoted" dir\\with\nnewline'), allowlist=["12D3a", 'b"c'], staleness=3,
                    upload_limit_MBps=2.5, exit_when_done=True, broadcast="pipelined")
    text = render_config(cfg)
    assert "# S: rollouts made with version v" in text  # the comments stay
    assert 'allowlist = ["12D3a", "b\\"c"]' in text
    p = tmp_path / "hub.toml"
    p.write_text(text)
    assert tomllib.loads(text)["hub"]["dir"] == cfg.dir
    assert load_config(p) == cfg


def test_relative_dir_resolves_against_the_file(tmp_path: Path) -> None:
    p = tmp_path / "hub.toml"
    p.write_text(render_config(HubConfig(dir=".")))
    assert load_config(p).dir == str(tmp_path.resolve())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("staleness = -1", "staleness = -1: must be an integer >= 0"),
        ('steps = "10"', 'steps = "10": must be an integer >= 0'),
        ("top_p = 1.5", "top_p = 1.5: must be a number > 0 and <= 1"),
        ("group_size = 1", "group_size = 1: must be an integer >= 2"),
        ('activation = "cheap"', 'activation = "cheap": must be one of "cost", "all"'),
        ("exit_when_done = 1", "exit_when_done = 1: must be true or false"),
        ("allowlist = [1]", "allowlist = [1]: must be a list of strings"),
        ("listen_port = 70000", "listen_port = 70000: must be an integer >= 0 and <= 65535"),
    ],
)
def test_wrong_type_or_range_names_key_value_and_rule(tmp_path: Path, line: str, message: str) -> None:
    p = tmp_path / "hub.toml"
    p.write_text(f"[hub]\n{line}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert f"{p}: {message}" in str(err.value)


def test_unknown_key_suggests_and_lists_known(tmp_path: Path) -> None:
    p = tmp_path / "hub.toml"
    p.write_text("[hub]\nstalness = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    text = str(err.value)
    assert "unknown key 'stalness' (did you mean 'staleness'?)" in text
    assert "known keys: dir, listen_host" in text and "allowlist" in text
    p.write_text("[hub]\nextra = 1\n")  # the dead HubConfig.extra is gone
    with pytest.raises(ConfigError, match="unknown key 'extra'"):
        load_config(p)


def test_validate_checks_programmatic_configs() -> None:
    HubConfig().validate()
    with pytest.raises(ConfigError, match="staleness = -1: must be an integer >= 0"):
        dataclasses.replace(HubConfig(), staleness=-1).validate()
    with pytest.raises(ConfigError, match="temperature = 0.0: must be a number > 0"):
        HubConfig(temperature=0.0).validate()


def test_hub_init_writes_a_loadable_commented_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hub", "init", "--dir", str(tmp_path), "--task", "arith"]) == 0
    text = (tmp_path / "hub.toml").read_text()
    assert "# open | allowlist | token" in text and "\n[hub]\n" in text
    cfg = load_config(tmp_path / "hub.toml")
    assert cfg.task == "arith" and cfg.dir == str(tmp_path.resolve())
    assert main(["hub", "init", "--dir", str(tmp_path)]) == 1  # no overwrite without --force


def test_hub_run_with_a_bad_config_says_why_without_a_traceback(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "hub.toml"
    p.write_text("[hub]\nstaleness = -1\n")
    assert main(["hub", "run", "--config", str(p)]) == 1
    assert f"{p}: staleness = -1: must be an integer >= 0" in capsys.readouterr().err
    p.write_text("[hub]\n")
    assert main(["hub", "run", "--config", str(p), "--steps", "-3"]) == 1
    assert "steps = -3: must be an integer >= 0" in capsys.readouterr().err


def test_learner_device_is_checked_and_resolved(tmp_path: Path) -> None:
    import torch

    from echo2.learner_hub.training import resolve_device

    p = tmp_path / "hub.toml"
    p.write_text('[hub]\nlearner_device = "tpu"\n')
    with pytest.raises(ConfigError, match="learner_device"):
        load_config(p)
    p.write_text('[hub]\nlearner_device = "cuda:1"\n')
    assert load_config(p).learner_device == "cuda:1"
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    # an explicit GPU that is not there is refused, never a silent fall back to the CPU
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
