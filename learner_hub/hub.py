"""The learner hub runtime: control plane, data plane, dispatcher, learner and publisher.

Everything that decides lives in pure modules (dispatch, grpo, packing); this module wires them
to trio: one libp2p host for control, one TCP data plane for policy chunks, the learner in a
worker thread, and a status file the demo and operators read.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from echo2.protocol import canonical, envelope
from echo2.protocol.errors import Echo2Error, MeaningError, NotAdmitted, SignerNotAllowed
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    AdmissionDecision,
    AdmissionRequest,
    Announce,
    ErrorReply,
    Heartbeat,
    HoldsVersion,
    RelayReport,
    Result,
    Task,
    TaskDecline,
    task_hash,
)
from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost, RequestLimits
from echo2.protocol.net.dataplane import DataPlaneServer
from echo2.protocol.net.peerlimit import KeyedRateLimiter
from echo2.protocol.net.ratelimit import UploadLimiter
from echo2.protocol.wire import (
    ADMISSION,
    DECLINE,
    HOLDS,
    MAX_CONTROL_REQUEST,
    MAX_RESULT,
    REPORT,
    RESULT,
    WORK,
    WORK_POLL_S,
)

from .admission import AdmissionPolicy
from .broadcast import UNLIMITED_BPS, PeerInfo, PipelinedSender, StarWithHolds
from .config import HubConfig
from .dispatch import DispatchConfig, Dispatcher, PromptGroup, ReplayBuffer
from .ledger import Ledger
from .probe_service import MAX_PROBE_REQUEST, PROBE, ProbeService, handle_probe_connection
from .publisher import PolicyPublisher, StarSender
from .reputation import Event, ReputationBook, ReputationConfig
from .status_http import StatusServer, hub_metrics
from .store import HubStore
from .storeworker import StoreWorker

log = logging.getLogger(__name__)

NODE_SILENCE_S = 3 * WORK_POLL_S + 15.0


@dataclass
class NodeInfo:
    peer_id: str
    announce: Announce
    admitted_at: float
    last_seen: float
    held_version: int = -1
    mailbox: deque[bytes] = field(default_factory=deque)
    wakeup: trio.Event = field(default_factory=trio.Event)
    tasks_done: int = 0
    rollouts: int = 0
    tokens: int = 0
    refused: int = 0


@dataclass
class PendingGroup:
    """A prompt being rolled out: what the hub needs to score its completions."""

    item: Any
    prompt_ids: list[int]


class Hub:
    def __init__(self, cfg: HubConfig) -> None:
        import torch

        from echo2.protocol import modelspec

        from .envs import make_env
        from .learner import Learner

        self.cfg = cfg
        self.dir = Path(cfg.dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(self.dir / "hub.key")
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        if cfg.model == "tiny":
            conf = modelspec.tiny_config(hidden=cfg.tiny_hidden, layers=cfg.tiny_layers)
            self.model_config, self.artifacts = modelspec.artifacts_for(conf, modelspec.tokenizer_json())
            model = modelspec.model_from_config(self.model_config)
        else:
            model, self.model_config, self.artifacts = modelspec.load_local_model(cfg.model)
        self.tok = modelspec.load_tokenizer(self.artifacts)
        # The KL reference is the initial policy, frozen.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        self.learner = Learner(
            model,
            self.tok,
            lr=cfg.lr,
            clip_eps=cfg.clip_eps,
            kl_coef=cfg.kl_coef,
            temperature=cfg.temperature,
            dtype=dtype,
            publish_dtype=torch.bfloat16 if cfg.publish_dtype == "bfloat16" else torch.float32,
            seed=cfg.seed,
            ref_model=ref_model,
        )
        env_kw: dict[str, Any] = {}
        if cfg.task == "jsonl":
            env_kw["path"] = cfg.dataset
        self.env = make_env(cfg.task, **env_kw)
        self.rng = random.Random(cfg.seed)
        self.dispatcher = Dispatcher(
            DispatchConfig(
                staleness=cfg.staleness,
                target_task_s=cfg.task_target_s,
                min_deadline_s=cfg.task_deadline_s,
                max_deadline_s=max(cfg.task_deadline_s, 900.0),
            )
        )
        self.buffer: ReplayBuffer[Any] = ReplayBuffer(cfg.staleness)
        self.pending: dict[str, PendingGroup] = {}
        self._batch_tasks: dict[str, int] = {}  # task id -> groups of it still in the buffer
        self.task_hashes: dict[str, bytes] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.replay = envelope.ReplayGuard()
        self.refusals: Counter[str] = Counter()
        self.publisher = PolicyPublisher(self.identity, self.model_config, self.artifacts, cfg)
        self.sender: Any
        if cfg.broadcast == "pipelined":
            self.sender = PipelinedSender(
                self.publisher, self.identity, hub_upload_MBps=cfg.upload_limit_MBps, node_info=self._peer_info
            )
        else:
            self.sender = StarWithHolds(StarSender(self.publisher), node_info=self._peer_info)
        self._buffer_changed = trio.Event()
        self._prompt_seq = 0
        self.history: list[dict[str, Any]] = []
        self.busy_s = 0.0
        self.t_first_batch: float | None = None
        self.t_last_step_end: float | None = None
        self.started = time.time()
        self.done = trio.Event()
        self.training = False
        self._fleet_changed_pending = False
        self.finished = False
        self._scratch: Any = None  # a model copy for spot-checks against parent versions
        self.spot_checks = 0
        self.active: set[str] | None = None  # None: no activation decision yet, everyone works
        self._active_paid: set[str] = set()
        self.last_activation: dict[str, Any] = {}
        self._host: Any = None
        self._data_server: Any = None
        self._probe_server: Any = None
        self.gossip_replay = envelope.ReplayGuard(window_s=300.0, max_entries=100_000)
        self._admission_bucket = KeyedRateLimiter(20.0, 50.0)
        self.addrs: list[str] = []
        self.data_addr = ""
        self.status_url = ""
        # operator state: persisted in DIR/hub.sqlite, checkpoints in DIR/checkpoints
        self.store = StoreWorker(self.dir)
        self.banned: dict[str, str] = self.store.banned()
        self.ledger = Ledger.restore(self.store.load_ledger())
        self.reputation = ReputationBook(ReputationConfig(relay_report_quorum=cfg.relay_report_quorum))
        self.relay_reports_received = 0
        for rec in self.store.list_nodes():
            if rec.rep_state:
                self.reputation.restore(rec.peer_id, rec.rep_state)
                if self.reputation.get(rec.peer_id).relay_reporters:
                    self.sender.distrust(rec.peer_id, "reported relaying corrupt chunks before a restart")
        self.admission = AdmissionPolicy(
            cfg.admission,
            cfg.allowlist,
            hub_peer_id=self.identity.peer_id,
        )
        self.resumed_from: int | None = None
        self.restored_results = 0
        self._resume()

    # --- persistence ---------------------------------------------------------------------------
    def _resume(self) -> None:
        """Continue from the last checkpoint; results accepted after it go back into the buffer."""
        ck = self.store.latest_checkpoint()
        if ck is None:
            return
        step, state = ck
        self.learner.load_checkpoint_state(state)
        self._prompt_seq = int(state.get("prompt_seq", 0))
        self.history = list(state.get("history", []))
        self.busy_s = float(state.get("busy_s", 0.0))
        self.resumed_from = step
        restored = 0
        for pr in self.store.pending_results(after_step=step):
            try:
                groups = _decode_groups(pr.payload)
            except Echo2Error as exc:
                log.warning("dropping unreadable pending result %s: %s", pr.task_id, exc)
                self.store.drop_pending([pr.task_id], "unreadable")
                continue
            for g in groups:
                self.buffer.add((pr.task_id, g), pr.version, step)
            self._batch_tasks[pr.task_id] = len(groups)
            restored += 1
        self.restored_results = restored
        log.info("resumed from checkpoint at step %d; %d accepted results not yet trained restored", step, restored)

    async def _checkpoint(self) -> None:
        extra = {"prompt_seq": self._prompt_seq, "history": copy.deepcopy(self.history), "busy_s": self.busy_s}
        step = self.learner.version

        def write() -> tuple[Path, int]:
            # the learner is not stepped while this runs (the learner loop awaits it)
            state = self.learner.checkpoint_state() | extra
            return HubStore.write_checkpoint_file(self.store.checkpoint_dir, step, state)

        final, size = await trio.to_thread.run_sync(write)
        self.store.submit(HubStore.record_checkpoint, step, final, size)

    def _peer_info(self, peer: str) -> PeerInfo | None:
        """Planning input from the node's signed Announce (its hello is only a fallback)."""
        node = self.nodes.get(peer)
        if node is None or not node.announce.data_addr:
            return None
        a = node.announce
        up = (a.max_upload_MBps or a.upload_MBps) * 1e6
        return PeerInfo(a.data_addr, up or UNLIMITED_BPS, a.reachable)

    # --- small helpers -------------------------------------------------------------------------
    def _signer_is(self, peer: str, admitted: bool = True) -> Callable[[str, type], bool]:
        def allowed(signer: str, _t: type) -> bool:
            if signer != peer:
                return False
            if admitted and signer not in self.nodes:
                raise NotAdmitted("this node is not admitted (the hub may have restarted): request admission")
            return True

        return allowed

    def _refuse(self, code: str, peer: str, msg: str) -> None:
        self.refusals[code] += 1
        log.warning("refused from %s: [%s] %s", peer, code, msg)

    def consume_step(self) -> int:
        """The learner step that rollouts dispatched now will feed: the next one while a step is
        training. Tasks ask for a version that will still be admissible then (>= step - S)."""
        return self.learner.version + (1 if self.training else 0)

    @property
    def batch_groups(self) -> int:
        return self.cfg.prompts_per_step

    def busy_fraction(self) -> float:
        if self.t_first_batch is None or self.t_last_step_end is None:
            return 0.0
        wall = self.t_last_step_end - self.t_first_batch
        return self.busy_s / wall if wall > 0 else 0.0

    # --- prompts ---------------------------------------------------------------------------------
    def _outstanding_groups(self) -> int:
        now = time.time()
        # a task long past its expected time is probably lost: don't let it block the refill
        in_flight = sum(
            len(t.groups) for t in self.dispatcher.in_flight.values() if now <= t.issued_at + 2 * t.expected_s + 1.0
        )
        return len(self.dispatcher.queue) + in_flight + len(self.buffer)

    def _refill(self) -> None:
        """Keep B·max(1, S-1) groups in the pipeline: the next batch(es), never more than S allows."""
        remaining_steps = self.cfg.steps - self.learner.version
        if remaining_steps <= 0:
            return
        # Rollouts queued beyond B·(S-1) would be consumed more than S steps after their version
        # was current (one step of lag is the version still travelling to the nodes), so they
        # would be dropped as stale: over-generation is pure waste.
        target = self.batch_groups * min(max(1, self.cfg.staleness - 1), remaining_steps)
        need = target - self._outstanding_groups()
        if need <= 0:
            return
        items = self.env.sample_prompts(need, self.rng)
        groups = []
        for item in items:
            self._prompt_seq += 1
            pid = f"p{self._prompt_seq}"
            ids = self.tok.encode(item.text, add_bos=True)
            self.pending[pid] = PendingGroup(item, ids)
            groups.append(PromptGroup(pid, tuple(ids), self.cfg.group_size))
        self.dispatcher.submit(groups)

    def _pump(self) -> None:
        """Hand queued prompt groups to nodes that hold a fresh enough version."""
        now = time.time()
        t = self.consume_step()
        min_v = max(0, t - self.cfg.staleness)
        self.dispatcher.set_active(
            p for p, n in self.nodes.items() if n.held_version >= min_v and (self.active is None or p in self.active)
        )
        for a in self.dispatcher.next_tasks(now, t):
            node = self.nodes.get(a.node_id)
            if node is None:
                self.dispatcher.on_node_left(a.node_id)
                continue
            task = Task(
                task_id=a.task_id,
                node_id=a.node_id,
                prompts=a.prompts,
                group_size=self.cfg.group_size,
                max_new_tokens=self.cfg.max_new_tokens,
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                seed=self.rng.randrange(2**62),
                min_version=a.min_version,
                max_version_lag=a.max_version_lag,
                deadline=a.deadline,
            )
            self.task_hashes[a.task_id] = task_hash(task)
            self.store.submit(HubStore.record_task, a.task_id, a.node_id, now, a.deadline, a.n_rollouts)
            # within the node's replay window (600 s), however long the deadline
            ttl = min(540.0, max(60.0, a.deadline - now + 60.0))
            node.mailbox.append(envelope.seal(self.identity, task, ttl_s=ttl))
            node.wakeup.set()

    # --- control-plane handlers (each guarded by ControlHost; raise Echo2Error to refuse) --------
    async def on_admission(self, peer: str, data: bytes) -> bytes:
        v = envelope.open_envelope(data, AdmissionRequest, replay=self.replay, allowed=self._signer_is(peer, admitted=False))
        req = v.message
        if req.peer_id != peer or req.announce.peer_id != peer:
            raise MeaningError("admission request names another peer")
        now = time.time()
        if not self._admission_bucket.allow("all", trio.current_time()):
            raise MeaningError("too many admission requests right now; retry later")
        ban, allowed = await self.store.call(lambda st: (st.ban_reason(peer), st.is_allowed(peer)))
        d = self.admission.decide(peer, req.join_token, now, looked_up=(ban, allowed))
        admitted, reason = d.admitted, d.reason
        self.store.submit(HubStore.log_admission, peer, now, admitted, d.code, reason)
        if not admitted:
            self.refusals[f"admission_{d.code}"] += 1
            log.warning("refused admission of %s: %s", peer, reason)
        else:
            node = self.nodes.get(peer)
            if node is None:
                self.nodes[peer] = NodeInfo(peer, req.announce, now, now)
                log.info("admitted node %s (%s, price %.3f $/h)", peer, req.announce.cpu_model or "?", req.announce.price_usd_per_hour)
                self._fleet_changed_pending = True
            else:
                node.announce, node.last_seen = req.announce, now
            self.store.submit(HubStore.upsert_node, peer, now, announce=req.announce.to_wire(), price=req.announce.price_usd_per_hour, state="standby")
            self.dispatcher.add_node(peer, rate=max(req.announce.rollouts_per_s, 1.0))
            self.dispatcher.seed_rate(peer, req.announce.rollouts_per_s)
            self.activate()
        decision = AdmissionDecision(
            peer_id=peer,
            admitted=admitted,
            reason=reason,
            hub_data_addr=self.data_addr,
            current_version=self.publisher.latest_version,
            staleness=self.cfg.staleness,
        )
        return envelope.seal(self.identity, decision)

    async def on_work(self, peer: str, data: bytes) -> bytes:
        envelope.open_envelope(data, Heartbeat, replay=self.replay, allowed=self._signer_is(peer))
        node = self.nodes[peer]
        node.last_seen = time.time()
        # versions_held is informational: after a hub restart a node may hold versions of the
        # crashed run under the same numbers, so only HoldsVersion for versions this hub process
        # sent counts (see on_holds).
        self._pump()
        with trio.move_on_after(WORK_POLL_S):
            while not node.mailbox:
                node.wakeup = trio.Event()
                await node.wakeup.wait()
        node.last_seen = time.time()
        if node.mailbox:
            return node.mailbox.popleft()
        return envelope.seal(self.identity, ErrorReply(code="no_work", message="no work right now"))

    async def on_result(self, peer: str, data: bytes) -> bytes:
        v = envelope.open_envelope(data, Result, replay=self.replay, allowed=self._signer_is(peer), max_size=MAX_RESULT)
        r = v.message
        node = self.nodes[peer]
        node.last_seen = time.time()
        try:
            if r.node_id != peer:
                raise SignerNotAllowed("result names another node")
            expected = self.task_hashes.get(r.task_id)
            if expected is not None and expected != r.task_hash:
                raise MeaningError("result is bound to a different task (task hash mismatch)")
            task = self.dispatcher.in_flight.get(r.task_id)
            if task is not None and task.node_id == peer:
                self._check_completions(task, r)
        except Echo2Error as exc:
            self._punish(peer, Event.FORGED, exc.message)
            self.store.submit(HubStore.record_result, r.task_id, peer, r.version, accepted=False, reason=exc.code, tokens=r.tokens,
                                     rollouts=len(r.completions), received_at=time.time())
            raise
        verdict = self.dispatcher.on_result(time.time(), r.task_id, peer, r.version, self.learner.version, len(r.completions))
        if not verdict.accepted:
            node.refused += 1
            self.ledger.refuse(peer, verdict.code.value)
            self.store.submit(HubStore.record_result, r.task_id, peer, r.version, accepted=False, reason=verdict.code.value,
                                     tokens=r.tokens, rollouts=len(r.completions), received_at=time.time())
            self._pump()
            raise MeaningError(f"result refused: {verdict.code.value}")
        assert verdict.task is not None
        groups = self._admit_result(verdict.task, r, node)
        self.store.submit(HubStore.record_result, r.task_id, peer, r.version, accepted=True, reason="accepted", tokens=r.tokens,
                                 rollouts=len(r.completions), received_at=time.time(), payload=_encode_groups(groups))
        self.store.submit(HubStore.close_task, r.task_id, "done", time.time())
        self.ledger.accept(peer, len(r.completions), r.tokens)
        self.reputation.record(peer, Event.ACCEPTED)
        self._refill()
        self._pump()
        return envelope.seal(self.identity, ErrorReply(code="ok", message="accepted"))

    def _punish(self, peer: str, event: Event, detail: str) -> None:
        node = self.nodes.get(peer)
        if node is not None:
            node.refused += 1
        out = self.reputation.record(peer, event, detail)
        self.store.submit(HubStore.set_reputation, peer, out.score, self.reputation.snapshot(peer))
        if out.ban:
            self.ban(peer, out.ban)

    def ban(self, peer: str, reason: str) -> None:
        log.warning("banning node %s: %s", peer, reason)
        now = time.time()
        self.store.submit(HubStore.ban, peer, reason, now)
        self.banned[peer] = reason
        self.refusals["banned"] += 1
        for tid in self.dispatcher.on_node_left(peer):
            self.store.submit(HubStore.close_task, tid, "reassigned", now)
        self.ledger.deactivate(peer, now)
        self.nodes.pop(peer, None)
        # its rollouts still waiting in the buffer are not trained on
        self.buffer.remove_if(lambda item: any(smp.node_id == peer for smp in item[1].samples))
        self._pump()

    def _check_completions(self, task: Any, r: Result) -> None:
        vocab = self.tok.vocab_size
        counts = Counter(c.prompt_index for c in r.completions)
        for i, g in enumerate(task.groups):
            if counts.get(i, 0) != g.group_size:
                raise MeaningError(f"prompt {i} has {counts.get(i, 0)} completions, expected {g.group_size}")
        for c in r.completions:
            if c.prompt_index >= len(task.groups):
                raise MeaningError(f"completion for prompt {c.prompt_index} outside the task")
            if len(c.token_ids) > self.cfg.max_new_tokens:
                raise MeaningError("completion longer than max_new_tokens")
            if any(t >= vocab for t in c.token_ids):
                raise MeaningError("token id outside the vocabulary")

    def _admit_result(self, task: Any, r: Result, node: NodeInfo) -> list[Any]:
        from .learner import Group, Sample

        out: list[Any] = []
        by_prompt: dict[int, list[Any]] = {}
        for c in r.completions:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        for i, g in enumerate(task.groups):
            pend = self.pending.pop(g.prompt_id, None)
            if pend is None:
                continue
            samples = []
            for c in by_prompt.get(i, []):
                ids = list(c.token_ids)
                text_ids = ids[:-1] if ids and ids[-1] in self.tok.stop_ids else ids
                reward = float(self.env.reward(pend.item, self.tok.decode(text_ids), c.finish_reason))
                samples.append(
                    Sample(
                        token_ids=ids,
                        logprobs=list(c.logprobs),
                        reward=reward,
                        version=r.version,
                        node_id=node.peer_id,
                        finish_reason=c.finish_reason,
                    )
                )
            group = Group(prompt_ids=pend.prompt_ids, samples=samples)
            out.append(group)
            if self.buffer.add((r.task_id, group), r.version, self.learner.version):
                self._batch_tasks[r.task_id] = self._batch_tasks.get(r.task_id, 0) + 1
        node.tasks_done += 1
        node.rollouts += len(r.completions)
        node.tokens += r.tokens
        self._buffer_changed.set()
        return out

    async def on_decline(self, peer: str, data: bytes) -> bytes:
        v = envelope.open_envelope(data, TaskDecline, replay=self.replay, allowed=self._signer_is(peer))
        if self.dispatcher.on_decline(v.message.task_id, peer, v.message.reason):
            self.store.submit(HubStore.close_task, v.message.task_id, f"declined:{v.message.reason_code}", time.time())
        self._pump()
        return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))

    async def on_holds(self, peer: str, data: bytes) -> bytes:
        v = envelope.open_envelope(data, HoldsVersion, replay=self.replay, allowed=self._signer_is(peer))
        node = self.nodes[peer]
        if v.message.version > self.publisher.latest_version:
            raise MeaningError(f"version {v.message.version} was never published by this hub")
        node.held_version = max(node.held_version, v.message.version)
        self.publisher.record_holds(peer, v.message.version)
        self._pump()
        return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))

    async def on_relay_report(self, peer: str, data: bytes) -> bytes:
        """A node says a peer relayed it a chunk off the signed manifest. What the hub can check,
        it checks (the version is one it published and still knows, the expected hash is that
        chunk's ``enc_hash``, the received one differs); the rest is an accusation: the accused
        stops relaying at once, and is banned when ``relay_report_quorum`` distinct peers
        report it (a single liar can thus demote a relay to a leaf, never ban it)."""
        v = envelope.open_envelope(data, RelayReport, replay=self.replay, allowed=self._signer_is(peer))
        rep = v.message
        if rep.peer_id != peer:
            raise MeaningError("relay report names another reporter")
        if rep.accused == peer:
            raise MeaningError("a node cannot report itself")
        pub = self.publisher.recent.get(rep.version)
        if pub is None:
            # Too old (or never published): nothing to check it against; not held against anyone.
            return envelope.seal(self.identity, ErrorReply(code="ok", message="version no longer known; ignored"))
        chunks = pub.packed.manifest.chunks
        if rep.index >= len(chunks) or chunks[rep.index].enc_hash != rep.expected_hash:
            raise MeaningError(f"chunk {rep.index} of v{rep.version} does not have the expected hash reported")
        if rep.got_hash == rep.expected_hash:
            raise MeaningError("the reported chunk matches the manifest")
        if rep.accused not in self.nodes:
            # Only admitted nodes relay; a made-up or departed name costs nothing to keep out.
            return envelope.seal(self.identity, ErrorReply(code="ok", message="accused is not an admitted node; ignored"))
        if not self.sender.was_parent(rep.version, peer, rep.index, rep.accused):
            # A node can only accuse the parent the hub's own plan gave it for that chunk, so a
            # liar cannot pick its victims (it may still pull from other peers; those chunks are
            # verified all the same, but reports about them are not evidence the hub can place).
            return envelope.seal(self.identity, ErrorReply(code="ok", message="accused was not its parent for that chunk; ignored"))
        rep_state = self.reputation.get(rep.accused)
        new_reporter = peer not in rep_state.relay_reporters
        self.relay_reports_received += 1
        self.store.submit(HubStore.record_relay_report, rep.accused, peer, rep.version, rep.index, time.time())
        if not new_reporter:
            return envelope.seal(self.identity, ErrorReply(code="ok", message="noted (already reported by this peer)"))
        log.warning("relay report: %s relayed a corrupt chunk %d of v%d to %s", rep.accused, rep.index, rep.version, peer)
        self.sender.distrust(rep.accused, f"corrupt chunk {rep.index} of v{rep.version} reported by {peer}")
        detail = f"chunk {rep.index} of v{rep.version}, reported by {peer}"
        out = self.reputation.record(rep.accused, Event.CORRUPT_RELAY, detail, reporter=peer)
        self.store.submit(HubStore.set_reputation, rep.accused, out.score, self.reputation.snapshot(rep.accused))
        if out.ban:
            self.ban(rep.accused, out.ban)
        return envelope.seal(self.identity, ErrorReply(code="ok", message="noted"))

    async def on_announce(self, peer: str, data: bytes) -> None:
        # only admitted nodes' announcements matter; a separate, smaller replay cache keeps a flood
        # of throw-away keys from crowding out the one that guards results
        v = envelope.open_envelope(data, Announce, replay=self.gossip_replay, allowed=lambda s, _t: s in self.nodes)
        node = self.nodes.get(v.signer)
        if node is not None and v.message.peer_id == v.signer:
            if v.message.price_usd_per_hour != node.announce.price_usd_per_hour:
                self.ledger.set_price(v.signer, v.message.price_usd_per_hour, time.time())
            node.announce = v.message
            self.dispatcher.seed_rate(v.signer, v.message.rollouts_per_s)

    # --- loops -----------------------------------------------------------------------------------
    async def learner_loop(self) -> None:
        while self.learner.version < self.cfg.steps:
            self._refill()
            self._pump()
            batch = self.buffer.take_batch(self.learner.version, self.batch_groups)
            if batch is None:
                self._buffer_changed = trio.Event()
                with trio.move_on_after(1.0):
                    await self._buffer_changed.wait()
                continue
            t0 = time.time()
            if self.t_first_batch is None:
                self.t_first_batch = t0
            self.training = True
            # the batch just left the buffer: hand out the next one now, so that generation
            # overlaps this step (that is what the staleness bound buys)
            self._refill()
            self._pump()
            try:
                v_before = self.learner.version
                stats = await trio.to_thread.run_sync(self.learner.step, [g for _, (_, g) in batch])
            finally:
                self.training = False
            t1 = time.time()
            self.busy_s += t1 - t0
            self.t_last_step_end = t1
            self.history.append(
                {
                    "step": self.learner.version,
                    "t": round(t1 - self.started, 3),
                    "reward": stats.reward_mean,
                    "loss": stats.loss,
                    "staleness_mean": stats.staleness_mean,
                    "mismatch_max": stats.mismatch_max,
                    "train_s": round(t1 - t0, 4),
                    "busy_fraction": self.busy_fraction(),
                    "predicted_busy_fraction": self.predicted_busy_fraction(),
                }
            )
            log.info(
                "step %d reward %.3f loss %.4f staleness %.2f busy %.2f",
                self.learner.version, stats.reward_mean, stats.loss, stats.staleness_mean, self.busy_fraction(),
            )
            spot = await trio.to_thread.run_sync(self._spot_check, [g for _, (_, g) in batch], v_before)
            self._verify(stats, spot)
            await self.publish()
            self._refill()
            self._pump()
            await self._persist_step([tid for _, (tid, _) in batch])
            self.history[-1]["overhead_s"] = round(time.time() - t1, 4)
            self.write_status()
        log.info("finished %d steps", self.cfg.steps)
        self.write_status(final=True)
        self.done.set()

    def _verify(self, stats: Any, spot: dict[str, float]) -> None:
        """BRIEF §7: node log-probs must match the learner's: rows made with its current version
        (all of them, checked during the step) and a spot-check of stale rows (``spot``)."""
        # The learner's in-step check compares with its own master weights: exact only when nodes
        # run exactly those (fp32 publication); with bf16 publication the spot-check against the
        # published weights (which covers the current version too) is the reference.
        diffs = dict(stats.mismatch_by_node) if self.cfg.publish_dtype == self.cfg.dtype else {}
        for peer, d in spot.items():
            diffs[peer] = max(d, diffs.get(peer, 0.0))
        for peer, diff in diffs.items():
            if not peer or peer not in self.nodes:
                continue
            if diff > self.cfg.logprob_tolerance:
                self._punish(peer, Event.MISMATCH, f"max |Δlogprob| {diff:.3g} > {self.cfg.logprob_tolerance:g}")
            else:
                self.reputation.record(peer, Event.CHECK_OK)

    def _spot_check(self, groups: list[Any], current: int) -> dict[str, float]:
        """Recompute a sample of stale rows (one per node and version) under the published
        parent version they were made with, kept by the publisher (worker thread)."""
        from echo2.protocol import packing
        from echo2.protocol.modelspec import teacher_forced_logprobs

        # rows of the current version are already checked in the step when nodes run the master
        # weights themselves; otherwise they are spot-checked here like stale ones
        same_weights = self.cfg.publish_dtype == self.cfg.dtype
        picked: dict[tuple[str, int], tuple[list[int], Any]] = {}
        for g in groups:
            for smp in g.samples:
                if (
                    smp.version <= current
                    and (smp.version < current or not same_weights)
                    and smp.node_id
                    and (smp.node_id, smp.version) not in picked
                    and smp.token_ids
                ):
                    picked[(smp.node_id, smp.version)] = (g.prompt_ids, smp)
        out: dict[str, float] = {}
        if not picked:
            return out
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.learner.model).eval().requires_grad_(False)
        for version in sorted({v for _, v in picked}):
            pub = self.publisher.recent.get(version)
            if pub is None:
                continue
            sd = packing.assemble(pub.packed.manifest, pub.packed.raw_chunks)
            self._scratch.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in sd.items()})
            for (peer, v), (prompt, smp) in picked.items():
                if v != version:
                    continue
                ref = teacher_forced_logprobs(self._scratch, prompt, smp.token_ids, self.cfg.temperature)
                diff = max((abs(a - b) for a, b in zip(ref, smp.logprobs, strict=True)), default=0.0)
                out[peer] = max(out.get(peer, 0.0), diff)
        self.spot_checks += len(picked)
        return out

    # --- cost-aware activation (BRIEF §6) ----------------------------------------------------------
    def activate(self) -> None:
        """Pick the nodes that get tasks: every free node, plus the cheapest cover of the rest of
        R* = margin·B/T_train among paid ones (hub-measured rates, announced prices), keeping the
        current paid set unless the new optimum is clearly cheaper (hysteresis)."""
        from .activation import NodeOffer, reselect

        if self.cfg.activation == "all" or not self.history or not self.nodes:
            new = set(self.nodes)
        else:
            need = self.cfg.activation_margin * self.batch_groups * self.cfg.group_size / max(self.t_train(), 1e-6)
            offers = [
                NodeOffer(p, float(n.announce.price_usd_per_hour), self.dispatcher.rate_of(p))
                for p, n in self.nodes.items()
                if p in self.dispatcher.nodes
            ]
            free = {o.node_id for o in offers if o.price == 0}
            rest = need - sum(o.rate for o in offers if o.node_id in free)
            paid = [o for o in offers if o.price > 0]
            chosen: set[str] = set()
            if rest > 0 and paid:
                act = reselect(self._active_paid, paid, rest, min_gain=0.05)
                chosen = set(act.selected)
                self.last_activation = {
                    "required_rate": need, "method": act.method, "cost_usd_per_hour": act.cost,
                    "shortfall": act.shortfall, "ms": round(act.elapsed_ms, 3),
                }
            self._active_paid = chosen
            new = free | chosen
        now = time.time()
        old = self.active if self.active is not None else set()
        for p in new - old:
            node = self.nodes.get(p)
            self.ledger.activate(p, now, node.announce.price_usd_per_hour if node else None)
            self.store.submit(HubStore.set_node_state, p, "active")
        for p in old - new:
            self.ledger.deactivate(p, now)
            if p in self.nodes:
                self.store.submit(HubStore.set_node_state, p, "standby")
        if new != old and self.active is not None:
            log.info("activation: %d active, %d standby %s", len(new), len(self.nodes) - len(new), self.last_activation)
        self.active = new

    # --- capacity model (BRIEF §5) ----------------------------------------------------------------
    def step_overhead(self) -> float:
        recent = [h["overhead_s"] for h in self.history[-20:] if "overhead_s" in h]
        return sum(recent) / len(recent) if recent else 0.0

    def t_train(self) -> float:
        recent = [h["train_s"] for h in self.history[-20:]]
        return sum(recent) / len(recent) if recent else 0.0

    def fleet_capacity(self) -> list[Any]:
        """Per node D_i (receive + load a version), G_i (one task) and r_i, all hub-measured."""
        from .capacity import NodeCapacity

        out = []
        for peer in self.nodes:
            rate = self.dispatcher.rate_of(peer) if peer in self.dispatcher.nodes else 0.0
            d = self.publisher.load_s.get(peer, 0.0)
            g = (self.cfg.group_size * max(1, self.batch_groups // max(1, len(self.nodes)))) / rate if rate > 0 else 0.0
            out.append(NodeCapacity(peer, load_s=d, task_s=g, rate=rate))
        return out

    def capacity_report(self, staleness: int | None = None) -> Any:
        from .capacity import capacity_report

        nodes = self.fleet_capacity()
        b = self.batch_groups * self.cfg.group_size
        t = self.t_train() or 1e-3
        s = self.cfg.staleness if staleness is None else staleness
        return capacity_report(b, t, s, nodes, overhead_s=self.step_overhead())

    def predicted_busy_fraction(self) -> float:
        """The capacity model's learner utilization for the measured fleet (BRIEF §5)."""
        if not self.history or not self.nodes:
            return 0.0
        try:
            return float(self.capacity_report().predicted_utilization)
        except ValueError:
            return 0.0

    def _fleet_changed(self) -> None:
        rep = self.capacity_report()
        log.info("fleet changed (%d nodes):\n%s", len(self.nodes), rep.format())
        self.store.submit(HubStore.set_meta, "capacity", self._capacity_meta())

    def _capacity_meta(self) -> dict[str, Any]:
        return {
            "batch": self.batch_groups * self.cfg.group_size,
            "t_train": self.t_train(),
            "overhead_s": self.step_overhead(),
            "staleness": self.cfg.staleness,
            "nodes": [
                {"node_id": n.node_id, "load_s": n.load_s, "task_s": n.task_s, "rate": n.rate}
                for n in self.fleet_capacity()
            ],
        }

    async def _persist_step(self, task_ids: list[str]) -> None:
        """Mark fully trained results, checkpoint every K steps, persist the ledger. What the
        loop mutates (ledger, rates, counters) is snapshotted here, on the loop; the writes run in
        the store's thread. The learner itself is quiet until this returns (only this loop steps it)."""
        done = []
        for tid in task_ids:
            left = self._batch_tasks.get(tid, 1) - 1
            if left <= 0:
                self._batch_tasks.pop(tid, None)
                done.append(tid)
            else:
                self._batch_tasks[tid] = left
        step = self.learner.version
        now = time.time()
        ledger_rows = self.ledger.snapshot(now)
        rates = {p: self.dispatcher.rate_of(p) for p in self.nodes if p in self.dispatcher.nodes}
        meta = self._capacity_meta() if step % 10 == 0 else None
        self.store.submit(HubStore.mark_trained, done, step)
        if step % max(1, self.cfg.checkpoint_every) == 0 or step >= self.cfg.steps:
            await self._checkpoint()
            self.store.submit(HubStore.prune_payloads, step)

        def write(st: HubStore) -> None:
            st.save_ledger(ledger_rows, now)
            for peer, rate in rates.items():
                st.set_measured_rate(peer, rate)
            if meta is not None:
                st.set_meta("capacity", meta)

        await self.store.call(write)

    async def publish(self) -> None:
        sd = self.learner.state_dict_for_publish()
        await self.publisher.publish(self.learner.version, sd)
        self.sender.notify()

    async def housekeeping(self) -> None:
        tick = 0
        while True:
            await trio.sleep(1.0)
            tick += 1
            now = time.time()
            if tick % 5 == 0:
                self.activate()
            # bans and pardons made with the CLI while the hub runs reach the data plane's check
            self.banned = await self.store.call(HubStore.banned)
            expired = [(tid, t.node_id) for tid, t in self.dispatcher.in_flight.items() if now > t.deadline]
            if self.dispatcher.expire(now):
                for tid, peer in expired:
                    self.reputation.record(peer, Event.TIMEOUT)
                    self.store.submit(HubStore.close_task, tid, "expired", now)
                self._refill()
                self._pump()
            for peer, node in list(self.nodes.items()):
                if now - node.last_seen > (self.cfg.node_silence_s or NODE_SILENCE_S):
                    log.warning("node %s silent for %.0fs: dropping it; its tasks are reassigned", peer, now - node.last_seen)
                    for tid in self.dispatcher.on_node_left(peer):
                        self.store.submit(HubStore.close_task, tid, "reassigned", now)
                    self.ledger.deactivate(peer, now)
                    self.store.submit(HubStore.set_node_state, peer, "gone")
                    self._fleet_changed_pending = True
                    del self.nodes[peer]
                    self._pump()
            if self._fleet_changed_pending and self.history:
                self._fleet_changed_pending = False
                self._fleet_changed()
            self.write_status()

    # --- status ----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st = self.dispatcher.stats
        return {
            "peer_id": self.identity.peer_id,
            "addrs": self.addrs,
            "step": self.learner.version,
            "steps": self.cfg.steps,
            "staleness": self.cfg.staleness,
            "task": self.cfg.task,
            "wall_s": round(time.time() - self.started, 3),
            "learner_busy_fraction": self.busy_fraction(),
            "predicted_busy_fraction": self.predicted_busy_fraction(),
            "t_train_s": self.t_train(),
            "results_accepted": st.accepted,
            "rollouts_accepted": st.accepted_rollouts,
            "stale_dropped": st.stale_dropped + self.buffer.stale_dropped,
            "refused_by_reason": dict(Counter(st.refused_by_reason) + self.refusals + self._edge_refusals()),
            "relay_reports": self.relay_reports_received,
            "tasks_issued": st.issued,
            "tasks_expired": st.expired,
            "tasks_declined": st.declined,
            "latest_version": self.publisher.latest_version,
            "broadcast": self.publisher.broadcast_metrics(),
            "nodes": [
                {
                    "peer_id": n.peer_id,
                    "held_version": n.held_version,
                    "tasks_done": n.tasks_done,
                    "rollouts": n.rollouts,
                    "tokens": n.tokens,
                    "refused": n.refused,
                    "price_usd_per_hour": n.announce.price_usd_per_hour,
                    "reputation": round(self.reputation.score(n.peer_id), 4),
                    "state": "active" if self.active is None or n.peer_id in self.active else "standby",
                    "cost_usd": _cost(self.ledger.row(n.peer_id, time.time())),
                }
                for n in self.nodes.values()
            ],
            "history": self.history,
            "status_url": self.status_url,
            "resumed_from": self.resumed_from,
            "restored_results": self.restored_results,
            "ledger": self.ledger.totals(time.time()).as_dict(),
            "activation": self.last_activation,
            "spot_checks": self.spot_checks,
        }

    def _edge_refusals(self) -> Counter[str]:
        """Refusals counted by the network layer (control host, data planes), by reason."""
        out: Counter[str] = Counter()
        if self._host is not None:
            out.update({f"control.{k}": v for k, v in self._host.refusals.items()})
        for name, srv in (("dataplane", self._data_server), ("probe", self._probe_server)):
            if srv is not None:
                out.update({f"{name}.{k}": v for k, v in srv.stats.refusals.items()})
        return out

    def write_status(self, final: bool = False) -> None:
        s = self.status()
        self.finished = self.finished or final
        s["final"] = self.finished
        path = self.dir / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(s))
        os.replace(tmp, path)

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping the hub", signal.Signals(signum).name)
                self.write_status(final=True)
                scope.cancel()
                return

    # --- main ------------------------------------------------------------------------------------
    async def run(self) -> int:
        # Relay reports are rare for honest nodes (one per corrupt parent and version): a tight
        # per-peer budget keeps a liar from filling the database.
        limits = RequestLimits(per_protocol={REPORT: (1.0, 16.0)})
        async with ControlHost(
            self.identity, listen_port=self.cfg.listen_port, listen_host=self.cfg.listen_host, limits=limits
        ) as host:
            self._host = host
            host.set_handler(ADMISSION, self.on_admission, max_request=MAX_CONTROL_REQUEST)
            host.set_handler(WORK, self.on_work, max_request=MAX_CONTROL_REQUEST)
            host.set_handler(RESULT, self.on_result, max_request=MAX_RESULT)
            host.set_handler(DECLINE, self.on_decline, max_request=MAX_CONTROL_REQUEST)
            host.set_handler(HOLDS, self.on_holds, max_request=MAX_CONTROL_REQUEST)
            host.set_handler(REPORT, self.on_relay_report, max_request=MAX_CONTROL_REQUEST)
            await host.subscribe(ANNOUNCE_TOPIC, self.on_announce)
            async with trio.open_nursery() as nursery:
                server = DataPlaneServer(
                    self.identity,
                    self.sender.serve_connection,
                    host=self.cfg.listen_host,
                    port=self.cfg.data_port,
                    allow=lambda pid: pid in self.nodes and pid not in self.banned,
                    upload_limiter=UploadLimiter(self.cfg.upload_limit_MBps) if self.cfg.upload_limit_MBps > 0 else None,
                    max_connections=4096,
                    max_connections_per_ip=4096,
                )
                await nursery.start(server.serve)
                self._data_server = server
                self.data_addr = f"{self.cfg.listen_host}:{server.port}"
                if isinstance(self.sender, PipelinedSender):
                    self.sender.data_addr = self.data_addr
                # A separate data plane for `echo2 node doctor` bandwidth probes: it runs before
                # admission, and the policy downlink starts sending at once, so they cannot share.
                probe_srv = DataPlaneServer(self.identity, handle_probe_connection, host=self.cfg.listen_host, port=0, max_connections=16)
                await nursery.start(probe_srv.serve)
                self._probe_server = probe_srv
                self.probe = ProbeService(self.identity, control_host=host, probe_data_addr=f"{self.cfg.listen_host}:{probe_srv.port}")
                host.set_handler(PROBE, self.probe.handle_control, max_request=MAX_PROBE_REQUEST)
                self.addrs = list(host.addrs)
                (self.dir / "hub.addrs").write_text("\n".join(self.addrs) + "\n")
                print("echo2 hub listening:")
                for a in self.addrs:
                    print(f"  {a}")
                print(f"  data plane {self.data_addr}", flush=True)
                status = StatusServer(self.status, lambda: hub_metrics(self.status()), host="127.0.0.1", port=self.cfg.status_port)
                await nursery.start(status.serve)
                self.status_url = f"http://127.0.0.1:{status.port}/"
                print(f"  status {self.status_url} (metrics at /metrics)", flush=True)
                if self.resumed_from is not None:
                    print(f"  resumed from checkpoint at step {self.resumed_from}", flush=True)
                await self.publish()  # the current version (0 on a fresh start)
                nursery.start_soon(self.learner_loop)
                nursery.start_soon(self.housekeeping)
                nursery.start_soon(self._watch_signals, nursery.cancel_scope)
                await self.done.wait()
                if self.cfg.exit_when_done:
                    await trio.sleep(0.5)
                    nursery.cancel_scope.cancel()
                else:
                    await trio.sleep_forever()
        return 0


def run_hub(cfg: HubConfig) -> int:
    os.umask(0o077)  # key, database, checkpoints: the operator's only
    hub = Hub(cfg)

    async def main() -> int:
        return await hub.run()

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        hub.write_status(final=True)
        return 0
    finally:
        hub.store.close()  # runs the writes still queued


def _encode_groups(groups: list[Any]) -> bytes:
    """Accepted rollouts as stored for a restart (hub-computed rewards included)."""
    return canonical.encode(
        [
            {
                "prompt_ids": list(g.prompt_ids),
                "samples": [
                    {
                        "token_ids": list(s.token_ids),
                        "logprobs": [float(x) for x in s.logprobs],
                        "reward": float(s.reward),
                        "version": int(s.version),
                        "node_id": s.node_id,
                        "finish_reason": s.finish_reason,
                    }
                    for s in g.samples
                ],
            }
            for g in groups
        ]
    )


def _decode_groups(payload: bytes) -> list[Any]:
    from .learner import Group, Sample

    raw = canonical.decode(payload, max_size=1 << 30)
    try:
        return [Group(prompt_ids=list(g["prompt_ids"]), samples=[Sample(**s) for s in g["samples"]]) for g in raw]
    except (TypeError, KeyError) as exc:
        raise MeaningError(f"stored result payload is malformed: {exc}") from exc


def _cost(row: Any) -> float:
    return float(row.cost_usd) if row is not None else 0.0
