"""The fleet: who is admitted, how far each node is trusted, who works (cost-aware activation)
and what the fleet can do (the capacity report). The hub's handlers call in here; bans reach
back to intake and training through ``on_ban``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from echo2.protocol.errors import MeaningError
from echo2.protocol.messages import Announce, RelayReport, Task

from .activation import ActiveDecision, ActiveSet, Offer, choose_active
from .admission import AdmissionPolicy, Decision
from .broadcast import PeerInfo
from .capacity import CapacityReport, NodeCapacity, capacity_report
from .claims import ClaimLimits, PriceBook, claim_problem, overclaims
from .config import HubConfig
from .dispatch import Dispatcher
from .ledger import MICRO, AccountsView, Ledger, to_micro
from .links import LinkBook
from .publisher import PolicyPublisher
from .reputation import Event, ReputationBook, ReputationConfig
from .silence import SilenceOrder
from .store import HubStore
from .storeworker import StoreWorker

log = logging.getLogger(__name__)

#: accounts written per ledger save at most (once a second; the rest at the next): admitting 10,000
#: nodes at once changed 10,000 accounts, whose rows in one save held the store thread's GIL for
#: tens of ms right after (`echo2 bench intake`, the idle phase)
LEDGER_SAVE_BATCH = 500
#: nodes whose price, claim or timing moved that one tick visits at most (the rest at the next)
TICK_BATCH = 250
#: the capacity report is logged and stored at most this often when the fleet changes
CAPACITY_LOG_EVERY_S = 60.0


@dataclass
class NodeInfo:
    peer_id: str
    announce: Announce
    admitted_at: float
    last_seen: float
    held_version: int = -1
    # issued tasks, signed when the node takes one (hub.on_work): a pump after a learner step
    # issues thousands at 10,000 nodes, and sealing them all there held the loop for seconds
    mailbox: deque[Task] = field(default_factory=deque)
    wakeup: trio.Event = field(default_factory=trio.Event)
    tasks_done: int = 0
    rollouts: int = 0
    tokens: int = 0
    refused: int = 0
    # why the node paused computing by its owner's preferences ("" = available); see set_paused
    paused: str = ""
    # batches of this node's results being judged now: while > 0 a task issued to it waits in the
    # mailbox without waking its WORK ask, which then takes all that the batch freed in one
    # TaskBundle (batchintake.judge_checked, judged in slices)
    judging: int = 0

    def wake(self) -> None:
        """Wake the node's WORK ask for its mailbox, unless a batch of its results is being judged
        (the judging wakes it when done, with all that the batch freed)."""
        if not self.judging:
            self.wakeup.set()

    def __setattr__(self, name: str, value: Any) -> None:
        # who may get tasks depends on the version a node holds: the outbox re-checks only the
        # nodes named in the fleet's ``eligibility_changed`` (a full pass per message cost ~10 ms
        # at 10,000 nodes, `echo2 bench intake`)
        object.__setattr__(self, name, value)
        if name == "held_version":
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch.add(self.peer_id)
        elif name == "last_seen":
            seen = self.__dict__.get("_seen")
            if seen is not None:
                seen.heard(self.peer_id, value)
        elif name == "tokens":  # the status page's per-node rates sample only the nodes that changed
            tok = self.__dict__.get("_tok")
            if tok is not None:
                tok.add(self.peer_id)
        if name in STATUS_FIELDS:  # status.json re-encodes only the entries that changed (status_nodes.py)
            st = self.__dict__.get("_status")
            if st is not None:
                st.add(self.peer_id)


#: the NodeInfo fields that status.json's entry of a node shows
STATUS_FIELDS = frozenset({"held_version", "tasks_done", "rollouts", "tokens", "refused", "paused", "announce"})


def save_accounts(st: HubStore, accounts: AccountsView) -> None:
    """The ledger's save, in the store's thread: rows of the accounts changed since the last save
    (Ledger.take_changed), built here, not on the loop, and the hub's alive mark."""
    st.save_ledger(accounts.rows(), accounts.now)


class TrainingFigures(Protocol):
    """What activation and the capacity model read of the training room."""

    history: list[dict[str, Any]]

    def t_train(self) -> float: ...

    def step_overhead(self) -> float: ...


class Fleet:
    def __init__(
        self,
        cfg: HubConfig,
        hub_peer_id: str,
        store: StoreWorker,
        ledger: Ledger,
        dispatcher: Dispatcher,
        sender: Any,
        publisher: PolicyPublisher,
        figures: TrainingFigures,
    ) -> None:
        self.cfg = cfg
        self.publisher = publisher
        self.figures = figures
        self.store = store
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.sender = sender
        self.nodes: dict[str, NodeInfo] = {}
        self.refusals: Counter[str] = Counter()
        self.active: set[str] | None = None  # None: no activation decision yet, everyone works
        # nodes whose eligibility for tasks may have changed (held version, activation, joined or
        # left) since the outbox last applied it to the dispatcher
        self.eligibility_changed: set[str] = set()
        self.silence = SilenceOrder()
        self.tokens_changed: set[str] = set()  # nodes whose token count changed since curves sampled it
        self.status_changed: set[str] = set()  # nodes whose status entry may have changed since the last write
        self._claim_changed: set[str] = set()  # announced claims since the last tick
        self._tick_pending: set[str] = set()  # claims or timings changed, not yet visited by a tick
        self._rates_unsaved: set[str] = set()  # measured rates changed since a step last saved them
        self._admitted: dict[str, int] = {}  # peer -> admission number (the order of self.nodes)
        self._admission_seq = itertools.count()
        self.activation = ActiveSet(min_gain=0.05)  # who works, kept by events (activation.py)
        self.last_activation: dict[str, Any] = {}
        self.changed = False  # a node joined or left since the capacity report was last logged
        self.relay_reports_received = 0
        self.on_ban: Callable[[str], None] = lambda _peer: None
        self.reputation = ReputationBook(ReputationConfig())
        sender.on_convicted = self.convicted
        for rec in store.list_nodes():
            if rec.rep_state:
                self.reputation.restore(rec.peer_id, rec.rep_state)
                if self.reputation.get(rec.peer_id).relay_reporters:
                    sender.accuse(rec.peer_id, "reported relaying corrupt chunks before a restart")
        self.banned: dict[str, str] = store.banned()  # the data plane's check; refreshed each second
        self.admission = AdmissionPolicy(cfg.admission, cfg.allowlist, hub_peer_id=hub_peer_id)
        self.claims = ClaimLimits(max_price=cfg.max_price, max_rate=cfg.max_claimed_rate,
                                  change_every_s=cfg.price_change_every_s)
        self.prices = PriceBook(self.claims)
        self._overclaim_punished: dict[str, float] = {}  # peer -> the claimed figure it was punished for
        self.links = LinkBook()  # what the hub observed of each node's links (A10)
        self._busy_cache: tuple[int, float, float] | None = None  # predicted_busy_fraction_recent
        self._capacity_logged_at = -float("inf")

    # --- admission -------------------------------------------------------------------------------
    async def admit(self, peer: str, join_token: str, announce: Announce, now: float) -> tuple[bool, str]:
        looked_up = await self.store.call(lambda st: (st.ban_reason(peer), st.is_allowed(peer)))
        d = self.admission.decide(peer, join_token, now, looked_up=looked_up)
        problem = claim_problem(announce.rollouts_per_s, announce.price_usd_per_hour, self.claims)
        if d.admitted and problem is not None:
            d = Decision(False, f"announcement refused: {problem}", "bad_claim")
        if d.admitted and d.token_id:
            # counted (and a revocation seen) only once everything else said yes
            refused = await self.store.call(HubStore.use_token, d.token_id, peer, d.max_uses, now)
            if refused is not None:
                d = Decision(False, self.admission.token_refusal(refused), refused)
        self.store.submit(HubStore.log_admission, peer, now, d.admitted, d.code, d.reason)
        if not d.admitted:
            self.refusals[f"admission_{d.code}"] += 1
            log.warning("refused admission of %s: %s", peer, d.reason)
            return False, d.reason
        node = self.nodes.get(peer)
        if node is None:
            node = self.nodes[peer] = NodeInfo(peer, announce, now, now)
            node.__dict__["_watch"] = self.eligibility_changed
            node.__dict__["_seen"] = self.silence
            node.__dict__["_tok"] = self.tokens_changed
            node.__dict__["_status"] = self.status_changed
            self.status_changed.add(peer)  # its first entry
            self.tokens_changed.add(peer)  # sampled from its first count (0), as it joined
            self.silence.heard(peer, now)
            self._admitted[peer] = next(self._admission_seq)
            log.info("admitted node %s (%s, price %.3f $/h)", peer, announce.cpu_model or "?", announce.price_usd_per_hour)
            self.changed = True
        else:
            node.announce, node.last_seen = announce, now
        if self.dispatcher.timed_tasks(peer):  # a claim is checked against timed work: a new node has none
            self._claim_changed.add(peer)  # (10,000 joiners at once were 10,000 visits by the next tick)
        known = self.ledger.price_micro(peer) / MICRO if peer in self.ledger else None
        price = self.prices.admit(peer, announce.price_usd_per_hour, now, known)
        if known is None or to_micro(price) != self.ledger.price_micro(peer):
            self.ledger.set_price(peer, price, now)
        self.store.submit(HubStore.upsert_node, peer, now, announce=announce.to_wire(), price=price, state="standby")
        # the claim only seeds a probation: small tasks until the hub has timed one
        self.dispatcher.add_node(peer, rate=max(announce.rollouts_per_s, 1.0), claimed=True)
        self.eligibility_changed.add(peer)  # add_node made it active: the outbox checks its version
        self.dispatcher.seed_rate(peer, announce.rollouts_per_s)
        if self.active is None or node.paused:  # the first decision is a full one; a paused node waits
            self.activate()
        else:
            self._apply(*self.activation.join(peer, self._offer(peer)))
        return True, d.reason

    def announced(self, peer: str, announce: Announce) -> None:
        node = self.nodes.get(peer)
        if node is None or announce.peer_id != peer:
            return
        problem = claim_problem(announce.rollouts_per_s, announce.price_usd_per_hour, self.claims)
        if problem is not None:
            self.refusals["announce_bad_claim"] += 1
            log.warning("ignored an announcement of %s: %s", peer, problem)
            return
        node.announce = announce
        self._claim_changed.add(peer)
        self.prices.ask(peer, announce.price_usd_per_hour)
        self.dispatcher.seed_rate(peer, announce.rollouts_per_s)

    # --- prices and claims (BRIEF §6: measured rates, bounded prices) -------------------------------
    def task_issued(self, task_id: str, peer: str) -> None:
        self.prices.issued(task_id, peer)

    def task_price_micro(self, task_id: str, peer: str) -> int:
        """The price in force when ``task_id`` was issued: what its ledger entry records."""
        return to_micro(self.prices.task_price(task_id, peer))

    def tick(self, now: float) -> None:
        """Once a second: price changes due, overclaims, the billed time saved, fleet changes logged."""
        # only nodes whose price is moving or whose claim or timing changed can be due (visiting
        # every node took ~25 ms a second at 10,000 nodes, `echo2 bench intake`); in admission
        # order, at most TICK_BATCH a tick (~10 us a node: the first tick after admitting 10,000
        # nodes at once visited all of them, ~90 ms of loop, measured on a hub in-process)
        pending = self._tick_pending
        pending |= self.dispatcher.timing_changed
        self._rates_unsaved |= self.dispatcher.timing_changed
        pending |= self._claim_changed
        self.dispatcher.timing_changed, self._claim_changed = set(), set()
        moving = self.prices.moving
        if len(moving) + len(pending) <= TICK_BATCH:
            batch = sorted(moving | pending, key=self._admission_rank)
            pending.clear()
        else:  # a backlog: drained TICK_BATCH a tick, in no particular order, O(batch) to pick
            if len(moving) > TICK_BATCH // 2:
                pending |= moving
                moving = set()
            batch = list(moving) + [pending.pop() for _ in range(min(len(pending), TICK_BATCH - len(moving)))]
        for peer in batch:
            node = self.nodes.get(peer)
            if node is None:  # a punishment may ban (and remove) a node
                continue
            st = self.dispatcher.nodes.get(peer)
            billed = self.prices.step(peer, now, st.in_flight if st is not None else ())
            if billed is not None:
                log.info("node %s is billed %.6g $/h from now on", peer, billed)
                self.ledger.set_price(peer, billed, now)
                self.store.submit(HubStore.upsert_node, peer, now, price=billed)
            claim = node.announce.rollouts_per_s
            measured = self.dispatcher.measured_rate(peer)
            if self._overclaim_punished.get(peer) != claim and overclaims(
                claim, measured, self.dispatcher.timed_tasks(peer), self.claims
            ):
                self._overclaim_punished[peer] = claim
                self.punish(peer, Event.OVERCLAIM, f"claimed {claim:.3g} rollouts/s, measured {measured or 0.0:.3g}")
        self.prices.forget_tasks(self.dispatcher.in_flight)
        # the accounts changed since the last save, and the alive mark that bills open intervals
        # up to now after a restart (ledgerstore.py): every second, O(changed), not O(billed)
        self.store.submit(save_accounts, self.ledger.view(now, self.ledger.take_changed(LEDGER_SAVE_BATCH)))
        self.log_if_changed(now)

    def _admission_rank(self, peer: str) -> int:
        return self._admitted.get(peer, -1)

    def peer_info(self, peer: str) -> PeerInfo | None:
        """Planning input, from what the hub observed (A10, see ``links``): the IP the node's
        control connection comes from with the announced port (or the hello's: the node's word
        either way, and only the port is used), reachable only once a dial-back proved the node
        there, the upload the hub measured. Never None, so no caller falls back to a claim."""
        node = self.nodes.get(peer)
        if node is None:
            return PeerInfo("", 0.0, False)  # not admitted (or gone): a leaf nobody dials
        a = node.announce
        hello = getattr(self.sender, "hello", {}).get(peer)
        data_addr = a.data_addr or (hello.data_addr if hello is not None else "")
        v = self.links.view(peer, data_addr, a.max_upload_MBps * 1e6, self.nodes)
        return PeerInfo(v.data_addr, v.upload_Bps, v.reachable)

    def set_paused(self, peer: str, paused: bool, reason: str, now: float) -> None:
        """A node paused (or resumed) computing by its owner's preferences (issue 19): it is
        unavailable, not failing. No reputation event; activation leaves it out (so the ledger
        stops billing it and others are chosen in its place) until it resumes. Its keepalive."""
        node = self.nodes.get(peer)
        if node is None:
            return
        node.last_seen = now
        was = node.paused
        node.paused = (reason or "paused") if paused else ""
        if bool(was) != paused:
            log.info("node %s %s", peer, f"paused computing: {node.paused}" if paused else "resumed computing")
            self.changed = True
            if self.active is None:
                self.activate()
            else:
                self._apply(*(self.activation.leave(peer) if paused else self.activation.join(peer, self._offer(peer))))
            if paused:
                self.store.submit(HubStore.set_node_state, peer, "paused")

    def drop_silent(self, now: float, silence_s: float) -> list[str]:
        """Nodes not heard from for ``silence_s``: forgotten (the caller reassigns their tasks)."""
        gone = self.silence.silent(self.nodes, now, silence_s)
        if len(gone) > 1:  # in admission order, as the scan over every node found them
            rank = {p: i for i, p in enumerate(self.nodes)}
            gone.sort(key=rank.__getitem__)
        for peer in gone:
            log.warning("node %s silent for %.0fs: dropping it; its tasks are reassigned", peer, now - self.nodes[peer].last_seen)
            # billed up to the last time it was heard from: the silence is not work the operator got
            self.ledger.deactivate(peer, self.nodes[peer].last_seen)
            self.store.submit(HubStore.set_node_state, peer, "gone")
            self.changed = True
            self.eligibility_changed.add(peer)
            self.silence.forget(peer)
            del self.nodes[peer]
            self._apply(*self.activation.leave(peer))
        return gone

    # --- reputation ------------------------------------------------------------------------------
    def punish(self, peer: str, event: Event, detail: str, reporter: str | None = None) -> None:
        node = self.nodes.get(peer)
        if node is not None and reporter is None:
            node.refused += 1
        out = self.reputation.record(peer, event, detail, reporter=reporter)
        self.store.submit(HubStore.set_reputation, peer, out.score, self.reputation.snapshot(peer))
        if out.ban:
            self.ban(peer, out.ban)

    def ban(self, peer: str, reason: str) -> None:
        log.warning("banning node %s: %s", peer, reason)
        now = time.time()
        self.store.submit(HubStore.ban, peer, reason, now)
        self.banned[peer] = reason
        self.refusals["banned"] += 1
        self.ledger.deactivate(peer, now)
        self.nodes.pop(peer, None)
        self.eligibility_changed.add(peer)
        self.silence.forget(peer)
        self._apply(*self.activation.leave(peer))
        self.on_ban(peer)

    def checked(self, diffs: dict[str, float]) -> None:
        """Each node's worst log-prob difference in a step's verification."""
        for peer, diff in diffs.items():
            if not peer or peer not in self.nodes:
                continue
            if diff > self.cfg.logprob_tolerance:
                self.punish(peer, Event.MISMATCH, f"max |Δlogprob| {diff:.3g} > {self.cfg.logprob_tolerance:g}")
            else:
                self.reputation.record(peer, Event.CHECK_OK)

    def relay_report(self, peer: str, rep: RelayReport) -> str:
        """A node says a peer relayed it a chunk off the signed manifest. What the hub can check,
        it checks (the version is one it published and still knows, the expected hash is that
        chunk's ``enc_hash``, the received one differs); the rest is an accusation, which is
        recorded and makes the accused a suspect that must serve the hub a chunk. It is punished
        (banned, :meth:`convicted`) only if what it serves the hub is corrupt: no number of
        reports counts as evidence (A9: two Sybils under an honest relay could otherwise ban it).
        Returns the reply's message; raises MeaningError for a report that contradicts what the
        hub knows."""
        if rep.peer_id != peer:
            raise MeaningError("relay report names another reporter")
        if rep.accused == peer:
            raise MeaningError("a node cannot report itself")
        pub = self.publisher.recent.get(rep.version)
        if pub is None:
            # Too old (or never published): nothing to check it against; not held against anyone.
            return "version no longer known; ignored"
        chunks = pub.packed.manifest.chunks
        if rep.index >= len(chunks) or chunks[rep.index].enc_hash != rep.expected_hash:
            raise MeaningError(f"chunk {rep.index} of v{rep.version} does not have the expected hash reported")
        if rep.got_hash == rep.expected_hash:
            raise MeaningError("the reported chunk matches the manifest")
        if rep.accused not in self.nodes:
            # Only admitted nodes relay; a made-up or departed name costs nothing to keep out.
            return "accused is not an admitted node; ignored"
        if not self.sender.was_parent(rep.version, peer, rep.index, rep.accused):
            # A node can only accuse the parent the hub's own plan gave it for that chunk, so a
            # liar cannot pick its victims (it may still pull from other peers; those chunks are
            # verified all the same, but reports about them are not evidence the hub can place).
            return "accused was not its parent for that chunk; ignored"
        new_reporter = peer not in self.reputation.get(rep.accused).relay_reporters
        self.relay_reports_received += 1
        self.store.submit(HubStore.record_relay_report, rep.accused, peer, rep.version, rep.index, time.time())
        if not new_reporter:
            return "noted (already reported by this peer)"
        log.warning("relay report: %s relayed a corrupt chunk %d of v%d to %s", rep.accused, rep.index, rep.version, peer)
        out = self.reputation.record(rep.accused, Event.RELAY_REPORTED, reporter=peer)
        self.store.submit(HubStore.set_reputation, rep.accused, out.score, self.reputation.snapshot(rep.accused))
        self.sender.accuse(rep.accused, f"corrupt chunk {rep.index} of v{rep.version} reported by {peer}", rep.index)
        return "noted"

    def convicted(self, peer: str, why: str) -> None:
        """The hub's own evidence: ``peer`` served the hub a chunk off the signed manifest."""
        self.punish(peer, Event.CORRUPT_RELAY, why)

    # --- cost-aware activation (BRIEF §6) ----------------------------------------------------------
    def activate(self, t_train: float | None = None, trained: bool | None = None) -> None:
        """Pick the nodes that get tasks, from scratch: every free node, plus the cheapest cover of
        the rest of R* = margin·B/T_train among paid ones (hub-measured rates, announced prices),
        keeping the current paid set unless the new optimum is clearly cheaper (hysteresis). The
        housekeeping runs it every few seconds (rates and T_train move); joins, pauses and leaves
        between update the set by events (:class:`ActiveSet`)."""
        t_train = self.t_train() if t_train is None else t_train
        trained = self.trained() if trained is None else trained
        cost_aware = self.cfg.activation != "all" and trained
        need = self.cfg.activation_margin * self.cfg.prompts_per_step * self.cfg.group_size / max(t_train, 1e-6)
        # a paused node is unavailable; hub-measured rates only: an untimed node works on probation
        offers = {p: self._offer(p) for p, n in self.nodes.items()
                  if not n.paused and (not cost_aware or p in self.dispatcher.nodes)}
        first = self.active is None
        added, removed = self.activation.solve(offers, cost_aware, need)
        self._apply(added, removed, first=first)
        if (added or removed) and not first:
            log.info("activation: %d active, %d standby %s", len(self.activation.active),
                     len(self.nodes) - len(self.activation.active), self.last_activation)

    async def reactivate(self) -> None:
        """The housekeeping's periodic decision: :meth:`activate`, unless it cannot change anything.
        Not cost-aware (``activation = "all"``, or nothing trained yet) the active set is every
        available node, which joins, pauses and leaves keep (:class:`ActiveSet`); rebuilding the
        offers of every node to find that cost the loop ~25 ms every 5 s at 10,000 nodes
        (/tmp profile of the hub at rest, `echo2 bench intake --clients`). Cost-aware, the offers
        are read and the cover solved in a worker thread: 15 ms of offers and 3-40 ms of solving
        on the loop every 5 s at 10,000 nodes (the exact stage's table), a p99 loop lag of its own.
        The decision is then taken on the loop with the events since (:meth:`ActiveSet.adopt`)."""
        trained = self.trained()
        if self.active is not None and not self.activation.cost_aware and not (self.cfg.activation != "all" and trained):
            return
        if self.active is None:
            self.activate(trained=trained)
            return
        t_train = self.t_train()
        cost_aware = self.cfg.activation != "all" and trained
        need = self.cfg.activation_margin * self.cfg.prompts_per_step * self.cfg.group_size / max(t_train, 1e-6)
        act, mark, items = self.activation, self.activation.mark(), list(self.nodes.items())
        prev_paid = set(act.paid)
        dnodes = self.dispatcher.nodes

        def decide() -> tuple[dict[str, Offer], ActiveDecision]:
            # reads live dicts one key at a time (each lookup atomic under the GIL), never iterates them
            offers = {p: self._offer(p) for p, n in items if not n.paused and (not cost_aware or p in dnodes)}
            return offers, choose_active(offers, cost_aware, need, prev_paid, act.min_gain)

        offers, decided = await trio.to_thread.run_sync(decide)
        changed = act.adopt(offers, cost_aware, need, decided, mark)
        if changed is None:  # an event re-solved on the loop meanwhile: the set is already fresh
            return
        self._apply(*changed)
        if changed[0] or changed[1]:
            log.info("activation: %d active, %d standby %s", len(act.active), len(self.nodes) - len(act.active),
                     self.last_activation)

    def _offer(self, peer: str) -> Offer:
        return self.prices.offered(peer), self.dispatcher.measured_rate(peer)

    def _apply(self, added: set[str], removed: set[str], first: bool = False) -> None:
        """Bill, record and re-check the eligibility of the nodes whose activation changed."""
        if self.active is None and not first:
            return  # no decision yet (everyone may work): nothing to bill or re-check
        act = self.activation.last
        if act is not None:
            self.last_activation = {
                "required_rate": self.activation.last_need, "method": act.method, "cost_usd_per_hour": act.cost,
                "shortfall": act.shortfall, "ms": round(act.elapsed_ms, 3),
            }
        now = time.time()
        for p in added:
            self.ledger.activate(p, now)
            self.store.submit(HubStore.set_node_state, p, "active")
        for p in removed:
            self.ledger.deactivate(p, now)
            if p in self.nodes:
                self.store.submit(HubStore.set_node_state, p, "standby")
        if first:  # before the first decision everyone could work: who is not active now changed
            self.eligibility_changed |= self.activation.active ^ set(self.nodes)
            self.status_changed |= self.activation.active ^ set(self.nodes)
        else:
            self.eligibility_changed |= added | removed
            self.status_changed |= added | removed
        self.active = self.activation.active

    def t_train(self) -> float:
        return self.figures.t_train()

    def trained(self) -> bool:
        return bool(self.figures.history)

    # --- capacity model (BRIEF §5) ----------------------------------------------------------------
    def capacity(self) -> list[NodeCapacity]:
        """Per node D_i (receive + load a version), G_i (one task) and r_i, all hub-measured."""
        out = []
        per_node = max(1, self.cfg.prompts_per_step // max(1, len(self.nodes)))
        for peer in self.nodes:
            rate = self.dispatcher.planning_rate(peer) if peer in self.dispatcher.nodes else 0.0
            g = (self.cfg.group_size * per_node) / rate if rate > 0 else 0.0
            out.append(NodeCapacity(peer, load_s=self.publisher.load_s.get(peer, 0.0), task_s=g, rate=rate))
        return out

    def capacity_report(self, staleness: int | None = None) -> CapacityReport:
        b = self.cfg.prompts_per_step * self.cfg.group_size
        s = self.cfg.staleness if staleness is None else staleness
        return capacity_report(b, self.t_train() or 1e-3, s, self.capacity(), overhead_s=self.figures.step_overhead())

    def predicted_busy_fraction(self) -> float:
        """The capacity model's learner utilization for the measured fleet (BRIEF §5), as
        :meth:`predicted_busy_fraction_recent` keeps it."""
        return self.predicted_busy_fraction_recent(time.time())

    def _predicted_busy_now(self) -> float:
        if not self.trained() or not self.nodes:
            return 0.0
        try:
            return float(self.capacity_report().predicted_utilization)
        except ValueError:
            return 0.0

    def predicted_busy_fraction_recent(self, now: float, max_age_s: float = 10.0) -> float:
        """:meth:`predicted_busy_fraction` for the status (every second) and each step's figures
        (twice a step): the capacity model walks every node (~45 ms on the loop at 10,000 nodes),
        so it is recomputed after a step or when ``max_age_s`` old, not at each join or leave (a
        fleet with churn changes at every status write)."""
        key = len(self.figures.history)
        cached = self._busy_cache
        if cached is None or cached[0] != key or not 0 <= now - cached[1] < max_age_s:
            cached = self._busy_cache = (key, now, self._predicted_busy_now())
        return cached[2]

    def capacity_meta(self) -> dict[str, Any]:
        return {
            "batch": self.cfg.prompts_per_step * self.cfg.group_size,
            "t_train": self.t_train(),
            "overhead_s": self.figures.step_overhead(),
            "staleness": self.cfg.staleness,
            "nodes": [{"node_id": n.node_id, "load_s": n.load_s, "task_s": n.task_s, "rate": n.rate} for n in self.capacity()],
        }

    def log_if_changed(self, now: float) -> None:
        """The capacity report in the log and the store when the fleet changed, at most every
        CAPACITY_LOG_EVERY_S: it walks every node and logs and stores 10,000 entries at 10,000
        nodes (~45 ms of loop), and with churn the fleet changes every second."""
        if self.changed and self.trained() and not 0 <= now - self._capacity_logged_at < CAPACITY_LOG_EVERY_S:
            self.changed, self._capacity_logged_at = False, now
            log.info("fleet changed (%d nodes):\n%s", len(self.nodes), self.capacity_report().format())
            self.store.submit(HubStore.set_meta, "capacity", self.capacity_meta())

    def persist_job(self, step: int) -> Callable[[HubStore], None]:
        """Snapshot (on the loop) what a trained step persists of the fleet; the job writes it."""
        now = time.time()
        accounts = self.ledger.view(now, self.ledger.take_changed(LEDGER_SAVE_BATCH))
        # the rates that moved since the last step's save (each tick collects them), not every
        # node's: O(fleet) on the loop and in the store's thread at every step before
        moved, self._rates_unsaved = self._rates_unsaved | self.dispatcher.timing_changed, set()
        rates = {p: r for p in moved if p in self.nodes and (r := self.dispatcher.measured_rate(p)) is not None}
        meta = self.capacity_meta() if step % 10 == 0 else None

        def write(st: HubStore) -> None:
            save_accounts(st, accounts)
            for peer, rate in rates.items():
                st.set_measured_rate(peer, rate)
            if meta is not None:
                st.set_meta("capacity", meta)

        return write
