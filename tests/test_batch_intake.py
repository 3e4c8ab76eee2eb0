"""Batched intake on the hub (issue 20 item 2): a ResultBatch's accepted items are stored in one
transaction and share one signed receipt naming all their tasks, which a node verifies offline
and keeps once; a refused item gets its own reason; the rows stored are the lone path's. Real
hubs (tiny model; with ``intake_workers = 2`` real worker processes), real signed frames."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio
from test_intake_workers import admit, answer, make_hub

from echo2.learner_hub.dispatch_index import NodeIndex
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.receipts import make_batch_receipt
from echo2.learner_hub.rows import decode_groups
from echo2.node.receipts import (
    ReceiptBook,
    ReceiptError,
    check_receipt,
    read_records,
    summary,
    verify_offline,
)
from echo2.protocol import envelope
from echo2.protocol.batchmessages import BatchAck, ResultBatch
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Receipt, Task
from echo2.protocol.replay import ReplayGuard


def _hub_with_tasks(tmp_path: Path, workers: int, k: int) -> tuple[Hub, Identity, list[Task]]:
    hub = make_hub(tmp_path, workers, prompts_per_step=16)
    hub.dispatcher.config = dataclasses.replace(hub.dispatcher.config, max_in_flight_per_node=k)
    hub.dispatcher.index = NodeIndex(k)
    node = Identity.generate()
    admit(hub, node)
    st = hub.dispatcher.nodes[node.peer_id]
    st.claimed, st.rate = False, 0.01  # hub-timed (as after a first task): k tasks at once, not one on probation
    hub.nodes[node.peer_id].held_version = hub.learner.version
    hub._refill()
    hub._pump()
    box = hub.nodes[node.peer_id].mailbox
    tasks = [box.popleft() for _ in range(len(box))]
    assert len(tasks) == k
    return hub, node, tasks


def _rows(hub: Hub, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return hub.store.call_sync(lambda st: st._read(sql, args))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_is_stored_at_once_and_shares_one_receipt(tmp_path: Path, workers: int) -> None:
    hub, node, tasks = _hub_with_tasks(tmp_path, workers, 5)
    try:
        sealed = [envelope.seal(node, answer(t, node)) for t in tasks]
        again = envelope.seal(node, answer(tasks[0], node))  # the first task answered twice (a fresh nonce)
        items = [*sealed[:4], again, b"\x00not an envelope"]
        ack_env = trio.run(hub.on_results, node.peer_id, envelope.seal(node, ResultBatch(node_id=node.peer_id, results=items)))
        ack = envelope.open_envelope(ack_env, BatchAck, replay=None).message
        assert [v.accepted for v in ack.verdicts] == [True, True, True, True, False, False]
        # the refused items get their reasons: what the lone request would have answered
        assert (ack.verdicts[4].code, ack.verdicts[4].message) == ("meaning", "result refused: duplicate")
        assert ack.verdicts[5].code == "decode" and ack.verdicts[5].receipt == b""
        # one signature for the accepted four: the same envelope, naming each task, verifiable offline
        assert len({v.receipt for v in ack.verdicts[:4]}) == 1
        receipt, _at = verify_offline(ack.verdicts[0].receipt)
        assert receipt.task_ids == [t.task_id for t in tasks[:4]] and receipt.results == 4
        assert receipt.hub_id == hub.identity.peer_id and receipt.node_id == node.peer_id
        assert receipt.account_results == 4 and receipt.rollouts == sum(len(t.prompts) * t.group_size for t in tasks[:4])
        # the fifth alone: the lone path's receipt, whose account follows on
        lone = envelope.open_envelope(trio.run(hub.on_result, node.peer_id, sealed[4]), Receipt, replay=None).message
        assert lone.task_ids == [tasks[4].task_id] and lone.results == 1 and lone.account_results == 5
        assert receipt.tokens + lone.tokens == lone.account_tokens
        hub.store.flush()
        payloads = {p.task_id: p.payload for p in hub.store.call_sync(lambda st: st.pending_results())}
        got = [(*r, payloads[r[0]]) for r in _rows(hub, "SELECT task_id, node, version, accepted, reason, tokens,"
                                                         " rollouts FROM results WHERE accepted = 1 ORDER BY id")]
        assert [r[0] for r in got] == [t.task_id for t in tasks]
        # batched or alone, a result's row says the same (tasks alike: same counts) and its payload
        # holds the completions as sent
        assert {r[1:7] for r in got} == {(node.peer_id, 0, 1, "accepted", receipt.tokens // 4, receipt.rollouts // 4)}
        for row, t in zip(got, tasks, strict=True):
            groups = decode_groups(row[7])
            assert [g.prompt_ids for g in groups] == [list(p) for p in t.prompts]
            assert all(s.token_ids == list(t.prompts[i][-t.max_new_tokens:])[: t.max_new_tokens - (j % 2)]
                       for i, g in enumerate(groups) for j, s in enumerate(g.samples))
        entries = _rows(hub, "SELECT task_id FROM ledger_entries WHERE peer_id = ? ORDER BY at", node.peer_id)
        assert sorted(e[0] for e in entries) == sorted(t.task_id for t in tasks)
        ledger = _rows(hub, "SELECT accepted_results, accepted_tokens FROM ledger WHERE peer_id = ?", node.peer_id)
        assert ledger == [(5, lone.account_tokens)]
        assert _rows(hub, "SELECT reason FROM results WHERE accepted = 0") == [("duplicate",)]
        # the tasks one pump issued went in together (record_tasks); each accepted one is closed done
        status = dict(_rows(hub, "SELECT task_id, status FROM tasks WHERE node = ?", node.peer_id))
        assert {t.task_id: status.get(t.task_id) for t in tasks} == {t.task_id: "done" for t in tasks}
    finally:
        hub.intake_pool.close()
        hub.store.close()


def test_node_keeps_a_batch_receipt_once(tmp_path: Path) -> None:
    hub_id, me = Identity.generate(), Identity.generate()
    account = dataclasses.make_dataclass("Row", ["accepted_results", "accepted_rollouts", "accepted_tokens", "cost_micro"])
    r = make_batch_receipt(hub_id.peer_id, me.peer_id, ["t1", "t2", "t3"], rollouts=24, tokens=1536, price_micro=5,
                           accepted_at=1000.0, account=account(3, 24, 1536, 7))  # type: ignore[arg-type]
    sealed = envelope.seal(hub_id, r, ttl_s=300)
    book = ReceiptBook(tmp_path)
    replay = ReplayGuard()

    async def main() -> None:
        for tid in ("t1", "t2", "t3", "t4"):  # one verdict per item of the batch; t4 is not in it
            await book.accepted(sealed, hub_peer=hub_id.peer_id, me=me.peer_id, task_id=tid, replay=replay)

    trio.run(main)
    records, tail = read_records(tmp_path / "receipts.bin")
    assert book.kept == 1 and len(records) == 1 and tail == "" and records[0].receipt == r
    credit = summary(tmp_path)["hubs"][hub_id.peer_id]
    assert (credit["results"], credit["tokens"], credit["complete"]) == (3, 1536, True)
    with pytest.raises(ReceiptError, match="does not name task t4"):  # not that task's receipt
        check_receipt(sealed, hub_peer=hub_id.peer_id, me=me.peer_id, task_id="t4", replay=None)


def test_whole_result_checks_answer_as_the_per_completion_checks() -> None:
    """A packed result's completions checked as one array give the per-completion loop's
    verdict and message, whichever completion is bad and however (random faults, fixed seed)."""
    import random

    import numpy as np

    from echo2.learner_hub.intake_check import Limits, _completion_problem, completions_problem
    from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

    rng = random.Random(7)
    lim = Limits(vocab_size=100, max_new_tokens=6, stop_ids=frozenset({2}))
    stop_arr = np.array([2], dtype=np.int64)
    node_id = Identity.generate().peer_id
    faults = 0
    for _ in range(400):
        comps = []
        for i in range(6):
            n = rng.randint(0, 6)
            ids = [rng.randint(3, 99) for _ in range(n)]
            lps = [-0.5] * n
            roll = rng.random()
            if roll < 0.08:
                ids.append(5)  # too long when n is 6
                lps.append(-0.5)
            elif roll < 0.16 and ids:
                ids[rng.randrange(len(ids))] = 100 + rng.randint(0, 5)  # outside the vocabulary
            elif roll < 0.24 and ids:
                ids[rng.randrange(len(ids))] = 2  # a stop token, maybe not the last
            elif roll < 0.32 and lps:
                lps[rng.randrange(len(lps))] = rng.choice([float("nan"), 0.5, -1e5, float("-inf")])
            comps.append(PackedCompletion(i // 2, pack_ids(ids), pack_logprobs(lps), "length"))
        r = PackedResult(task_id="t", task_hash=bytes(32), node_id=node_id, version=0, completions=comps,
                         started_at=0.0, gen_seconds=0.0, tokens=0)
        expected = next((p for c in comps if (p := _completion_problem(c, lim, stop_arr)) is not None), None)
        faults += expected is not None
        assert completions_problem([2, 2, 2], r, lim, stop_arr) == expected
    assert 100 < faults < 400  # both verdicts were exercised


def _flip_signature(sealed: bytes) -> bytes:
    at = sealed.rindex(b"\xa1s\xc4\x40") + 4  # the envelope's signature field (seal's layout)
    return sealed[:at] + bytes([sealed[at] ^ 1]) + sealed[at + 1:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_signature_covers_its_items_and_their_signer_must_be_the_node(tmp_path: Path, workers: int) -> None:
    """The batch's signature, verified over its raw bytes, authenticates each item's bytes, so an
    item's own signature is not checked a second time (55 us a small result); its signer must
    still be the node, and a lone result's signature is still checked."""
    hub, node, tasks = _hub_with_tasks(tmp_path, workers, 3)
    other = Identity.generate()
    try:
        flipped = _flip_signature(envelope.seal(node, answer(tasks[0], node)))
        with pytest.raises(Exception) as lone:  # alone, nothing covers it: the signature is checked
            trio.run(hub.on_result, node.peer_id, flipped)
        assert getattr(lone.value, "code", "") == "bad_signature"
        # by another key: a valid signature, but not the node's (its peer ID is the node's own name)
        foreign = envelope.seal(other, dataclasses.replace(answer(tasks[1], node)))
        items = [flipped, foreign, envelope.seal(node, answer(tasks[2], node))]
        ack_env = trio.run(hub.on_results, node.peer_id, envelope.seal(node, ResultBatch(node_id=node.peer_id, results=items)))
        ack = envelope.open_envelope(ack_env, BatchAck, replay=None).message
        assert [v.accepted for v in ack.verdicts] == [True, False, True], ack.verdicts
        assert ack.verdicts[1].code == "signer_not_allowed"
        # a batch whose own signature is bad is refused whole, its items unread
        bad_batch = _flip_signature(envelope.seal(node, ResultBatch(node_id=node.peer_id, results=items[1:2])))
        with pytest.raises(Exception) as whole:
            trio.run(hub.on_results, node.peer_id, bad_batch)
        assert getattr(whole.value, "code", "") == "bad_signature"
    finally:
        hub.intake_pool.close()
        hub.store.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_is_refused_whole_when_replayed_misnamed_or_foreign(tmp_path: Path, workers: int) -> None:
    """With workers the batch frame is opened in one of them and only its replay step is the hub's:
    the answers are those of the hub opening it itself (workers 0). A batch sent again is a
    replay, refused whole, its items' results counted once; one naming another node, or signed by
    a key that is not the node's, is refused whole too."""
    hub, node, tasks = _hub_with_tasks(tmp_path, workers, 2)
    other = Identity.generate()
    try:
        items = [envelope.seal(node, answer(t, node)) for t in tasks]

        def refused(frame: bytes) -> str:
            with pytest.raises(Exception) as exc:
                trio.run(hub.on_results, node.peer_id, frame)
            return str(getattr(exc.value, "code", repr(exc.value)))

        misnamed = envelope.seal(node, ResultBatch(node_id=other.peer_id, results=items))
        foreign = envelope.seal(other, ResultBatch(node_id=node.peer_id, results=items))
        assert refused(misnamed) == "meaning"
        assert refused(foreign) == "signer_not_allowed"
        batch = envelope.seal(node, ResultBatch(node_id=node.peer_id, results=items))
        ack = envelope.open_envelope(trio.run(hub.on_results, node.peer_id, batch), BatchAck, replay=None).message
        assert [v.accepted for v in ack.verdicts] == [True, True]
        assert refused(batch) == "replay"
        assert hub.nodes[node.peer_id].tasks_done == 2
        assert len(_rows(hub, "SELECT task_id FROM results WHERE accepted = 1")) == 2
    finally:
        hub.intake_pool.close()
        hub.store.close()


def test_a_batch_counts_against_the_pool_bounds_by_its_bytes() -> None:
    from echo2.learner_hub.intake_pool import BATCH_BYTES_PER_RESULT, batch_units
    from echo2.protocol.batchmessages import MAX_BATCH_RESULTS

    assert batch_units(0) == 1
    assert batch_units(BATCH_BYTES_PER_RESULT) == 1
    assert batch_units(BATCH_BYTES_PER_RESULT + 1) == 2
    assert batch_units(8 * 6_200) == 13  # eight small results: a node's two batches fit its bound
    assert batch_units(64 * 1024 * 1024) == MAX_BATCH_RESULTS
