"""A local swarm of real processes on 127.0.0.1: one hub and N nodes (used by the demo and benches)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2.learner_hub.config import HubConfig, render_config


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class LocalSwarm:
    root: Path
    hub_cfg: HubConfig
    n_nodes: int
    threads: int = 1
    node_args: list[str] = field(default_factory=list)
    hub: subprocess.Popen[bytes] | None = None
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    hub_addr: str = ""

    def start_hub(self, timeout_s: float = 120.0) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        hub_dir = self.root / "hub"
        hub_dir.mkdir(exist_ok=True)
        self.hub_cfg.dir = str(hub_dir)
        cfg_path = hub_dir / "hub.toml"
        cfg_path.write_text(render_config(self.hub_cfg))
        addrs = hub_dir / "hub.addrs"
        addrs.unlink(missing_ok=True)
        (hub_dir / "status.json").unlink(missing_ok=True)
        log = open(hub_dir / "hub.log", "ab")
        self.hub = subprocess.Popen(
            [sys.executable, "-m", "echo2", "hub", "run", "--config", str(cfg_path)],
            stdout=log, stderr=subprocess.STDOUT, env=_child_env(self.threads),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if addrs.exists() and addrs.read_text().strip():
                self.hub_addr = addrs.read_text().split()[0]
                return self.hub_addr
            if self.hub.poll() is not None:
                raise RuntimeError(f"hub exited with {self.hub.returncode}; see {hub_dir / 'hub.log'}")
            time.sleep(0.2)
        raise TimeoutError(f"hub did not start within {timeout_s}s; see {hub_dir / 'hub.log'}")

    def start_node(self, i: int, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
        d = self.root / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        log = open(d / "node.log", "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "echo2", "node", "run", "--hub", self.hub_addr, "--data-dir", str(d),
             "--threads", str(self.threads), *self.node_args, *(extra or [])],
            stdout=log, stderr=subprocess.STDOUT, env=_child_env(self.threads),
        )
        self.nodes.append(p)
        return p

    def kill_hub(self) -> None:
        """SIGKILL the hub: no clean shutdown, no final status (a crash)."""
        if self.hub is not None and self.hub.poll() is None:
            self.hub.send_signal(signal.SIGKILL)
            self.hub.wait(timeout=10)

    def kill_node(self, i: int) -> None:
        p = self.nodes[i]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def start(self) -> None:
        self.start_hub()
        for i in range(self.n_nodes):
            self.start_node(i)

    def status(self) -> dict[str, Any] | None:
        p = self.root / "hub" / "status.json"
        try:
            return json.loads(p.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    def wait(self, timeout_s: float, on_status: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        st = None
        while time.monotonic() < deadline:
            st = self.status() or st
            if st is not None and on_status is not None:
                on_status(st)
            if st is not None and st.get("final"):
                return st
            if self.hub is not None and self.hub.poll() is not None:
                return self.status() or st
            time.sleep(0.5)
        return st

    def stop(self) -> None:
        procs = [*self.nodes, *([self.hub] if self.hub else [])]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        end = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
