"""Intake workers (issue 20 item 4): ``intake_workers = 2`` judges results exactly as the hub
process does (``= 0``), a reward function that sleeps does not hold the hub's loop, a worker that
dies costs one ``busy`` answer (the node resends) and a restart, and the hub's stop leaves no
worker process behind. Real hubs (tiny model), real signed frames, real spawned processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.learner_hub.intake_pool import IntakeBusy
from echo2.learner_hub.store import HubStore
from echo2.looplag import LoopLag
from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest, Task, task_hash
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

SLEEP_S = 1.0


def slow_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """An operator's slow reward function (module level: workers load it by name)."""
    time.sleep(float(os.environ.get("ECHO2_TEST_REWARD_SLEEP_S", "0")))
    return [0.5] * len(completions)


def counted_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """Sleeps, and notes each call (one line per call, in the file the test names)."""
    with open(os.environ["ECHO2_TEST_REWARD_LOG"], "a") as f:
        f.write(f"{len(completions)}\n")
    time.sleep(float(os.environ.get("ECHO2_TEST_REWARD_SLEEP_S", "0")))
    return [0.5] * len(completions)


def make_hub(tmp_path: Path, workers: int, **kw: Any) -> Hub:
    return Hub(small_hub_cfg(tmp_path / f"hub{workers}", intake_workers=workers, **kw))


def admit(hub: Hub, node: Identity) -> None:
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
    trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))


def take_task(hub: Hub, node: Identity) -> Task:
    hub.nodes[node.peer_id].held_version = hub.learner.version
    hub._refill()
    hub._pump()
    return envelope.open_envelope(hub.outbox.seal(hub.nodes[node.peer_id].mailbox.popleft()), Task, replay=None).message


def answer(task: Task, node: Identity, tokens: list[int] | None = None) -> PackedResult:
    """Completions that copy each prompt's last tokens (the copy task's reward varies with them)."""
    comps = []
    for i, p in enumerate(task.prompts):
        for j in range(task.group_size):
            ids = tokens if tokens is not None else [t for t in p[-task.max_new_tokens:]][: task.max_new_tokens - (j % 2)]
            comps.append(PackedCompletion(i, pack_ids(ids), pack_logprobs([-0.5] * len(ids)), "length"))
    return PackedResult(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0,
                        completions=comps, started_at=time.time(), gen_seconds=0.1, tokens=0)


def outcome(hub: Hub, peer: str, data: bytes) -> tuple[str, Any]:
    try:
        trio.run(hub.on_result, peer, data)
    except Echo2Error as exc:
        return "refused", exc.code
    return "accepted", None


def scenario(hub: Hub, node: Identity, stranger: Identity) -> list[tuple[str, Any]]:
    """The same sequence of frames against one hub: what it answered to each, and the rewards
    of the rows it buffered."""
    out = []
    vocab = hub.tok.vocab_size
    t1 = take_task(hub, node)
    honest = envelope.seal(node, answer(t1, node))
    tampered = bytearray(envelope.seal(node, answer(t1, node)))
    tampered[len(tampered) // 2] ^= 0x01  # one bit of the signed payload
    out.append(outcome(hub, node.peer_id, bytes(tampered)))
    out.append(outcome(hub, node.peer_id, envelope.seal(stranger, answer(t1, stranger))))  # signed by another
    out.append(outcome(hub, node.peer_id, honest))  # accepted
    out.append(outcome(hub, node.peer_id, honest))  # the same frame again: a replay
    out.append(outcome(hub, node.peer_id, envelope.seal(node, answer(t1, node))))  # sealed afresh: a duplicate
    # what the store keeps of the accepted rows (an intake worker encodes it; the hub otherwise)
    stored = trio.run(hub.store.call, HubStore.pending_results)
    out.append(("stored", [p.payload for p in stored]))
    rewards = sorted(round(s.reward, 6) for _, (_tid, g) in hub.buffer.take_batch(hub.learner.version, len(hub.buffer)) or []
                     for s in g.samples)
    out.append(("rewards", rewards))  # before the ban below drops its rows
    t2 = take_task(hub, node)
    out.append(outcome(hub, node.peer_id, envelope.seal(node, answer(t2, node, tokens=[vocab + 3]))))  # forged: punished
    return out


def test_verdicts_equal_with_and_without_workers(tmp_path: Path) -> None:
    node, stranger = Identity.generate(), Identity.generate()
    results = []
    for workers in (0, 2):
        hub = make_hub(tmp_path, workers)
        try:
            admit(hub, node)
            results.append(scenario(hub, node, stranger))
            assert hub.intake_pool.checked == 6
        finally:
            hub.intake_pool.close()
            hub.store.close()
    inline, pooled = results
    assert pooled == inline
    codes = [o for o in inline if o[0] == "refused"]
    assert [c for _, c in codes] == ["bad_signature", "signer_not_allowed", "replay", "meaning", "meaning"]
    assert inline[2] == ("accepted", None) and len(inline[6][1]) >= 4  # its rows were scored and buffered
    assert inline[5][0] == "stored" and len(inline[5][1]) == 1 and len(inline[5][1][0]) > 100


def test_sleeping_reward_does_not_block_loop_and_shutdown_leaves_no_process(tmp_path: Path) -> None:
    os.environ["ECHO2_TEST_REWARD_SLEEP_S"] = str(SLEEP_S)
    hub = make_hub(tmp_path, 2, reward_funcs=["test_intake_workers:slow_reward"])
    pids = hub.intake_pool.pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    try:
        nodes = [Identity.generate() for _ in range(2)]
        for n in nodes:
            admit(hub, n)
        tasks = [take_task(hub, n) for n in nodes]
        frames = [(n.peer_id, envelope.seal(n, answer(t, n))) for n, t in zip(nodes, tasks, strict=True)]
        lag = LoopLag(interval_s=0.01)
        done: list[str] = []

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lag.run)
                with trio.fail_after(60):
                    async with trio.open_nursery() as inner:
                        for peer, data in frames:
                            inner.start_soon(_send, hub, peer, data, done)
                nursery.cancel_scope.cancel()

        t0 = time.monotonic()
        trio.run(main)
        assert done == ["accepted", "accepted"]
        assert time.monotonic() - t0 >= SLEEP_S  # the reward function did sleep ...
        # ... and the loop kept ticking every 10 ms meanwhile: a reward call on the loop would have
        # stalled it for the whole second (the bench shows p99 <= 20 ms; on this shared 2-core
        # machine the scheduler alone sometimes delays a tick by more, so the test asserts the stall)
        assert lag.samples >= 50 and lag.max_s < SLEEP_S / 2
        assert hub.rewards.scored == sum(len(t.prompts) * t.group_size for t in tasks)  # counted in the hub's status as if scored here
    finally:
        hub.intake_pool.close()
        hub.store.close()
        os.environ.pop("ECHO2_TEST_REWARD_SLEEP_S", None)
    assert not any(_alive(p) for p in pids)


def test_results_waiting_on_a_busy_worker_are_scored_together(tmp_path: Path) -> None:
    """Four nodes' results reach one worker whose reward sleeps: the first is scored alone, the
    three that queued meanwhile go in the worker's next request and one reward call (not one
    call, and one sleep, each), and every one is accepted with its own verdict."""
    log = tmp_path / "calls.txt"
    os.environ["ECHO2_TEST_REWARD_SLEEP_S"], os.environ["ECHO2_TEST_REWARD_LOG"] = "0.5", str(log)
    hub = make_hub(tmp_path, 1, reward_funcs=["test_intake_workers:counted_reward"])
    try:
        nodes = [Identity.generate() for _ in range(4)]
        for n in nodes:
            admit(hub, n)
        tasks = [take_task(hub, n) for n in nodes]
        frames = [(n.peer_id, envelope.seal(n, answer(t, n))) for n, t in zip(nodes, tasks, strict=True)]
        bad = Identity.generate()  # a frame signed by a stranger rides along and is refused alone
        frames.append((nodes[0].peer_id, envelope.seal(bad, answer(tasks[0], bad))))
        done: list[str] = []

        async def main() -> None:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for peer, data in frames:
                        nursery.start_soon(_send_or_refuse, hub, peer, data, done)
                        await trio.sleep(0.05)  # the first is in the worker before the rest arrive

        trio.run(main)
        assert sorted(done) == ["accepted"] * 4 + ["signer_not_allowed"]
        per_task = tasks[0].group_size * len(tasks[0].prompts)
        calls = [int(x) for x in log.read_text().split()]
        assert calls == [per_task, 3 * per_task]
        assert hub.rewards.scored == 4 * per_task
    finally:
        hub.intake_pool.close()
        hub.store.close()
        os.environ.pop("ECHO2_TEST_REWARD_SLEEP_S", None)
        os.environ.pop("ECHO2_TEST_REWARD_LOG", None)


async def _send_or_refuse(hub: Hub, peer: str, data: bytes, done: list[str]) -> None:
    try:
        await hub.on_result(peer, data)
    except Echo2Error as exc:
        done.append(exc.code)
        return
    done.append("accepted")


async def _send(hub: Hub, peer: str, data: bytes, done: list[str]) -> None:
    await hub.on_result(peer, data)
    done.append("accepted")


def test_worker_death_refused_as_busy_then_restarted(tmp_path: Path) -> None:
    os.environ["ECHO2_TEST_REWARD_SLEEP_S"] = str(SLEEP_S)
    hub = make_hub(tmp_path, 1, reward_funcs=["test_intake_workers:slow_reward"])
    try:
        node = Identity.generate()
        admit(hub, node)
        task = take_task(hub, node)
        pid = hub.intake_pool.pids()[0]

        async def main() -> str:
            async def kill_soon() -> None:
                await trio.sleep(SLEEP_S / 2)  # the worker is inside the reward function now
                os.kill(pid, signal.SIGKILL)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                with trio.fail_after(60):
                    try:
                        await hub.on_result(node.peer_id, envelope.seal(node, answer(task, node)))
                    except IntakeBusy as exc:
                        return exc.message
            return "accepted"

        msg = trio.run(main)
        assert "died" in msg and "send the result again" in msg
        assert hub.intake_pool.restarts == 1 and hub.intake_pool.pids()[0] != pid
        # the node resends (a fresh seal, as node/delivery.py does): the restarted worker takes it
        assert outcome(hub, node.peer_id, envelope.seal(node, answer(task, node))) == ("accepted", None)
        assert hub.dispatcher.stats.accepted == 1
    finally:
        hub.intake_pool.close()
        hub.store.close()
        os.environ.pop("ECHO2_TEST_REWARD_SLEEP_S", None)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_lambda_reward_refused_with_workers(tmp_path: Path) -> None:
    from echo2.learner_hub.config import ConfigError

    with pytest.raises(ConfigError, match="by name"):
        make_hub(tmp_path, 1, reward_funcs=[lambda completions, **_: [0.0] * len(completions)])


def test_per_peer_and_per_worker_bounds(tmp_path: Path) -> None:
    """Hostile input is bounded before any work: a peer with ``per_peer`` results in the pool
    gets ``busy`` for the next, and so does anyone once every worker's queue is full."""
    from echo2.learner_hub.intake_worker import CheckContext

    hub = make_hub(tmp_path, 1)
    pool = hub.intake_pool

    async def burst(peers: list[str]) -> list[str]:
        got: list[str] = []

        async def one(peer: str) -> None:
            try:
                await pool.check(b"\x00" * 64, CheckContext(peer, {}, 0, 10))
            except Echo2Error as exc:
                got.append(exc.code)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for peer in peers:  # all enter the pool before the worker can answer one
                    nursery.start_soon(one, peer)
        return sorted(got)

    try:
        pool.per_peer, pool.per_worker = 2, 10
        assert trio.run(burst, ["a", "a", "a"]) == ["busy", "decode", "decode"]
        assert pool.refused == {"per_peer": 1}
        pool.per_peer, pool.per_worker = 10, 2
        assert trio.run(burst, ["a", "b", "c"]) == ["busy", "decode", "decode"]
        assert pool.refused == {"per_peer": 1, "queue_full": 1}
    finally:
        pool.close()
        hub.store.close()


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_swarm_trains_with_intake_workers_and_leaves_none_behind(tmp_path: Path) -> None:
    """A real swarm (hub and node processes on 127.0.0.1, tiny model) with ``intake_workers = 2``:
    the node's results are accepted through the workers, the hub trains its steps, and once the
    hub has stopped none of its intake workers is left."""
    from echo2.bench.swarm import LocalSwarm
    from echo2.learner_hub.config import HubConfig

    cfg = HubConfig(task="copy", steps=3, prompts_per_step=2, group_size=4, max_new_tokens=4, staleness=1, seed=0,
                    exit_when_done=True, intake_workers=2)
    workers: set[int] = set()
    with LocalSwarm(tmp_path, cfg, n_nodes=1) as swarm:
        swarm.start()
        assert swarm.hub is not None
        hub_pid = swarm.hub.pid

        def watch(_st: dict[str, Any]) -> None:
            workers.update(p for p in _children(hub_pid) if "intake_worker" in _cmdline(p))

        st = swarm.wait(240, on_status=watch)
        assert st is not None and st.get("final"), (tmp_path / "hub" / "hub.log").read_text()[-3000:]
        assert st["results_accepted"] >= 3 and st["step"] == 3
        swarm.hub.wait(timeout=60)
    assert len(workers) == 2
    assert not any(_alive(p) for p in workers)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_worker_reply_read_whole_whatever_its_pieces() -> None:
    """The hub's read of a worker's reply: its length split from its body, a body far larger than
    one receive, a second reply straight after; EOF mid-body is None; a size beyond MAX_REPLY is
    refused before anything is allocated for it."""
    import socket
    import struct
    import threading
    import time

    import trio

    from echo2.learner_hub.intake_pool import MAX_REPLY, _read_reply

    big = bytes(range(256)) * 4096  # 1 MiB
    small = b"ok"

    def writer(s: socket.socket) -> None:
        s.sendall(struct.pack("<I", len(big))[:2])
        time.sleep(0.05)
        s.sendall(struct.pack("<I", len(big))[2:] + big[:1000])
        time.sleep(0.05)
        s.sendall(big[1000:])
        s.sendall(struct.pack("<I", len(small)) + small)

    async def main() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        t = threading.Thread(target=writer, args=(b,))
        t.start()
        with trio.fail_after(20):
            assert await _read_reply(a) == big
            assert await _read_reply(a) == small
        t.join()
        b.sendall(struct.pack("<I", 10) + b"abc")
        b.close()
        with trio.fail_after(20):
            assert await _read_reply(a) is None  # the worker died mid-reply
        a.close()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.sendall(struct.pack("<I", MAX_REPLY + 1))
        with trio.fail_after(20), pytest.raises(OSError, match="at most"):
            await _read_reply(a)
        a.close()
        b.close()

    trio.run(main)
