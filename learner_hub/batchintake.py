"""Result intake, one result or a node's batch of them (issue 20, item 2): the hub's side.

:func:`accept_items` is the hub's intake for a list of signed result envelopes from one peer (a
lone RESULT is a list of one): the stateless checks in the intake pool (one request per worker
for the whole list), then per item, in order, the stateful half (replay nonce, task book,
dispatcher; a refusal is recorded and answered with its reason), then for the accepted ones
together: scoring, ONE durable store transaction, the ledger, one signed receipt per price (at
most MAX_RECEIPT_TASKS tasks each) and one refill of the pipeline. Per small result these were
the hub's largest costs when each item went through the lone path (profiled in bench intake
--workers 2: the worker round trip ~0.3 ms, sealing the receipt 0.2-0.3 ms, outbox.feed ~0.2 ms,
the SQLite transaction ~0.35 ms).

A :class:`~echo2.protocol.batchmessages.ResultBatch` is opened like any request (size, signature
over the raw bytes, signer admitted, replay), then its items go through :func:`accept_items`;
with intake workers the whole batch frame goes to one of them (:func:`judge_batch_in_worker`),
which opens it and its items, and the hub keeps only the replay step and the stateful half.
Each item gets its verdict in the :class:`BatchAck`: the hub's signed receipt (the same envelope
for the items it covers: a receipt names every task it counts), or the refusal's code and
message, exactly what the lone request would have answered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from echo2.protocol import envelope
from echo2.protocol.batchmessages import (
    MAX_BATCH_BYTES,
    MAX_BATCH_RESULTS,
    BatchAck,
    BatchVerdict,
    ChannelOffer,
    batch_ack_payload,
)
from echo2.protocol.errors import Echo2Error, MeaningError, NotAdmitted
from echo2.protocol.identity import Identity
from echo2.protocol.nodemessages import MAX_RECEIPT_TASKS

from .intake import Accept, Punish
from .intake_check import check_replay, open_batch
from .intake_pool import Checked
from .intake_worker import CheckContext
from .receipts import make_batch_receipt, seal_receipt
from .reputation import Event
from .rewards import Batch, Scored, TrainerState, apply_scores, batch_of
from .rows import Group, encode_groups
from .store import Accepted, HubStore

if TYPE_CHECKING:
    from .fleet import NodeInfo
    from .hub import Hub

log = logging.getLogger(__name__)

#: per item: its sealed receipt, or why it was not accepted
ItemOutcome = bytes | Exception
JudgeItems = Callable[[str, list[bytes]], Awaitable[list[ItemOutcome]]]
Allowed = Callable[[str, type], bool]
_NOT_ADMITTED = "this node is not admitted (the hub may have restarted): request admission"


@dataclass
class _Taken:
    """An item the dispatcher accepted."""

    index: int
    checked: Checked
    verdict: Accept
    now: float


def _judge(hub: Hub, peer: str, c: Checked) -> tuple[NodeInfo, Accept, float]:
    """The stateful half for one item: its Accept, or the refusal raised (recorded first)."""
    f = c.findings
    node = hub.nodes.get(peer)
    if node is None:  # dropped while a worker checked its result
        raise NotAdmitted(_NOT_ADMITTED)
    now = node.last_seen = time.time()
    check_replay(hub.replay, f, now)
    verdict = hub.intake.judge_found(peer, f, now, hub.learner.version)
    if isinstance(verdict, Accept):
        return node, verdict, now
    reason = verdict.error.code if isinstance(verdict, Punish) else verdict.code
    hub.store.submit(HubStore.record_result, f.task_id, peer, f.version, accepted=False, reason=reason,
                     tokens=f.tokens, rollouts=f.n_completions, received_at=now)
    if isinstance(verdict, Punish):
        hub.fleet.punish(peer, Event.FORGED, verdict.error.message)
    else:
        node.refused += 1
        hub.ledger.refuse(peer, verdict.code)
        hub._pump()
    raise verdict.error


async def accept_items(hub: Hub, peer: str, items: list[bytes], *, covered: bool = False) -> list[ItemOutcome]:
    """Each of ``items`` (result envelopes ``peer``'s connection sent) judged: its sealed receipt,
    or the Echo2Error that refuses it (another exception: a bug judging it). ``covered``: the items
    of a ResultBatch signed by ``peer`` and verified (their own signatures are not checked again)."""
    if peer not in hub.nodes:  # before any work on the frames: a stranger costs no worker time
        raise NotAdmitted(_NOT_ADMITTED)
    ctx = CheckContext(peer, hub.intake.tasks_of(peer), hub.learner.version, hub.cfg.steps, covered=covered)
    return await judge_checked(hub, peer, await hub.intake_pool.check_many(items, ctx))


async def judge_batch_in_worker(hub: Hub, peer: str, data: bytes) -> bytes:
    """The sealed BatchAck for one ResultBatch from ``peer``, the batch opened by an intake worker
    (IntakePool.check_batch) instead of here; its replay step is the hub's, taken before any
    item's verdict changes state. An Echo2Error refuses the batch whole, as in :func:`judge_batch`."""
    if peer not in hub.nodes:  # before any work on the frame: a stranger costs no worker time
        raise NotAdmitted(_NOT_ADMITTED)
    ctx = CheckContext(peer, hub.intake.tasks_of(peer), hub.learner.version, hub.cfg.steps)
    head, checked = await hub.intake_pool.check_batch(data, ctx)
    check_replay(hub.replay, head, time.time())
    return batch_ack(hub.identity, peer, await judge_checked(hub, peer, checked))


async def judge_checked(hub: Hub, peer: str, checked: list[Checked | Echo2Error]) -> list[ItemOutcome]:
    """Each checked item of ``peer``'s judged in turn (the stateful half): its sealed receipt, or
    the Echo2Error that refuses it."""
    out: list[ItemOutcome | None] = [None] * len(checked)
    taken: list[_Taken] = []
    node: NodeInfo | None = None
    # one batch judged at a time (cpugate.py), in slices: whole, a batch of 8 held the loop for
    # 4-11 ms (`echo2 bench intake --nodes 10000 --batch 8`, trio instrument), the largest share of
    # its lag p99. The loop runs between two slices, and a pump in between sees the node's slots
    # freed one by one: the node's ``judging`` keeps its WORK ask asleep until the batch is judged,
    # so it gets all that the batch freed in one TaskBundle, not one task (tasks_per_heartbeat)
    asker = hub.nodes.get(peer)
    if asker is not None:
        asker.judging += 1
    try:
        async with hub.intake_pool.gate.held() as gate:
            for i, c in enumerate(checked):
                if i:
                    await gate.tick()
                if isinstance(c, Exception):
                    out[i] = c
                    continue
                try:
                    node, verdict, now = _judge(hub, peer, c)
                except Echo2Error as exc:
                    out[i] = exc
                    continue
                taken.append(_Taken(i, c, verdict, now))
    finally:
        if asker is not None:
            asker.judging -= 1
            if asker.mailbox:
                asker.wake()
    evals = [t for t in taken if hub.dispatcher.eval_handled(t.checked.findings.task_id)]
    plain = [t for t in taken if t not in evals]
    for t in evals:  # rare (a few per evaluation): the lone path, each with its own receipt
        try:
            out[t.index] = await hub._eval_result(peer, t.checked.findings, t.verdict, t.now, t.checked.findings.tokens,
                                                  t.checked)
        except Exception as exc:
            out[t.index] = exc
    if plain:
        assert node is not None
        await _accept(hub, peer, node, plain, out)
    done = [o for o in out if o is not None]
    assert len(done) == len(checked)
    return done


async def _score_all(hub: Hub, plain: list[_Taken]) -> list[list[Group]]:
    """Each accepted item's rows with their rewards. Those an intake worker scored are counted;
    the rest are scored here in ONE call of each reward function for the whole batch (per item,
    each call was a thread hand-off per function: ~0.3-0.5 ms of the loop per small result). A
    function that fails on the call fails it for the whole batch (its completions are excluded)."""
    rows_of: list[list[Group]] = [[] for _ in plain]
    here = []
    for k, t in enumerate(plain):
        if t.checked.scored is not None or len(plain) == 1:
            rows_of[k] = await hub._score(t.verdict, t.checked)
        else:
            here.append(k)
    if not here:
        return rows_of
    parts = [batch_of(plain[k].verdict.rows, [g.item for g in plain[k].verdict.task.groups], plain[k].verdict.texts)
             for k in here]
    whole = Batch([x for b in parts for x in b.items], [x for b in parts for x in b.texts],
                  [x for b in parts for x in b.completion_ids], [x for b in parts for x in b.finish_reasons])
    scored = await hub.rewards.score(whole, TrainerState(global_step=hub.learner.version, max_steps=hub.cfg.steps))
    at = 0
    for k, b in zip(here, parts, strict=True):
        lo, at = at, at + len(b)
        mine = Scored(scored.rewards[lo:at], scored.reasons[lo:at], scored.parts[lo:at] if scored.parts else [])
        rows_of[k], dropped = apply_scores(plain[k].verdict.rows, mine)
        hub.rewards.groups_dropped += dropped
    return rows_of


async def _accept(hub: Hub, peer: str, node: NodeInfo, plain: list[_Taken], out: list[ItemOutcome | None]) -> None:
    """The accepted items, together. The dispatcher has accepted them: this runs even if the
    node's request gives up meanwhile (cancelled halfway, an accepted result would never be
    stored). The scoring inside is bounded by reward_timeout_s."""
    with trio.CancelScope(shield=True):
        rows_of = await _score_all(hub, plain)
        # one batch's bookkeeping at a time (cpugate.py): 32 of them finishing their scoring in
        # the same pass of the loop ran back to back; taken before the ban check below
        async with hub.intake_pool.gate.held() as gate:
            records = []
            for k, t in enumerate(plain):
                if k:  # the rows' encoding in slices (with workers 0, 8 of them were ~2 ms of one step)
                    await gate.tick()
                f, payload = t.checked.findings, t.checked.payload  # an intake worker encoded the same rows (or None)
                records.append(Accepted(f.task_id, peer, f.version, f.tokens, f.n_completions, t.now,
                                        encode_groups(rows_of[k]) if payload is None else payload,
                                        hub.fleet.task_price_micro(f.task_id, peer)))
            # from here to the store's request in one step: banned while its rows were scored or
            # encoded, drop_rows_of has run already, and none of them may reach the trainer
            if peer in hub.fleet.banned:
                empty = encode_groups([])
                rows_of = [[] for _ in plain]
                records = [rec._replace(payload=empty) for rec in records]
            # store: the results and their ledger entries in one durable transaction, queued before
            # the rows can be trained (and marked so), committed before the node hears "accepted"
            pending = hub.store.request(HubStore.record_accepted_many, records)
            by_price: dict[int, list[int]] = {}
            for k, rec in enumerate(records):
                by_price.setdefault(rec.price_micro, []).append(k)
            receipts = []
            dropped = []
            for price, ks in by_price.items():
                for lo in range(0, len(ks), MAX_RECEIPT_TASKS):
                    chunk = ks[lo:lo + MAX_RECEIPT_TASKS]
                    for k in chunk:
                        rec, rows = records[k], rows_of[k]
                        hub.ledger.accept(peer, rec.rollouts, rec.tokens)
                        hub.reputation.record(peer, Event.ACCEPTED)
                        node.tasks_done, node.rollouts, node.tokens = (node.tasks_done + 1, node.rollouts + rec.rollouts,
                                                                       node.tokens + rec.tokens)
                        if rows:
                            hub.trainer.add(rec.task_id, rows, rec.version)
                        else:  # nothing the reward functions could score: nothing to train or restore
                            hub.intake.book.buffered(rec.task_id, 0)
                            dropped.append(rec.task_id)
                    # taken right after the ledger counted the chunk: the account it states includes it
                    at = max(records[k].received_at for k in chunk)
                    account = hub.ledger.row(peer, at)
                    assert account is not None  # ledger.accept just created it
                    receipts.append((chunk, make_batch_receipt(
                        hub.identity.peer_id, peer, [records[k].task_id for k in chunk],
                        rollouts=sum(records[k].rollouts for k in chunk), tokens=sum(records[k].tokens for k in chunk),
                        price_micro=price, accepted_at=at, account=account)))
            if dropped:
                hub.store.submit(HubStore.drop_pending, dropped, "reward_excluded")
            hub.outbox.feed()
    try:
        await pending.wait()
    except Exception as exc:
        for t in plain:
            out[t.index] = exc
        return
    for chunk, receipt in receipts:
        sealed = seal_receipt(hub.identity, receipt)  # the node's proof of contribution (issue 19)
        for k in chunk:
            out[plain[k].index] = sealed


async def judge_batch(identity: Identity, peer: str, data: bytes, *, replay: envelope.PeerReplay, allowed: Allowed,
                      judge_items: JudgeItems) -> bytes:
    """The sealed BatchAck for one ResultBatch from ``peer``; an Echo2Error refuses the batch whole."""
    batch = open_batch(data, peer, replay=replay, allowed=allowed).message
    return batch_ack(identity, peer, await judge_items(peer, batch.results))


def batch_ack(identity: Identity, peer: str, outcomes: list[ItemOutcome]) -> bytes:
    """The sealed BatchAck stating each item's outcome, in order."""
    verdicts = []
    for i, o in enumerate(outcomes):
        if isinstance(o, bytes):
            verdicts.append(BatchVerdict(accepted=True, code="ok", message="", receipt=o))
        elif isinstance(o, Echo2Error):
            verdicts.append(BatchVerdict(accepted=False, code=o.code[:64], message=o.message[:1024], receipt=b""))
        else:  # a bug judging one item must not cost the others their verdicts
            log.error("judging item %d of a result batch from %s failed", i, peer, exc_info=o)
            verdicts.append(BatchVerdict(accepted=False, code="internal", message=f"internal error ({type(o).__name__})",
                                         receipt=b""))
    ack = BatchAck(node_id=peer, verdicts=verdicts)
    return envelope.seal(identity, ack, ttl_s=300, payload=batch_ack_payload(ack))


def channel_offer(identity: Identity, peer: str, addr: str | None, *, admitted: bool) -> bytes:
    """The sealed ChannelOffer for an admitted node; a refusal when there is no channel."""
    if not admitted:
        raise NotAdmitted(_NOT_ADMITTED)
    if not addr:
        raise MeaningError("this hub serves no channel: use the control plane")
    offer = ChannelOffer(hub_id=identity.peer_id, node_id=peer, addr=addr, max_batch=MAX_BATCH_RESULTS,
                         max_batch_bytes=MAX_BATCH_BYTES)
    return envelope.seal(identity, offer, ttl_s=300)
