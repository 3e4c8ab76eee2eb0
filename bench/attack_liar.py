"""A5's attacker: a real echo2 node (real engine, real keys) that forges its rows.

Its first result is honest (what a spot check on the first sample sees); every later one
carries forged behaviour log-probs (a near-certain -0.01 per token, so the
importance ratio the learner computes is skewed) and a forged ``finish_reason`` ("stop", which
the reward and the ledger may believe). What the hub answered to each is written to
``DIR/liar.json``. Run as ``python -m echo2.bench.attack_liar --hub ADDR --data-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import trio

from echo2.fsutil import atomic_write
from echo2.node.runtime import Node, NodeConfig
from echo2.protocol.errors import Echo2Error
from echo2.protocol.framing import RemoteError
from echo2.protocol.messages import Completion, Task
from echo2.protocol.net.control import ControlHost
from echo2.protocol.wire import RESULT

log = logging.getLogger("attack_liar")
FORGED_LOGPROB = -0.01


def forge(completions: list[Completion]) -> list[Completion]:
    return [Completion(prompt_index=c.prompt_index, token_ids=list(c.token_ids),
                       logprobs=[FORGED_LOGPROB] * len(c.token_ids), finish_reason="stop") for c in completions]


class _Engine:
    def __init__(self, inner: Any, node: LiarNode) -> None:
        self._inner, self._node = inner, node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, *args: Any, **kw: Any) -> list[Completion]:
        out: list[Completion] = self._inner.generate(*args, **kw)
        return forge(out) if self._node.forging else out


class _Host:
    """The node's real host; records the hub's answer to each result."""

    def __init__(self, inner: ControlHost, node: LiarNode, rows: int, task_id: str) -> None:
        self._inner, self._node, self._rows, self._task_id = inner, node, rows, task_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def request(self, peer: str, protocol: str, payload: bytes, **kw: Any) -> bytes:
        if protocol != RESULT:
            return await self._inner.request(peer, protocol, payload, **kw)  # type: ignore[no-any-return]
        kind = "forged" if self._node.forging else "honest"
        try:
            resp: bytes = await self._inner.request(peer, protocol, payload, **kw)
            if kind == "forged":  # the bench asks the hub's store whether these were trained
                self._node.report.setdefault("forged_task_ids", []).append(self._task_id)
            self._node.count(f"{kind}_results_accepted", f"{kind}_rows_accepted", self._rows)
            return resp
        except RemoteError as exc:
            self._node.count(f"{kind}_results_refused:{exc.code}", f"{kind}_rows_refused", self._rows)
            raise
        except Echo2Error:
            self._node.count(f"{kind}_results_lost", f"{kind}_rows_lost", self._rows)
            raise


class LiarNode(Node):
    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.forging = False
        self.results_sent = 0
        self.report: dict[str, Any] = {"peer_id": self.peer_id}
        self._save()

    def count(self, results_key: str, rows_key: str, rows: int) -> None:
        self.report[results_key] = self.report.get(results_key, 0) + 1
        self.report[rows_key] = self.report.get(rows_key, 0) + rows
        self._save()

    def _save(self) -> None:
        data = json.dumps({**self.report, "updated": time.time()}).encode()
        atomic_write(self.cfg.data_dir / "liar.json", data, durable=False)  # read by the bench while written

    async def _admit(self, host: ControlHost) -> Any:
        eng: Any = getattr(self, "_engine", None)
        if eng is not None and not isinstance(eng, _Engine):
            self._engine = _Engine(eng, self)
        return await super()._admit(host)

    async def _run_task(self, host: ControlHost, task: Task) -> None:
        # honest first (what a spot check of the first sample sees), forged after; the hub steps
        # so often that a node rarely runs two tasks on one version, so per version would be never
        self.forging = self.results_sent > 0
        self.results_sent += 1
        rows = len(task.prompts) * task.group_size
        try:
            await super()._run_task(_Host(host, self, rows, task.task_id), task)  # type: ignore[arg-type]
        finally:
            self.forging = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--hub", required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = LiarNode(NodeConfig(hub=args.hub, data_dir=args.data_dir, threads=args.threads))

    async def run() -> int:
        return await node.run()

    try:
        return trio.run(run)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
