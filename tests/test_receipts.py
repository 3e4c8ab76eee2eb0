"""Issue 19, proof of contribution: the hub answers an accepted result with a signed receipt; the node
keeps it, sums it into credit per hub and day, and verifies it offline, refusing any changed byte.
(A real hub and model; the hub's handler is called directly, as in test_hub_results.)"""

from __future__ import annotations

import json
import sqlite3
import time
from functools import partial
from pathlib import Path

import pytest
import trio
from hubkit import small_hub_cfg
from test_hub_results import admit, run_task, take_task

from echo2.cli import main
from echo2.learner_hub.hub import Hub
from echo2.node.receipts import (
    RECEIPTS_FILE,
    ReceiptBook,
    ReceiptError,
    check_receipt,
    check_statement,
    read_records,
    summary,
)
from echo2.protocol import envelope
from echo2.protocol.errors import BadSignature, Echo2Error, MeaningError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, NodePause, Receipt


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Hub, Identity, list[bytes], Path]:
    """Two accepted results of one node and one refused duplicate, kept as a node keeps them."""
    hub = Hub(small_hub_cfg(tmp_path_factory.mktemp("hub")))
    node = Identity.generate()
    assert admit(hub, node).admitted
    node_dir = tmp_path_factory.mktemp("node")
    book = ReceiptBook(node_dir)
    replies = []
    for _ in range(2):
        task = take_task(hub, node)
        result = run_task(hub, node, task)
        reply = trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
        replies.append(reply)
        trio.run(partial(book.accepted, reply, hub_peer=hub.identity.peer_id, me=node.peer_id, task_id=task.task_id,
                         replay=envelope.ReplayGuard()))
    with pytest.raises(MeaningError) as refusal:
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    trio.run(lambda: book.refused(hub_peer=hub.identity.peer_id, task_id=task.task_id, code=refusal.value.code,
                                  reason=refusal.value.message))
    hub.store.close()
    assert book.kept == 2
    return hub, node, replies, node_dir


def test_receipt_states_the_hubs_figures(run: tuple[Hub, Identity, list[bytes], Path]) -> None:
    hub, node, replies, node_dir = run
    with sqlite3.connect(Path(hub.cfg.dir) / "hub.sqlite") as db:
        ledger_entries = {t: (ro, to, p) for t, ro, to, p in db.execute(
            "SELECT task_id, rollouts, tokens, price_micro FROM ledger_entries WHERE peer_id = ?", (node.peer_id,))}
    receipts = [envelope.open_envelope(r, Receipt, replay=None).message for r in replies]
    # one receipt per ledger entry, with the same task, rollouts, tokens and price
    assert {r.task_ids[0]: (r.rollouts, r.tokens, r.price_micro) for r in receipts} == ledger_entries
    assert all(r.hub_id == hub.identity.peer_id and r.node_id == node.peer_id for r in receipts)
    # the account figures run with the ledger: the last receipt states the whole account
    assert [r.account_results for r in receipts] == [1, 2]
    row = hub.ledger.row(node.peer_id, receipts[-1].accepted_at)
    assert row is not None
    assert (receipts[-1].account_tokens, receipts[-1].account_rollouts) == (row.accepted_tokens, row.accepted_rollouts)


def test_credit_sums_equal_the_hub_ledger(run: tuple[Hub, Identity, list[bytes], Path]) -> None:
    hub, node, _replies, node_dir = run
    s = summary(node_dir)
    assert s["verified"] == s["receipts"] == 2 and not s["refused"]
    c = s["hubs"][hub.identity.peer_id]
    with sqlite3.connect(Path(hub.cfg.dir) / "hub.sqlite") as db:
        results, rollouts, tokens = db.execute(
            "SELECT accepted_results, accepted_rollouts, accepted_tokens FROM ledger WHERE peer_id = ?", (node.peer_id,)
        ).fetchone()
    assert (c["results"], c["rollouts"], c["tokens"]) == (results, rollouts, tokens) and tokens > 0
    assert c["complete"]
    assert sum(d["tokens"] for d in c["days"].values()) == tokens
    # the refused duplicate is shown with the hub's reason
    assert s["rejected_results"] == 1 and list(s["rejected_by_reason"]) == ["result refused: duplicate"]


def test_verify_accepts_the_run_and_refuses_any_changed_byte(run: tuple[Hub, Identity, list[bytes], Path],
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _hub, _node, _replies, node_dir = run
    assert main(["node", "receipts", "--verify", "--data-dir", str(node_dir)]) == 0
    assert "2 of 2 receipts verified, 0 refused" in capsys.readouterr().out
    data = (node_dir / RECEIPTS_FILE).read_bytes()
    records, tail = read_records(node_dir / RECEIPTS_FILE)
    first = records[1]  # the last record: a change anywhere in it must not pass
    start, end = first.offset, first.offset + 4 + len(first.raw)
    for i in range(start, end):
        for flip in (0x01,):
            bad = bytearray(data)
            bad[i] ^= flip
            (tmp_path / RECEIPTS_FILE).write_bytes(bytes(bad))
            got, tail = read_records(tmp_path / RECEIPTS_FILE)
            ok = [r for r in got if r.receipt is not None]
            assert len(ok) < 2, f"byte {i - start} of a record changed (^{flip:#x}) and every receipt still verified"
    # the command says which record and why, and fails
    bad = bytearray(data)
    bad[start + 4 + len(first.raw) // 2] ^= 0x01
    (tmp_path / RECEIPTS_FILE).write_bytes(bytes(bad))
    assert main(["node", "receipts", "--verify", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 receipts verified, 1 refused" in out and f"REFUSED record at offset {start}" in out


def test_node_checks_the_reply_online(run: tuple[Hub, Identity, list[bytes], Path]) -> None:
    hub, node, replies, _ = run
    reply = replies[0]
    task_id = envelope.open_envelope(reply, Receipt, replay=None).message.task_ids[0]
    hub_id = hub.identity.peer_id
    r = check_receipt(reply, hub_peer=hub_id, me=node.peer_id, task_id=task_id, replay=None)
    assert r is not None and r.tokens > 0
    with pytest.raises(ReceiptError, match="another node"):
        check_receipt(reply, hub_peer=hub_id, me=Identity.generate().peer_id, task_id=task_id, replay=None)
    with pytest.raises(ReceiptError, match="does not name task"):
        check_receipt(reply, hub_peer=hub_id, me=node.peer_id, task_id="other", replay=None)
    with pytest.raises(Echo2Error):  # signed by someone else than the hub we work for
        check_receipt(reply, hub_peer=node.peer_id, me=node.peer_id, task_id=task_id, replay=None)
    # a receipt naming one hub but signed by another key is refused online and offline
    liar = Identity.generate()
    forged = envelope.seal(liar, envelope.open_envelope(reply, Receipt, replay=None).message)
    with pytest.raises(ReceiptError, match="signed by"):
        check_receipt(forged, hub_peer=liar.peer_id, me=node.peer_id, task_id=task_id, replay=None)
    bad = bytearray(reply)
    bad[-30] ^= 1  # inside the signature
    with pytest.raises(BadSignature):
        check_receipt(bytes(bad), hub_peer=hub_id, me=node.peer_id, task_id=task_id, replay=None)
    # a hub from before receipts answers a plain "accepted": nothing to keep, no error
    plain = envelope.seal(hub.identity, ErrorReply(code="ok", message="accepted"))
    assert check_receipt(plain, hub_peer=hub_id, me=node.peer_id, task_id=task_id, replay=None) is None


def test_status_shows_credit_and_refusals(run: tuple[Hub, Identity, list[bytes], Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    hub, node, _, node_dir = run
    (node_dir / "node.state.json").write_text(json.dumps({"peer_id": node.peer_id, "updated": 0}))
    assert main(["node", "status", "--data-dir", str(node_dir)]) == 0
    out = capsys.readouterr().out
    assert f"hub {hub.identity.peer_id}: credit $" in out and "2 results" in out
    assert "rejected      1 results" in out and "result refused: duplicate" in out
    assert main(["node", "status", "--json", "--data-dir", str(node_dir)]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["receipts"]["hubs"][hub.identity.peer_id]["results"] == 2


def test_a_pause_is_answered_with_a_statement_so_credit_equals_the_ledger(tmp_path: Path) -> None:
    """The ledger bills active time, so time after a node's last accepted result is billed too: a
    pause (or the goodbye of a stopping node) stops the billing and the hub answers with a signed
    statement of the account, which the node keeps once. Its credit is then the ledger's figure."""
    hub = Hub(small_hub_cfg(tmp_path / "hub"))
    node = Identity.generate()
    assert admit(hub, node).admitted
    book, me, hub_peer = ReceiptBook(tmp_path), node.peer_id, hub.identity.peer_id
    task = take_task(hub, node)
    reply = trio.run(hub.on_result, me, envelope.seal(node, run_task(hub, node, task)))
    trio.run(partial(book.accepted, reply, hub_peer=hub_peer, me=me, task_id=task.task_id, replay=envelope.ReplayGuard()))
    after_result = summary(tmp_path)["hubs"][hub_peer]["credit_micro_usd"]
    time.sleep(0.3)  # still active, still billed (0.1 $/h)
    pause = NodePause(peer_id=me, paused=True, reason_code="leaving", reason="the node is stopping", resume_at=0.0)
    for _ in range(3):  # a paused node repeats its pause as its keepalive: the same account is kept once
        reply = trio.run(hub.on_pause, me, envelope.seal(node, pause))
        trio.run(partial(book.statement, reply, hub_peer=hub_peer, me=me, replay=envelope.ReplayGuard()))
    row = hub.ledger.row(me, time.time() + 3600)
    hub.store.close()
    assert row is not None and not row.active  # billing stopped at the pause: the figure no longer moves
    s = summary(tmp_path)
    c = s["hubs"][hub_peer]
    assert s["verified"] == s["receipts"] == 2 and (c["receipts"], c["statements"]) == (1, 1)
    assert c["credit_micro_usd"] == row.cost_micro > after_result
    assert (c["results"], c["tokens"]) == (row.accepted_results, row.accepted_tokens) and c["complete"]
    # a statement is checked like a receipt: one that names tasks is not a statement
    with pytest.raises(ReceiptError):
        check_statement(replies_of(hub, node, 1)[0], hub_peer=hub_peer, me=me, replay=None)


def replies_of(hub: Hub, node: Identity, n: int) -> list[bytes]:
    """``n`` sealed receipts of the hub's key for ``node`` (as a hub would answer results)."""
    r = Receipt(hub_id=hub.identity.peer_id, node_id=node.peer_id, task_ids=["t"], results=1, rollouts=1, tokens=1,
                price_micro=0, accepted_at=time.time(), account_results=1, account_rollouts=1, account_tokens=1,
                account_cost_micro=0)
    return [envelope.seal(hub.identity, r) for _ in range(n)]


def test_receipt_schema_statement_rules() -> None:
    base = dict(hub_id="h", node_id="n", price_micro=0, accepted_at=1.0, account_results=0, account_rollouts=0,
                account_tokens=0, account_cost_micro=5)
    ident = Identity.generate()
    for bad in (dict(task_ids=[], results=1, rollouts=0, tokens=0), dict(task_ids=["t"], results=0, rollouts=0, tokens=0),
                dict(task_ids=[], results=0, rollouts=2, tokens=0)):
        with pytest.raises(Echo2Error):
            envelope.open_envelope(envelope.seal(ident, Receipt(**(base | bad))), Receipt, replay=None)  # type: ignore[arg-type]
