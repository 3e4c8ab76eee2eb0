"""A real echo2 node whose behaviour is altered: the adversary of the end-to-end tests.

It is the ordinary :class:`echo2.node.runtime.Node` (real libp2p host, real engine, real
signatures) with a few methods overridden, run as its own process::

    python tests/hostile_node.py --mode MODE --hub MULTIADDR --data-dir DIR [--threads N]

Modes:

* ``honest``    no change in behaviour (a control, or a victim to SIGKILL mid-task);
* ``logprobs``  reports behaviour log-probs shifted by ``LOGPROB_SHIFT`` (still valid numbers, so
                only the learner's recompute can catch it);
* ``forge``     after its first accepted result: replays the exact result envelope, re-seals
                the same result with a fresh nonce, sends a result for a made-up task id, then a
                result for another node's task (id guessed from the hub's id scheme);
* ``stall``     receives the first policy version, then never reads its downlink again while
                staying connected (a peer that stops reading);
* ``slow``      sleeps inside ``generate`` until past the task's deadline;
* ``corrupt``   flips a byte of every chunk it relays, and claims a huge upload so that the
                hub's planner makes it a relay (with many children) in a pipelined broadcast;
* ``lowmem``    a machine that holds ``LOWMEM_ROWS`` samples at once: a task's engine call with
                more raises MemoryError, as an allocation that fails would (the node is honest).

What the node observed (the hub's reply to each hostile action) goes to ``DIR/hostile.json``;
while a task runs, its id is in ``DIR/current_task``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from echo2.bench.swarm import LocalSwarm, _child_env
from echo2.keyfile import load_identity
from echo2.learner_hub.config import HubConfig
from echo2.node.relay_runtime import RelayNode
from echo2.node.runtime import Node, NodeConfig
from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error
from echo2.protocol.framing import RemoteError
from echo2.protocol.messages import Completion, Result, Task, task_hash
from echo2.protocol.net.control import ControlHost
from echo2.protocol.packedresult import PackedResult
from echo2.protocol.wire import MAX_CONTROL_REQUEST, RESULT

log = logging.getLogger("hostile_node")

MODES = ("honest", "logprobs", "forge", "stall", "slow", "corrupt", "lowmem")
LOWMEM_ROWS = 2
CLAIMED_UPLOAD_MBPS = 10_000.0  # the corrupt relay's claim: the fastest uplink in the swarm
LOGPROB_SHIFT = -0.5  # downwards: log-probs must stay <= 0 or the schema check refuses them first
SLOW_MARGIN_S = 2.5  # past the deadline, so the hub's 1 s housekeeping has expired the task


class _Engine:
    """Wraps the real engine; only ``generate`` is altered, and only while a task runs."""

    def __init__(self, inner: Any, node: HostileNode) -> None:
        self._inner = inner
        self._node = node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, prompts: list[list[int]], group_size: int, *args: Any, **kw: Any) -> list[Completion]:
        task = self._node._current_task
        if task is not None and self._node.mode == "lowmem":
            calls = self._node.report.setdefault("calls", [])  # [task id, samples asked, out of memory]
            oom = len(prompts) * group_size > LOWMEM_ROWS
            calls.append([task.task_id, len(prompts) * group_size, oom])
            self._node._write_report()
            if oom:
                raise MemoryError(f"cannot allocate {len(prompts) * group_size} samples")
        out: list[Completion] = self._inner.generate(prompts, group_size, *args, **kw)
        if task is None:  # throughput measurement, not a task
            return out
        if self._node.mode == "slow":
            time.sleep(max(0.0, task.deadline - time.time()) + SLOW_MARGIN_S)
        if self._node.mode == "logprobs":
            out = [
                Completion(
                    prompt_index=c.prompt_index,
                    token_ids=list(c.token_ids),
                    logprobs=[float(x) + LOGPROB_SHIFT for x in c.logprobs],
                    finish_reason=c.finish_reason,
                )
                for c in out
            ]
        return out


class _RecordingHost:
    """The node's real ControlHost; remembers the last result envelope it sent and the reply."""

    def __init__(self, inner: ControlHost) -> None:
        self._inner = inner
        self.sent: bytes | None = None
        self.accepted = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def request(self, peer: str, protocol: str, payload: bytes, **kw: Any) -> bytes:
        resp: bytes = await self._inner.request(peer, protocol, payload, **kw)
        if protocol == RESULT:
            self.sent, self.accepted = payload, True
        return resp


class StallingRelay(RelayNode):
    """A policy downlink that stops reading the hub once it holds a first version: a peer that
    stops reading, so the hub's sends to it block (the link stalls)."""

    async def _receive_loop(self, link: Any) -> None:
        if link.peer != self.hub_peer:
            await super()._receive_loop(link)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(super()._receive_loop, link)
            while self.held is None:
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        log.warning("stalling: holding the policy downlink open without reading it")
        await trio.sleep_forever()


class CorruptingRelay(RelayNode):
    """A policy downlink whose every relayed chunk has one byte flipped (valid framing, valid
    frame key: only the check against the hub-signed manifest catches it)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cfg = dataclasses.replace(self.cfg, corrupt_sends=True)


class HostileNode(Node):
    def __init__(self, cfg: NodeConfig, mode: str) -> None:
        super().__init__(cfg)
        self.mode = mode
        if mode == "stall":
            self.relay_cls = StallingRelay
        elif mode == "corrupt":
            self.relay_cls = CorruptingRelay
        self.report: dict[str, Any] = {"mode": mode, "peer_id": self.peer_id, "actions": []}
        self._own_tasks: dict[str, Task] = {}
        self._forged = False
        self._write_report()

    def _announce(self, host: Any) -> Any:
        a = super()._announce(host)
        if self.mode == "corrupt":
            a = dataclasses.replace(a, upload_MBps=CLAIMED_UPLOAD_MBPS)
        return a

    def _write_report(self) -> None:
        path = self.cfg.data_dir / "hostile.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1))
        tmp.replace(path)

    async def _admit(self, host: ControlHost) -> Any:
        # run() builds the engine just before the first admission: wrap it here (once)
        engine: Any = getattr(self, "_engine", None)
        if engine is not None and not isinstance(engine, _Engine):
            self._engine = _Engine(engine, self)
        return await super()._admit(host)

    async def _on_relay_holds(self, info: Any) -> None:
        if self.mode == "stall" and "stalled_at_version" not in self.report:
            self.report["stalled_at_version"] = info.version  # StallingRelay stops reading after it
            self._write_report()
        await super()._on_relay_holds(info)

    async def _run_task(self, host: ControlHost, task: Task) -> None:
        self._own_tasks[task.task_id] = task
        # instrumentation only (every mode): lets a test SIGKILL the node while it holds a task
        marker = self.cfg.data_dir / "current_task"
        marker.write_text(task.task_id)
        try:
            await self._run_task_as_mode(host, task)
        finally:
            marker.unlink(missing_ok=True)

    async def _run_task_as_mode(self, host: ControlHost, task: Task) -> None:
        if self.mode != "forge" or self._forged:
            await super()._run_task(host, task)
            return
        rec = _RecordingHost(host)
        await super()._run_task(rec, task)  # type: ignore[arg-type]
        if rec.accepted and rec.sent is not None and self._other_task_id(task.task_id) is not None:
            self._forged = True
            await self._forge(host, task, rec.sent)

    def _other_task_id(self, mine: str) -> str | None:
        """The hub numbers tasks ``<prefix>-<n>``: any lower number not given to us went elsewhere."""
        prefix, _, n = mine.rpartition("-")
        if not n.isdigit():
            return None
        for k in range(int(n) - 1, 0, -1):
            tid = f"{prefix}-{k}"
            if tid not in self._own_tasks:
                return tid
        return None

    async def _send(self, host: ControlHost, action: str, data: bytes, task_id: str) -> None:
        entry: dict[str, Any] = {"action": action, "task_id": task_id, "at": time.time()}
        try:
            await host.request(self.hub_peer, RESULT, data, max_response=MAX_CONTROL_REQUEST, timeout_s=30)
            entry.update(outcome="accepted", code="ok", message="")
        except RemoteError as exc:
            entry.update(outcome="refused", code=exc.code, message=exc.message)
        except (Echo2Error, OSError) as exc:
            entry.update(outcome="not_delivered", code=getattr(exc, "code", "os"), message=str(exc))
        log.warning("hostile action %s on %s: %s", action, task_id, entry)
        self.report["actions"].append(entry)
        self._write_report()

    async def _forge(self, host: ControlHost, task: Task, sent: bytes) -> None:
        original = envelope.open_envelope(sent, (PackedResult, Result), replay=None).message
        # 1. the exact same bytes again
        await self._send(host, "replay_exact", sent, task.task_id)
        # 2. the same result under a fresh signature and nonce
        await self._send(host, "replay_resealed", envelope.seal(self.identity, original, ttl_s=600), task.task_id)
        # 3. a task id the hub never issued
        fake = type(original)(
            task_id=f"made-up-{time.time_ns()}",
            task_hash=task_hash(task),
            node_id=self.peer_id,
            version=original.version,
            completions=original.completions,
            started_at=original.started_at,
            gen_seconds=original.gen_seconds,
            tokens=original.tokens,
        )
        await self._send(host, "unknown_task", envelope.seal(self.identity, fake, ttl_s=600), fake.task_id)
        # 4. another node's task: we cannot know its hash, so ours goes along (forged binding)
        other = self._other_task_id(task.task_id)
        assert other is not None
        self.report["other_task_id"] = other
        steal = type(original)(
            task_id=other,
            task_hash=task_hash(task),
            node_id=self.peer_id,
            version=original.version,
            completions=original.completions,
            started_at=original.started_at,
            gen_seconds=original.gen_seconds,
            tokens=original.tokens,
        )
        await self._send(host, "other_nodes_task", envelope.seal(self.identity, steal, ttl_s=600), other)


def start_hostile(swarm: LocalSwarm, i: int, mode: str) -> subprocess.Popen[bytes]:
    """Start a hostile node as node ``i`` of a running :class:`LocalSwarm` (stopped with it)."""
    d = swarm.root / f"node{i}"
    d.mkdir(parents=True, exist_ok=True)
    out = open(d / "node.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--hub", swarm.hub_addr,
         "--data-dir", str(d), "--threads", str(swarm.threads)],
        stdout=out, stderr=subprocess.STDOUT, env=_child_env(swarm.threads),
    )
    swarm.nodes.append(proc)
    return proc


# --- helpers shared by the end-to-end tests -------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def small_cfg(steps: int, **kw: Any) -> HubConfig:
    base: dict[str, Any] = dict(
        task="copy", steps=steps, staleness=1, seed=3, prompts_per_step=4, group_size=4, max_new_tokens=6,
        exit_when_done=False, checkpoint_every=100, task_deadline_s=10.0, listen_port=free_port(),
    )
    base.update(kw)
    return HubConfig(**base)


def peer_of(node_dir: Path) -> str:
    return load_identity(node_dir / "node.key").peer_id


def wait_until(
    pred: Callable[[], Any], timeout_s: float, what: str | Callable[[], str], poll_s: float = 0.3
) -> Any:
    """Poll ``pred`` until truthy (returned) or ``timeout_s`` (AssertionError naming ``what``;
    a callable ``what`` is evaluated at failure time, e.g. to include the logs as they are then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"{what() if callable(what) else what}: not within {timeout_s}s")


def query(root: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(root / "hub" / "hub.sqlite", timeout=10) as c:
        return c.execute(sql, args).fetchall()


def logs(root: Path) -> str:
    return "\n".join(f"== {p}\n" + p.read_text()[-4000:] for p in sorted(root.glob("*/*.log")))


def assert_run_ok(st: dict[str, Any] | None, steps: int, root: Path) -> None:
    assert st is not None and st.get("final"), f"run did not finish:\n{logs(root)}"
    assert [h["step"] for h in st["history"]] == list(range(1, steps + 1)), "a learner step was lost or repeated"
    assert all(math.isfinite(h["reward"]) and math.isfinite(h["loss"]) for h in st["history"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--hub", required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = HostileNode(NodeConfig(hub=args.hub, data_dir=args.data_dir, threads=args.threads), args.mode)

    async def run() -> int:
        return await node.run()

    try:
        return trio.run(run)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
