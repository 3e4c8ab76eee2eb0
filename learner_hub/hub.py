"""The learner hub: the rooms, wired to the network.

A Result's path, top to bottom: :meth:`Hub.on_result` opens the envelope (signature, replay,
signer admitted), :mod:`.intake` judges it (rows, a refusal, or a punishment), :mod:`.rewards`
scores the rows in worker threads, :mod:`.storeworker` and the ledger record it, and
:mod:`.training` trains on its rows. The
other rooms: :mod:`.fleet` (admission, reputation, activation, capacity) and the publisher and
sender that move each new version to the nodes. Nothing here blocks the trio loop: SQLite runs
in the store's thread, the learner and packing in worker threads.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from echo2.keyfile import load_or_create_identity
from echo2.looplag import LoopLag
from echo2.protocol import envelope, holdsproof
from echo2.protocol.errors import MeaningError, NotAdmitted
from echo2.protocol.messages import (
    AdmissionDecision,
    AdmissionRequest,
    Announce,
    ErrorReply,
    Heartbeat,
    HoldsChallenge,
    HoldsProof,
    HoldsVersion,
    NodePause,
    Receipt,
    RelayReport,
    TaskDecline,
)
from echo2.protocol.net.channel import ChannelServer
from echo2.protocol.net.control import ControlHost, address_key, remote_ip
from echo2.protocol.net.dataplane import DataPlaneServer
from echo2.protocol.wire import WORK_POLL_S

from .admission_gate import AdmissionGate, AdmissionLimits, known_peers
from .batchintake import accept_items, channel_offer, judge_batch, judge_batch_in_worker
from .broadcast import PeerInfo, PipelinedSender, StarWithHolds
from .config import HubConfig, render_config
from .curves import HubCurves
from .detok import BatchDecoder
from .dispatch import DispatchConfig, Dispatcher
from .evaluation import Evaluator
from .fleet import Fleet, NodeInfo
from .gcpolicy import freeze_survivors
from .hubstatus import hub_status, write_status_file, write_status_in_chunks
from .intake import Accept, Intake, TaskParams
from .intake_check import Findings
from .intake_pool import Checked, IntakePool, worker_spec
from .ledger import Ledger
from .outbox import Outbox
from .publisher import PolicyPublisher, StarSender
from .receipts import make_receipt, make_statement, seal_receipt
from .recipe import build_recipe
from .reputation import Event
from .rewards import RewardRunner, Scored, TrainerState, apply_scores, batch_of, load_reward_funcs
from .rows import Group, encode_groups
from .serve import serve
from .status_http import StatusSnapshot
from .status_lists import StepLists
from .status_nodes import NodeFragments
from .store import HubStore
from .storeworker import StoreWorker
from .tracking import Tracker, report_targets
from .training import Trainer, build_learner, learner_memory
from .trainmetrics import HubFigures

NODE_SILENCE_S = 3 * WORK_POLL_S + 15.0

log = logging.getLogger(__name__)

#: how long a node has to answer its holds challenge (a node answers from memory at once)
HOLDS_PROOF_S = 60.0
#: heartbeats the hub checks or answers in one pass of its loop at most (~0.3-0.5 ms each)
WORK_GATE = 8
#: tasks a pump issues in one pass of the loop at most while the housekeeping runs (~40-70 us each:
#: a few ms); the rest on the next passes (Outbox.pump_slice)
PUMP_SLICE = 64
#: prompt groups a refill draws in one pass of the loop at most while the housekeeping runs
#: (~10-15 us each: ~1 ms); the rest on the next passes (Outbox.refill_slice)
REFILL_SLICE = 64


class Hub:
    def __init__(self, cfg: HubConfig) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.identity = load_or_create_identity(self.dir / "hub.key")
        # the operator's reward code first: a bad spec is reported before a model is loaded
        if cfg.reward_funcs:
            load_reward_funcs(cfg.reward_funcs, cfg.reward_weights)
        # sized from the model's config before any weight is loaded: a rank that cannot hold its share is refused
        self.memory_plan = learner_memory(cfg)
        learner, self.tok, self.model_config, self.artifacts = build_learner(cfg)
        # the recipe: prompts (dataset, built-in task or verifiers environment) and its reward functions
        self.recipe = build_recipe(cfg, self.tok, self.artifacts)
        funcs, weights = load_reward_funcs(self.recipe.reward_funcs, self.recipe.reward_weights)
        self.rewards = RewardRunner(funcs, weights, cfg.reward_timeout_s)
        self.dispatcher = Dispatcher(DispatchConfig(
            staleness=cfg.staleness, target_task_s=cfg.task_target_s, min_deadline_s=cfg.task_deadline_s,
            max_deadline_s=max(cfg.task_deadline_s, 900.0), max_in_flight_per_node=cfg.tasks_per_node,
        ))
        detok = BatchDecoder(self.tok.tokenizer)
        log.info("completions are detokenised by the %s", detok.kind)
        self.intake = Intake(
            self.dispatcher, TaskParams(cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p),
            vocab_size=self.tok.vocab_size, stop_ids=self.tok.stop_ids, decode=self.tok.decode,
            # a checked byte table for byte-level tokenizers: 0.57 s of a 36 MB result's 0.92 s was
            # the tokenizer's decode_batch (detok.py); any other tokenizer decodes itself
            decode_batch=detok,
        )
        # issue 20: N processes check and score results (0: in this process, as before)
        self.intake_pool = IntakePool(cfg.intake_workers, worker_spec(cfg, self.recipe, self.artifacts, self.intake),
                                      self.intake.decode_batch)
        # A3: replay state per admitted signer; admission requests (strangers) get a small pool that evicts
        self.replay, self.gossip_replay = envelope.PeerReplay(), envelope.PeerReplay(window_s=300.0, per_peer=256)
        self.admission_replay = envelope.ReplayGuard(max_entries=10_000, evict=True)
        # A5: the open challenge of each node that reported holding a version (one per node)
        self.holds_pending: dict[str, tuple[HoldsChallenge, float]] = {}
        self._holds_rng = random.SystemRandom()
        self.publisher = PolicyPublisher(self.identity, self.model_config, self.artifacts, cfg)
        info: Callable[[str], PeerInfo | None] = lambda peer: self.fleet.peer_info(peer)  # noqa: E731 (fleet comes later)
        self.sender = (
            PipelinedSender(self.publisher, self.identity, hub_upload_MBps=cfg.upload_limit_MBps, node_info=info,
                            nat_relay=cfg.nat_relay, nat_punch=cfg.nat_punch)
            if cfg.broadcast == "pipelined" else StarWithHolds(StarSender(self.publisher), node_info=info)
        )
        # operator state: DIR/hub.sqlite (through the store's own thread), checkpoints in DIR/checkpoints
        self.store = StoreWorker(self.dir)
        # A3/A11: admission requests counted per address (new identities) and per known key
        self.admission_gate = AdmissionGate(known=self.store.call_sync(known_peers, AdmissionLimits().max_known))
        self.ledger = Ledger.restore(self.store.settle_ledger())  # open intervals closed at the last alive mark
        self.trainer = Trainer(cfg, learner, self.publisher, self.sender, self.store, self.intake.book)
        self.fleet = Fleet(cfg, self.identity.peer_id, self.store, self.ledger, self.dispatcher, self.sender,
                           self.publisher, self.trainer)
        self.fleet.on_ban, self.activate = self._banned, self.fleet.activate
        self.outbox = Outbox(cfg, self.identity, self.recipe.source, self.tok, self.intake, self.trainer, self.fleet, self.store)
        self.evaluator = self._evaluator()
        self.outbox.evaluator = self.evaluator if self.evaluator.enabled else None
        self.learner, self.buffer, self.history = learner, self.trainer.buffer, self.trainer.history
        self.nodes, self.reputation = self.fleet.nodes, self.fleet.reputation
        self.loop_lag = LoopLag()
        # heartbeats checked and answered WORK_GATE at a time: a pump that issues tasks wakes every
        # node waiting for one, and 1,000 heartbeats at once ran in one pass of the loop (544
        # seals in one batch: 170 ms of CPU, the loop's lag, `echo2 bench intake` at 10,000 nodes)
        self.work_gate = trio.Semaphore(WORK_GATE)
        self.freeze_gc = False  # run_hub: survivors frozen once a second while it serves (gcpolicy.py)
        self._more_to_pump = trio.Event()
        self.outbox.more_to_pump = lambda: self._more_to_pump.set()
        self.curves = HubCurves()  # the status page's curves (curves.py)
        self.status_snapshot: StatusSnapshot | None = None  # the last status written (the HTTP server serves it)
        self.status_nodes = NodeFragments()  # status.json's per-node entries, re-encoded where they changed
        self.status_lists = StepLists()  # and its step lists, each entry encoded once
        self.started = self.trainer.started
        self.done, self.finished = trio.Event(), False
        self._status_lock: trio.Lock | None = None
        self.host: ControlHost | None = None
        self.data_server: DataPlaneServer | None = None
        self.probe_server: DataPlaneServer | None = None
        self.addrs: list[str] = []
        self.data_addr = self.status_url = ""
        self.channel_server: ChannelServer | None = None
        self.channel_addr = ""  # the nodes' channel listener (serve.py; protocol/channel.py), "" when none
        self.resumed_from, self.restored_results = self.trainer.resume()
        self._start_tracking()
        self.intake_pool.wait_ready()  # a worker that cannot load the tokenizer or rewards stops start-up

    def _start_tracking(self) -> None:
        """report_to (tracking.py): the trackers get the whole config once, then every step's
        figures from the training room and the hub's echo2/ figures at that moment."""
        cfg = self.cfg
        figures = HubFigures()
        self.trainer.hub_figures = lambda: figures(self, time.time())
        if report_targets(cfg.report_to):
            self.trainer.tracker = Tracker.for_hub(cfg.report_to, self.dir, cfg.run_name or self.dir.resolve().name,
                                                   dataclasses.asdict(cfg), render_config(cfg))

    # the fleet's decisions, as tests and the status page read them
    def _evaluator(self) -> Evaluator:
        cfg = self.cfg
        # held-out prompts: the dataset's eval split, or a built-in task's set on a seed apart from training's
        items = self.recipe.eval_items if cfg.eval_every else []
        return Evaluator(
            items, [list(it.ids) for it in items], every=cfg.eval_every, steps=cfg.steps,
            pass_threshold=cfg.eval_pass_threshold, group_size=self.outbox.eval_params.group_size,
            started=self.trainer.started, history=self.store.evaluations(),
        )

    @property
    def active(self) -> set[str] | None:
        return self.fleet.active

    @property
    def last_activation(self) -> dict[str, Any]:
        return self.fleet.last_activation

    @property
    def relay_reports_received(self) -> int:
        return self.fleet.relay_reports_received

    def _signed_by(self, peer: str, admitted: bool = True) -> Callable[[str, type], bool]:
        def allowed(signer: str, _t: type) -> bool:
            if signer != peer:
                return False
            if admitted and signer not in self.nodes:
                raise NotAdmitted("this node is not admitted (the hub may have restarted): request admission")
            return True

        return allowed

    def _banned(self, peer: str) -> None:
        now = time.time()
        for tid in self.intake.node_left(peer):
            self.store.submit(HubStore.close_task, tid, "reassigned", now)
        self.trainer.drop_rows_of(peer)  # its rollouts still waiting in the buffer are not trained on
        self._pump()

    # tasks out (tests drive them directly)
    def _refill(self) -> None:
        self.outbox.refill()

    def _pump(self) -> None:
        self.outbox.pump()

    # --- control-plane handlers (each guarded by ControlHost; raise Echo2Error to refuse) --------
    async def on_admission(self, peer: str, data: bytes) -> bytes:
        # first: a request refused for rate costs no signature check and no replay nonce (A3/A11)
        refusal = self.admission_gate.refusal(peer, address_key(remote_ip() or peer), trio.current_time())
        if refusal is not None:
            raise refusal
        req = envelope.open_envelope(data, AdmissionRequest, replay=self.admission_replay, allowed=self._signed_by(peer, False)).message
        if req.peer_id != peer or req.announce.peer_id != peer:
            raise MeaningError("admission request names another peer")
        admitted, reason = await self.fleet.admit(peer, req.join_token, req.announce, time.time())
        if admitted:
            self.admission_gate.admitted(peer)
        decision = AdmissionDecision(peer_id=peer, admitted=admitted, reason=reason, hub_data_addr=self.data_addr,
                                     current_version=self.publisher.latest_version, staleness=self.cfg.staleness)
        return envelope.seal(self.identity, decision)

    async def on_work(self, peer: str, data: bytes) -> bytes:
        async with self.work_gate:
            hb = envelope.open_envelope(data, Heartbeat, replay=self.replay, allowed=self._signed_by(peer)).message
            node = self.nodes[peer]
            node.last_seen = time.time()
            if node.paused:  # asking for work again is resuming (e.g. a node restarted while paused)
                self.fleet.set_paused(peer, False, "", node.last_seen)
            # versions_held is informational: after a hub restart a node may hold versions of the
            # crashed run under the same numbers, so only HoldsVersion for versions this hub process
            # sent counts (see on_holds).
            if not node.mailbox or self.fleet.eligibility_changed:
                # a node with a task waiting takes it: what the pump would hand out is decided by the
                # results, declines and steps that change it, each pumping (skipped: ~60 us a heartbeat)
                self._pump()
            if node.mailbox and not node.judging:  # answered on the same turn: a second turn cost a pass of the loop more
                return self.outbox.seal_some(node.mailbox, hb.queue_free)
        with trio.move_on_after(WORK_POLL_S):
            # while a batch of its results is judged, what it frees comes in one answer at the end
            while not node.mailbox or node.judging:
                node.wakeup = trio.Event()
                await node.wakeup.wait()
        async with self.work_gate:
            node.last_seen = time.time()
            if node.mailbox:
                # a node asking for k (queue_free > 1 means it reads a TaskBundle) takes up to k at once
                return self.outbox.seal_some(node.mailbox, hb.queue_free)
            return envelope.seal(self.identity, ErrorReply(code="no_work", message="no work right now"))

    async def on_result(self, peer: str, data: bytes) -> bytes:
        # either wire form: the packed one (int32/float32 bytes, what nodes send) or the list one.
        # The stateless checks (envelope, signature, decode, completions, detokenising; with
        # intake workers, the rewards too) run in the intake pool; the state (replay, book,
        # dispatcher, store, ledger) stays here. A lone result is a batch of one (batchintake.py).
        out = (await accept_items(self, peer, [data]))[0]
        if isinstance(out, Exception):
            raise out
        return out  # the receipt: the node's proof of contribution (issue 19)

    async def on_results(self, peer: str, data: bytes) -> bytes:
        """A ResultBatch: its items judged together, one verdict each (batchintake.py)."""
        if self.intake_pool.workers:
            return await judge_batch_in_worker(self, peer, data)
        return await judge_batch(self.identity, peer, data, replay=self.replay, allowed=self._signed_by(peer),
                                 judge_items=lambda p, items: accept_items(self, p, items, covered=True))

    async def on_channel(self, peer: str, data: bytes) -> bytes:
        """Where an admitted node opens its channel (the request carries nothing: the stream's
        authenticated peer ID is the asker)."""
        return channel_offer(self.identity, peer, self.channel_addr, admitted=peer in self.nodes and peer not in self.fleet.banned)

    async def _eval_result(self, peer: str, r: Findings, verdict: Accept, now: float, tokens: int,
                           checked: Checked | None = None) -> bytes:
        """An accepted eval result: scored, recorded in its evaluation, never trained. The node
        did the work the hub asked for, so it is stored and credited like a rollout result
        (the ledger pays for eval rollouts too)."""
        node, n = self.nodes[peer], r.n_completions
        with trio.CancelScope(shield=True):
            scored = await self._scored(verdict, checked)
            # an empty payload: nothing of it may be restored into training after a restart
            price = self.fleet.task_price_micro(r.task_id, peer)
            pending = self.store.request(HubStore.record_accepted, r.task_id, peer, r.version, tokens=tokens, rollouts=n,
                                         received_at=now, payload=encode_groups([]), price_micro=price)
            self.store.submit(HubStore.drop_pending, [r.task_id], "eval")
            self.ledger.accept(peer, n, tokens)  # eval rollouts are paid work: credited as rollouts
            receipt = self._receipt(peer, r.task_id, n, tokens, price, now)
            self.reputation.record(peer, Event.ACCEPTED)
            node.tasks_done, node.rollouts, node.tokens = node.tasks_done + 1, node.rollouts + n, node.tokens + tokens
            self.intake.book.buffered(r.task_id, 0)  # nothing buffered: the book forgets the task
            for rec in self.evaluator.add(verdict.task.groups, scored, r.version):
                self.store.submit(HubStore.record_eval, rec, time.time())
                self.trainer.record_eval(rec)
            self.outbox.feed()
        await pending.wait()
        return seal_receipt(self.identity, receipt)  # the node's proof of contribution (issue 19)

    def _receipt(self, peer: str, task_id: str, rollouts: int, tokens: int, price: int, now: float) -> Receipt:
        """Taken right after the ledger counted the result: the account it states includes it."""
        account = self.ledger.row(peer, now)
        assert account is not None  # ledger.accept just created it
        return make_receipt(self.identity.peer_id, peer, task_id, rollouts=rollouts, tokens=tokens, price_micro=price,
                            accepted_at=now, account=account)

    async def _scored(self, verdict: Accept, checked: Checked | None) -> Scored:
        """The rewards of an accepted result: an intake worker's (counted here as if scored
        here), else scored now in the hub's reward threads."""
        if checked is not None and checked.scored is not None:
            self.rewards.count(checked.scored, checked.failures)
            return checked.scored
        batch = batch_of(verdict.rows, [g.item for g in verdict.task.groups], verdict.texts)
        return await self.rewards.score(batch, TrainerState(global_step=self.learner.version, max_steps=self.cfg.steps))

    async def _score(self, verdict: Accept, checked: Checked | None = None) -> list[Group]:
        """The accepted rows with their rewards; completions the reward functions could not score
        are left out, and so is a group left with fewer than two (counted in status.rewards)."""
        rows, dropped = apply_scores(verdict.rows, await self._scored(verdict, checked))
        self.rewards.groups_dropped += dropped
        return rows

    async def on_decline(self, peer: str, data: bytes) -> bytes:
        d = envelope.open_envelope(data, TaskDecline, replay=self.replay, allowed=self._signed_by(peer)).message
        if self.intake.decline(d.task_id, peer, d.reason):
            self.store.submit(HubStore.close_task, d.task_id, f"declined:{d.reason_code}", time.time())
        self._pump()
        return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))

    async def on_pause(self, peer: str, data: bytes) -> bytes:
        """A node pauses (or resumes) computing by its owner's preferences: unavailable, not
        failed. Tasks waiting in its mailbox go back to the queue as declined (the node declines
        the ones it already holds itself); no reputation event, no billing while paused."""
        p = envelope.open_envelope(data, NodePause, replay=self.replay, allowed=self._signed_by(peer)).message
        if p.peer_id != peer:
            raise MeaningError("pause message names another node")
        now = time.time()
        node = self.nodes[peer]
        self.fleet.set_paused(peer, p.paused, f"{p.reason_code}: {p.reason}" if p.paused else "", now)
        if p.paused:
            while node.mailbox:  # tasks issued to it, never delivered
                task = node.mailbox.popleft()
                if self.intake.decline(task.task_id, peer, f"paused: {p.reason}"):
                    self.store.submit(HubStore.close_task, task.task_id, "declined:paused", now)
        self._pump()
        account = self.ledger.row(peer, time.time()) if p.paused else None
        if account is None or account.active:
            return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))
        # billing stopped (activation left the paused node out): the node's account, signed, so the
        # time billed since its last receipt is in its proof of contribution too (issue 19)
        statement = make_statement(self.identity.peer_id, peer, price_micro=account.price_micro, at=now, account=account)
        return seal_receipt(self.identity, statement)

    async def on_holds(self, peer: str, data: bytes) -> bytes:
        """A node says it holds a version, or proves it (A5). A report is answered with a challenge
        (:mod:`echo2.protocol.holdsproof`); only the right answer makes the node a holder of the
        version, which is what the hub gives work on. A claim alone earns nothing."""
        v = envelope.open_envelope(data, (HoldsVersion, HoldsProof), replay=self.replay,
                                   allowed=self._signed_by(peer)).message
        assert isinstance(v, HoldsVersion | HoldsProof)
        if v.peer_id != peer:
            raise MeaningError("holds message names another node")
        if v.version > self.publisher.latest_version:
            raise MeaningError(f"version {v.version} was never published by this hub")
        node = self.nodes[peer]
        pub = self.publisher.recent.get(v.version)
        if pub is None or not pub.has_data:  # its bytes are gone: rows made with it could not be verified
            self.holds_pending.pop(peer, None)
            return envelope.seal(self.identity, ErrorReply(code="ok", message=f"version {v.version} is too old to work on"))
        if isinstance(v, HoldsVersion):
            index, offset, length = holdsproof.choose(pub.packed.manifest, self._holds_rng)
            ch = HoldsChallenge(peer_id=peer, version=v.version, nonce=secrets.token_bytes(16), index=index,
                                offset=offset, length=length)
            self.holds_pending[peer] = (ch, time.time() + HOLDS_PROOF_S)
            return envelope.seal(self.identity, ch)
        ch, until = self.holds_pending.pop(peer, (None, 0.0))
        if ch is None or ch.nonce != v.nonce or ch.version != v.version or time.time() > until:
            raise MeaningError("no open challenge for this proof (answer the latest one, within "
                               f"{HOLDS_PROOF_S:.0f} s)")
        if v.digest != holdsproof.answer(ch.nonce, pub.packed.raw_chunks[ch.index], ch.offset, ch.length):
            self.fleet.punish(peer, Event.MISMATCH, f"wrong proof of holding version {ch.version}")
            raise MeaningError(f"wrong proof of holding version {ch.version}: no work on it")
        node.held_version = max(node.held_version, v.version)
        self.publisher.record_holds(peer, v.version)
        self._pump()
        return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))

    async def on_relay_report(self, peer: str, data: bytes) -> bytes:
        rep = envelope.open_envelope(data, RelayReport, replay=self.replay, allowed=self._signed_by(peer)).message
        return envelope.seal(self.identity, ErrorReply(code="ok", message=self.fleet.relay_report(peer, rep)))

    async def on_announce(self, peer: str, data: bytes) -> None:
        # only admitted nodes' announcements matter (each signer has its own replay guard, as for the handlers)
        v = envelope.open_envelope(data, Announce, replay=self.gossip_replay, allowed=lambda s, _t: s in self.nodes)
        self.fleet.announced(v.signer, v.message)

    # --- loops -----------------------------------------------------------------------------------
    async def housekeeping(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.issue_slices)
            if self.freeze_gc:
                nursery.start_soon(freeze_survivors)
            await self._housekeeping()

    async def issue_slices(self) -> None:
        """While it runs, a pump issues PUMP_SLICE tasks at most and this pumps the rest, a slice
        per pass of the loop (each wait on the event is a checkpoint)."""
        self.outbox.pump_slice, self.outbox.refill_slice = PUMP_SLICE, REFILL_SLICE
        try:
            while True:
                await self._more_to_pump.wait()
                self._more_to_pump = trio.Event()
                self.outbox.next_slice()
        finally:
            self.outbox.pump_slice = self.outbox.refill_slice = None

    async def _housekeeping(self) -> None:
        tick = 0
        while True:
            await trio.sleep(1.0)
            tick += 1
            now = time.time()
            if tick % 5 == 0:
                await self.fleet.reactivate()
            # bans and pardons made with the CLI while the hub runs reach the data plane's check
            self.fleet.banned = await self.store.call(HubStore.banned)
            expired = self.intake.expire(now)
            for tid, peer in expired:
                self.reputation.record(peer, Event.TIMEOUT)
                self.store.submit(HubStore.close_task, tid, "expired", now)
            if expired:
                self.outbox.feed()
            for peer in self.fleet.drop_silent(now, self.cfg.node_silence_s or NODE_SILENCE_S):
                self.holds_pending.pop(peer, None)
                for tid in self.intake.node_left(peer):
                    self.store.submit(HubStore.close_task, tid, "reassigned", now)
                self._pump()
            self.fleet.tick(now)
            await self.write_status()

    async def learner_loop(self) -> None:
        await self.trainer.run(self.outbox.feed, self.fleet.checked, self.fleet.predicted_busy_fraction,
                               self.fleet.persist_job, self.write_status)
        await self._final_evaluation()
        await self.write_status(final=True)
        self.done.set()

    async def _final_evaluation(self) -> None:
        """Wait (bounded) for the evaluation of the last step: the run's "after" figure."""
        ev, last = self.evaluator, self.learner.version
        if not ev.enabled:
            return
        self._pump()  # starts it if due
        limit = max(120.0, 4 * self.cfg.task_deadline_s)
        with trio.move_on_after(limit):
            while ev.pending(last):
                await trio.sleep(0.2)
            return
        log.warning("evaluation at step %d not complete after %.0f s; the hub stops without it", last, limit)

    async def publish(self) -> None:
        await self.trainer.publish()

    # --- status ----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return hub_status(self)

    async def write_status(self, final: bool = False) -> None:
        self.finished = self.finished or final
        self._status_lock = self._status_lock or trio.Lock()
        async with self._status_lock:  # one writer at a time: they share the temporary file name
            await write_status_in_chunks(self, self.dir / "status.json", {"final": self.finished})

    async def run(self) -> int:
        return await serve(self)


def run_hub(cfg: HubConfig) -> int:
    os.umask(0o077)  # key, database, checkpoints: the operator's only
    hub = Hub(cfg)
    hub.freeze_gc = True
    # Measured: full collections over start-up's objects (torch, the model, libp2p) stalled the loop
    # ~260 ms in the demo; they live all run long, so the collector need never scan them again.
    gc.freeze()
    try:
        return trio.run(hub.run)
    except KeyboardInterrupt:
        hub.finished = True
        write_status_file(hub.dir / "status.json", hub.status() | {"final": True})
        return 0
    finally:
        hub.intake_pool.close()  # no intake worker outlives the hub
        hub.store.close()  # runs the writes still queued
        hub.trainer.tracker.close()  # the trackers' queued writes, then their files closed
        close = getattr(hub.learner, "close", None)  # a sharded learner's ranks (issue 17)
        if close is not None:
            close()


__all__ = ["NODE_SILENCE_S", "Hub", "NodeInfo", "run_hub"]
