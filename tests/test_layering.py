"""The sans-IO contract in pyproject.toml lists the protocol core's modules one by one (a forbidden
contract covers every descendant, and echo2.protocol contains echo2.protocol.net); this keeps that
list complete, so a new core module cannot escape the contract by being forgotten."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_protocol_core_module_is_under_the_sans_io_contract() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = conf["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"] == "protocol core is sans-IO")
    listed = set(core["source_modules"])
    on_disk = {f"echo2.protocol.{p.stem}" for p in (ROOT / "protocol").glob("*.py") if p.stem != "__init__"}
    assert on_disk - listed == set(), f"core modules missing from the sans-IO contract: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"contract lists modules that do not exist: {sorted(listed - on_disk)}"
