"""The node applies its computing preferences (issue 19): a model over the memory cap is refused
with both numbers and the hub is told why the node is unavailable; a paused node hands its task
back and tells the hub, repeats it as its keepalive, and resumes by itself (real node, real
engine; the hub's side of the wire is a recorder, the machine's readings a source given to it)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from echo2.models import spec as ms
from echo2.models import statedict
from echo2.models.engine import TransformersEngine
from echo2.node.budget import ModelTooLarge
from echo2.node.prefs import Readings
from echo2.node.runtime import Node, NodeConfig
from echo2.node.versions import HeldVersion
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, NodePause, Result, Task, TaskDecline
from echo2.protocol.packedresult import PackedResult
from echo2.protocol.wire import DECLINE, PAUSE, RESULT

HUB = Identity.generate()


class HubWire:
    """Stands in for the network to the hub: keeps what the node sends, answers "ok"."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def request(self, peer: str, protocol: str, payload: bytes, **_kw: Any) -> bytes:
        kind = {DECLINE: TaskDecline, RESULT: (PackedResult, Result), PAUSE: NodePause}[protocol]
        self.sent.append((protocol, envelope.open_envelope(payload, kind, replay=None, max_size=1 << 26).message))
        return envelope.seal(HUB, ErrorReply(code="ok", message="noted"))


class Machine:
    """What the OS would say (the adapter boundary: the node's own SystemReader reads /proc)."""

    def __init__(self) -> None:
        self.load = 0.05

    def read(self, transfer_day_bytes: int = 0, transfer_month_bytes: int = 0) -> Readings:
        return Readings(other_cpu_load=self.load, transfer_day_bytes=transfer_day_bytes,
                        transfer_month_bytes=transfer_month_bytes)


def make_node(tmp_path: Path, **prefs: Any) -> Node:
    node = Node(NodeConfig(hub=f"/ip4/127.0.0.1/tcp/9/p2p/{HUB.peer_id}", data_dir=tmp_path, prefs=prefs))
    node._engine = TransformersEngine(device="cpu")
    return node


def version(v: int, hidden: int, heads: int) -> HeldVersion:
    """A version of a model of this size; its weights are a tiny model's (a model over the cap
    is refused from its config, before any weight is looked at: too large to build here)."""
    cj, arts = ms.artifacts_for(ms.tiny_config(hidden=hidden, layers=2, heads=heads), ms.tokenizer_json())
    torch.manual_seed(0)
    small = ms.model_from_config(ms.artifacts_for(ms.tiny_config(hidden=32, layers=2, heads=2), ms.tokenizer_json())[0])
    pv = statedict.pack_version(small.state_dict(), version=v, parent=None, model_config=cj, artifacts=arts)
    return HeldVersion(pv.manifest, pv.raw_chunks)


def test_model_over_the_memory_cap_is_refused_with_both_numbers_and_the_hub_is_told(tmp_path: Path) -> None:
    node = make_node(tmp_path, max_memory_MiB=16)
    wire = HubWire()

    async def main() -> None:
        with pytest.raises(ModelTooLarge) as err:
            await node._load(version(1, hidden=512, heads=8), 0.0)
        msg = err.value.message
        assert "8,5" in msg and "16.0 MiB" in msg, msg  # the parameters measured and the cap hit
        assert node.pauser.paused and node.pauser.current.code == "model_too_large"
        await node.pauser._tell_hub(wire)
        (proto, m), = wire.sent
        assert proto == PAUSE and m.paused and m.reason_code == "model_too_large" and "16.0 MiB" in m.reason
        # a version that fits ends it
        with trio.fail_after(60):
            await node._load(version(2, hidden=32, heads=2), 0.0)
        assert not node.pauser.paused
        await node.pauser._tell_hub(wire)
        assert wire.sent[-1][0] == PAUSE and not wire.sent[-1][1].paused

    trio.run(main)


def test_paused_node_hands_its_task_back_and_resumes(tmp_path: Path) -> None:
    node = make_node(tmp_path, cpu_ceiling_percent=50, check_every_s=0.05)
    machine = Machine()
    node.pauser.reader = machine
    wire = HubWire()

    def task(tid: str) -> Task:
        return Task(task_id=tid, node_id=node.peer_id, prompts=[[5, 6, 7]], group_size=2, max_new_tokens=3,
                    temperature=1.0, top_p=1.0, seed=5, min_version=2, max_version_lag=1, deadline=time.time() + 60)

    async def main() -> None:
        with trio.fail_after(60):
            await node._load(version(2, hidden=32, heads=2), 0.0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.pauser.run, wire)
                machine.load = 0.9  # another program takes the CPUs
                while not node.pauser.paused:
                    await trio.sleep(0.02)
                await node._run_task(wire, task("t-1"))  # a task it was running when the pause came
                while not any(p == PAUSE for p, _ in wire.sent):
                    await trio.sleep(0.02)
                assert "90%" in node.pauser.current.reason
                ran_paused = [p for p, _ in wire.sent]
                machine.load = 0.05
                with trio.fail_after(5):
                    await node.pauser.wait_running()  # resumes by itself
                await node._run_task(wire, task("t-2"))
                while not any(p == PAUSE and not m.paused for p, m in wire.sent):
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
        decl = [m for p, m in wire.sent if p == DECLINE]
        assert [(d.task_id, d.reason_code) for d in decl] == [("t-1", "paused")] and "90%" in decl[0].reason
        assert DECLINE in ran_paused
        assert [m.task_id for p, m in wire.sent if p == RESULT] == ["t-2"]
        pauses = [m.paused for p, m in wire.sent if p == PAUSE]
        assert pauses[0] is True and pauses[-1] is False
        assert node.pauser.pauses == 1 and node.stats.tasks_declined == 1

    trio.run(main)


def test_transfer_cap_stops_relaying_until_the_next_day(tmp_path: Path) -> None:
    node = make_node(tmp_path, max_daily_transfer_MB=0.001, check_every_s=0.05)
    node.pauser.reader = Machine()
    day = [datetime(2026, 12, 2, 23, 0).astimezone()]
    node.pauser.clock = lambda: day[0]
    node._hub_data_addr = "127.0.0.1:9"  # no hub there: the relay retries it, and serves peers meanwhile
    wire = HubWire()

    async def serving(relay: Any) -> bool:
        host, port = relay.data_addr.rsplit(":", 1)
        try:
            stream = await trio.open_tcp_stream(host, int(port))
        except OSError:
            return False
        await stream.aclose()
        return True

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(node._policy_downlink)
                first = node.relay
                assert await serving(first)
                nursery.start_soon(node.pauser.run, wire)
                node.pauser.count_bytes(1500)  # a result of 1.5 kB: over the 1 kB daily cap
                while node.pauser.current.code != "transfer_day":
                    await trio.sleep(0.02)
                assert "0.0015 MB of 0.001 MB" in node.pauser.current.reason
                while await serving(first):
                    await trio.sleep(0.05)
                day[0] += timedelta(hours=2)  # past midnight: the day's count starts again
                while node.relay is first or not await serving(node.relay):
                    await trio.sleep(0.05)
                assert not node.pauser.paused
                pauses = [m for p, m in wire.sent if p == PAUSE]
                assert pauses[0].reason_code == "transfer_day" and pauses[0].resume_at == datetime(2026, 12, 3).astimezone().timestamp()
                nursery.cancel_scope.cancel()

    trio.run(main)
