"""The broadcast's per-chunk trace (node.relay_trace) and the analysis of where its tail goes
(bench.broadcast_trace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from echo2.bench.broadcast_trace import tail_report
from echo2.learner_hub.planner import NodeInfo, plan_broadcast
from echo2.node import relay_trace
from echo2.protocol.net.relaydriver import RelayDriver
from echo2.protocol.relay import Relay


class _NoBytes:
    """A chunk source that has nothing (nothing is sent here: no link exists)."""

    async def encoded(self, version: int, index: int) -> tuple[int, bytes]:
        raise KeyError((version, index))

    async def full(self, version: int, index: int) -> bytes:
        raise KeyError((version, index))


def _plan():  # type: ignore[no-untyped-def]
    # 4 nodes, 2 stripes: stripe 0 hub -> n0 -> (n2 -> n3, n1); stripe 1 hub -> n1 -> (n3 -> n2, n0)
    plan = plan_broadcast(1, 8e6, [NodeInfo(f"n{i}", 8e6) for i in range(4)], 8, hub="hub")
    assert plan.parent == [{"n0": "hub", "n2": "n0", "n1": "n0", "n3": "n2"},
                           {"n1": "hub", "n3": "n1", "n0": "n1", "n2": "n3"}]
    return plan


def test_trace_records_verified_queued_and_sent_chunks(tmp_path: Path) -> None:
    plan = _plan()
    driver = RelayDriver(_NoBytes())
    path = str(tmp_path / "trace.txt")
    f = relay_trace.install(driver, path, "n0")
    relay = Relay("n0", plan, [bytes(32)] * 8)
    driver.start(1, relay)
    driver.act(relay.on_chunk_verified(0, now=0.0))  # stripe 0: to n2 and n1 (no links: failed, not requeued)
    driver.act(relay.on_chunk_verified(0, now=0.0))  # held already: no second rx line
    driver.act(relay.on_child_ack("n2", 0, now=0.1))
    f.write("123.4 rx 1")  # a torn last line
    f.close()
    evs = relay_trace.read(path)
    assert [(e[1], e[2], e[3], e[4]) for e in evs] == [
        ("me", 0, 0, "n0"), ("rx", 1, 0, "-"), ("q", 1, 0, "n2"), ("q", 1, 0, "n1"), ("tx", 1, 0, "n2")]
    assert all(a[0] <= b[0] for a, b in zip(evs, evs[1:], strict=False))  # one monotonic clock
    assert relay_trace.read(str(tmp_path / "none.txt")) == []


def test_tail_report_follows_the_last_chunk_and_splits_hops() -> None:
    plan = _plan()
    t_pub = 1000.0
    evs: dict[str, list[tuple[float, str, int, int, str]]] = {p: [] for p in ("hub", "n0", "n1", "n2", "n3")}
    # chunk i leaves the hub's queue at 0.1·i, reaches its root 0.2 later; every relay queues it
    # 0.01 after it verified it, and the child verifies it 0.1 after that
    for i in range(8):
        s = i % 2
        q_hub = 0.1 * i
        root = plan.children[s]["hub"][0]
        evs["hub"] += [(t_pub + q_hub, "q", 1, i, root), (t_pub + q_hub + 0.15, "tx", 1, i, root)]
        rx = {root: q_hub + 0.2}
        order = [root]
        while order:
            p = order.pop(0)
            evs[p].append((t_pub + rx[p], "rx", 1, i, "-"))
            for c in plan.children[s].get(p, []):
                evs[p].append((t_pub + rx[p] + 0.01, "q", 1, i, c))
                rx[c] = rx[p] + 0.11
                order.append(c)
    evs["n2"].append((t_pub + 5.0, "rx", 0, 7, "-"))  # another version: ignored
    names = {p: p for p in evs}
    lines = tail_report(evs, plan, t_pub, version=1, n_chunks=8, names=names, chunk_seconds=0.05, tail_chunks=2)
    assert lines[0].startswith("hub's last send done: n0 0.750, n1 0.850")
    # the last node: n2 (depth 3 in stripe 1), chunk 7: hub -> n1 -> n3 -> n2
    assert lines[1] == ("last node n2, its last chunk 7 (stripe 1): hub rx 0.000 q 0.700 -> n1 rx 0.900 q 0.910 "
                        "-> n3 rx 1.010 q 1.020 -> n2 rx 1.120")
    depth = {int(m.group(1)): m for ln in lines if (m := re.match(
        r"depth (\d): (\d+) hops .* wait median ([\d.]+) p90 ([\d.]+), xfer median ([\d.]+) p90 ([\d.]+) .*: 0.100\)", ln))}
    assert sorted(depth) == [1, 2, 3]
    assert float(depth[1].group(5)) == pytest.approx(0.2)  # hub queue -> root verified
    for d in (2, 3):
        assert float(depth[d].group(3)) == pytest.approx(0.01) and float(depth[d].group(5)) == pytest.approx(0.1)
    # last 2 chunks per stripe (4..7): depth 1 once per chunk, depth 2 twice (stripe 0: n2, n1; stripe 1: n3, n0)
    assert int(depth[1].group(2)) == 4 and int(depth[2].group(2)) == 8 and int(depth[3].group(2)) == 4
    assert lines[-2] == "finish per node (trace): 0.910 1.010 1.020 1.120"  # n1, n0, n3, n2
    # the hub's last send done at 0.850: chunk 7 still owed to all 4 (n1 verified it at 0.900),
    # chunk 6 to n2, n1 (0.910) and n3 (1.020), chunk 5 to n2 (0.920): 8, n2 3 of them;
    # (1.120 - 0.850) / 0.05 = 5.4 sends of the idle hub
    assert lines[-1] == ("at the hub's last send (0.850) nodes still lacked 8 chunks (most 3); the idle hub could "
                         "send 5.4 at full rate before the last node finished")


def test_tail_report_without_a_complete_node() -> None:
    plan = _plan()
    lines = tail_report({"n0": [(1.0, "rx", 1, 0, "-")]}, plan, 0.0, version=1, n_chunks=8, names={}, chunk_seconds=0.05)
    assert lines[-1] == "no node's trace holds every chunk"
