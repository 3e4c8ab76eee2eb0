"""node.state.json: written atomically, private to the volunteer, with the loop-lag figures."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import trio

from echo2.node.runtime import Node, NodeConfig
from echo2.protocol.identity import Identity


def test_state_file_is_atomic_private_and_reports_loop_lag(tmp_path: Path) -> None:
    hub = Identity.generate().peer_id
    node = Node(NodeConfig(hub=f"/ip4/127.0.0.1/tcp/9/p2p/{hub}", data_dir=tmp_path))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.loop_lag.run)
            await trio.sleep(0.25)
            time.sleep(0.3)  # a blocking call on the loop, as a stalled node would make
            await trio.sleep(0.25)
            nursery.cancel_scope.cancel()

    trio.run(main)
    node._write_state()
    path = tmp_path / "node.state.json"
    state = json.loads(path.read_text())
    assert state["peer_id"] == node.peer_id and state["hub"].endswith(hub)
    assert state["loop_lag_max_ms"] >= 150 and 0 <= state["loop_lag_p99_ms"] <= state["loop_lag_max_ms"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file() and "state" in p.name) == ["node.state.json"]
