"""The volunteer node: connect, get admitted, receive policy versions, run signed tasks.

Three trio tasks share one libp2p host: the downlink (policy versions over the data plane),
the worker (long-polls the hub for tasks, samples in a worker thread, returns signed results)
and the heartbeat/announce loop. Every failure of the hub or the network is retried with
capped, jittered backoff; nothing from the network is trusted before it verifies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import deque
from typing import Any

import trio

from echo2 import __version__
from echo2.fsutil import atomic_write
from echo2.keyfile import load_or_create_identity
from echo2.looplag import LoopLag
from echo2.models import statedict
from echo2.models.engine_api import is_out_of_memory
from echo2.models.offline import model_hub_offline
from echo2.protocol import envelope, holdsproof
from echo2.protocol.backoff import Backoff
from echo2.protocol.errors import Echo2Error, MeaningError, TransportError
from echo2.protocol.framing import RemoteError
from echo2.protocol.messages import (
    AdmissionDecision,
    AdmissionRequest,
    Announce,
    ErrorReply,
    HoldsChallenge,
    HoldsProof,
    HoldsVersion,
    Manifest,
    RelayReport,
    Task,
)
from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost
from echo2.protocol.net.names import reachable_data_addr
from echo2.protocol.wire import (
    ADMISSION,
    HOLDS,
    MAX_CONTROL_REQUEST,
    REPORT,
)

from .budget import Budget, Footprint, check_model, footprint, memory_budget
from .chunkstore import ChunkStore
from .config import NodeConfig, NodeStats, hub_peer_id
from .hardware import probe
from .hublink import HubLink
from .pausing import Pauser
from .portmap import PortMapper
from .prefs import Prefs, memory_cap_MiB, threads_for
from .progress import NodeSteps, Progress
from .receipts import ReceiptBook
from .relay_runtime import RelayConfig, RelayNode
from .taskloop import HUB_BACKOFF_CAP_S, TaskLoop
from .versions import HeldVersion

log = logging.getLogger(__name__)

#: Relay reports waiting for the hub (one per corrupt chunk seen); more are dropped, not queued.
MAX_PENDING_REPORTS = 64
#: how long a stopping node keeps delivering finished results
DRAIN_S = 10.0
#: Error codes after which a report is worth sending again later.
_TRANSIENT_CODES = frozenset({"rate_limited", "busy", "timeout", "internal", "not_admitted", "too_many_streams", "too_slow"})


class Node(TaskLoop):
    # the policy downlink; a subclass (e.g. a test's hostile node) may swap it
    relay_cls: type[RelayNode] = RelayNode
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = load_or_create_identity(cfg.data_dir / "node.key")
        self.hub_peer = hub_peer_id(cfg.hub)
        self.stats = NodeStats()
        self.held: HeldVersion | None = None
        self.version_changed = trio.Event()
        self.replay = envelope.ReplayGuard(max_entries=65_536)  # only the hub's envelopes get here (signer checked first)
        self._engine_lock = trio.Lock()
        self._engine: Any = None
        self._hub_data_addr = ""
        self._seq = 0
        self.link: HubLink | None = None
        self._stop = trio.Event()
        self._started = time.time()
        self._current_task: Task | None = None
        self._queued: deque[Task] = deque()
        self._admitted = trio.Event()
        self.store = ChunkStore(cfg.data_dir / "store")
        self.receipts = ReceiptBook(cfg.data_dir)  # the hub's signed receipts, kept (issue 19)
        self.progress = Progress.for_terminal(cfg.json_events)  # what it waits for, said (issue 19)
        self.steps = NodeSteps(self.progress, self)
        self.relay: Any = None
        self._addrs: list[str] = []
        self.measured: dict[str, float] = {"tokens_per_s": 0.0, "rollouts_per_s": 0.0, "upload_MBps": 0.0, "download_MBps": 0.0}
        self.reachable = False
        self.portmap: PortMapper | None = None  # asks the home router to forward our ports (issue 18)
        self._measured_version = -1
        self._pending_holds: HoldsVersion | None = None
        # reports of peers that relayed us corrupt chunks, sent to the hub by the heartbeat loop
        self._pending_reports: list[RelayReport] = []
        self._reported: set[tuple[str, int]] = set()
        self.loop_lag = LoopLag()
        # memory accounting (A7): the budget, the loaded model's sizes, and the batch size that
        # last ran out of memory halved (0 = no cap yet); a new model resets it
        self._mem_budget: Budget | None = None
        self._footprint: Footprint | None = None
        self._rows_cap = 0
        # computing preferences (issue 19): when the node may compute, and how much of the machine
        self.pauser = Pauser(self.identity, self.hub_peer, cfg.data_dir, cfg.prefs)
        self.pauser.on_prefs_changed = self._prefs_changed
        self.pauser.on_change = self._write_state
        self.pauser.on_reply = lambda reply: self.receipts.statement(reply, hub_peer=self.hub_peer, me=self.peer_id,
                                                                     replay=self.replay)
        self.pauser.relay_bytes = lambda: (self.relay.bytes_in + self.relay.bytes_out) if self.relay is not None else 0
        self._host: ControlHost | None = None
        self.delivery = self._make_delivery()  # finished results: the outbox and its delivery task

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # --- helpers -------------------------------------------------------------------------------
    def _hub_only(self, signer: str, _t: type) -> bool:
        return signer == self.hub_peer

    def _announce(self, host: ControlHost) -> Announce:
        hw = probe(self.cfg.data_dir)
        eng = self._engine
        return Announce(
            peer_id=self.peer_id,
            software_version=__version__,
            accelerator=hw.accelerator,
            accelerator_count=hw.accelerator_count,
            accelerator_memory_bytes=hw.accelerator_memory_bytes,
            cpu_model=hw.cpu_model,
            cpu_cores=hw.cpu_cores,
            ram_bytes=hw.ram_bytes,
            free_disk_bytes=hw.free_disk_bytes,
            engine=getattr(eng, "name", self.cfg.engine),
            engine_version=str(getattr(eng, "engine_version", "")),
            tokens_per_s=self.measured["tokens_per_s"],
            rollouts_per_s=self.measured["rollouts_per_s"],
            upload_MBps=self.measured["upload_MBps"],
            download_MBps=self.measured["download_MBps"],
            price_usd_per_hour=self.cfg.price_usd_per_hour,
            listen_addrs=(self._mapped_listen_addrs(host) + list(host.addrs))[:16],
            data_addr=(self.relay.public_addr or self.relay.data_addr) if self.relay is not None else "",
            reachable=self.reachable,
            versions_held=[self.held.version] if self.held else [],
            max_upload_MBps=self.cfg.max_upload_MBps,
        )

    def _write_state(self) -> None:
        state = {
            "peer_id": self.peer_id,
            "hub": self.cfg.hub,
            "admitted": self.stats.admitted,
            "admission_reason": self.stats.admission_reason,
            "version": self.held.version if self.held else None,
            "versions_loaded": self.stats.versions_loaded[-8:],
            "tasks_done": self.stats.tasks_done,
            "tasks_declined": self.stats.tasks_declined,
            "results_refused": self.stats.results_refused,
            "tokens": self.stats.tokens,
            **self.delivery.report(),
            **self.pauser.status(),
            "price_usd_per_hour": self.cfg.price_usd_per_hour,
            "uptime_s": round(time.time() - self._started, 1),
            "addrs": self._addrs,
            **self.loop_lag.report(),
            "updated": time.time(),
        }
        # a status snapshot rewritten often: atomic for readers, not worth an fsync
        atomic_write(self.cfg.data_dir / "node.state.json", json.dumps(state, indent=1), durable=False)

    # --- main ------------------------------------------------------------------------------------
    async def run(self) -> int:
        model_hub_offline(self.cfg.model_hub_offline)  # before the engine can import transformers
        trio.lowlevel.spawn_system_task(self.progress.run)  # ends with the run
        self.steps.engine(self.cfg.engine)
        prefs = self.pauser.prefs
        threads = threads_for(prefs, probe(self.cfg.data_dir).cpu_cores, self.cfg.threads)
        # in a thread: importing torch took seconds here, and the progress watcher must keep talking
        self._engine = await trio.to_thread.run_sync(_select_engine, self.cfg.engine, threads)
        if prefs.gpu_memory_fraction and hasattr(self._engine, "gpu_memory_utilization"):
            self._engine.gpu_memory_utilization = prefs.gpu_memory_fraction  # read when vLLM is built
        log.info("node %s starting (engine %s, hub %s)", self.peer_id, self._engine.name, self.hub_peer)
        async with ControlHost(self.identity, listen_port=self.cfg.listen_port, listen_host=self.cfg.listen_host) as host:
            host.is_trusted = lambda peer: peer == self.hub_peer  # anyone else gets a stranger's small budget
            self._addrs = list(host.addrs)
            self._host = host
            await self.delivery.load()  # what an earlier run finished and could not deliver
            decision = await self._admit(host)
            if decision is None:
                return 1
            async with trio.open_nursery() as nursery:
                # heartbeats, holds and results on one long-lived channel when the hub offers one
                self.link = HubLink(host, self.identity, self.hub_peer, enabled=self.cfg.channel, replay=self.replay)
                nursery.start_soon(self.link.run)
                nursery.start_soon(self.loop_lag.run)
                await nursery.start(self._policy_downlink)
                self.portmap = PortMapper(self.cfg.port_map, lambda: self._listen_ports(host), host.remote_ip(self.hub_peer) or "",
                                          host=self.cfg.listen_host, on_change=self._port_map_changed)
                nursery.start_soon(self.portmap.run)
                nursery.start_soon(self._measure_after_admissions, host)
                nursery.start_soon(self._heartbeat, host)
                nursery.start_soon(self.delivery.run)
                nursery.start_soon(self._worker, host, nursery.cancel_scope)
                nursery.start_soon(self._watch_signals)
                nursery.start_soon(self.pauser.run, self.link)
                await self._stop.wait()
                await self._abandon_current(host)
                with trio.move_on_after(DRAIN_S):  # what is left stays on disk for the next run
                    await self.delivery.drain()
                await self._say_goodbye(host)
                nursery.cancel_scope.cancel()
        self._write_state()
        return 0

    def stop(self) -> None:
        self._stop.set()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping (the current task is handed back to the hub)", signal.Signals(signum).name)
                self._stop.set()
                return

    async def _abandon_current(self, host: ControlHost) -> None:
        task = self._current_task
        if task is not None:
            with trio.move_on_after(3):
                await self._decline(host, task, "shutdown", "node is shutting down")
        with trio.move_on_after(3):
            await self._abandon_queued(host)

    async def _say_goodbye(self, host: ControlHost) -> None:
        """Tell the hub we leave, so it stops billing us now rather than when it finds us silent,
        and keep its statement of our account: our receipts then sum to its ledger (issue 19)."""
        with trio.move_on_after(5):
            await self.pauser.tell(host, paused=True, code="leaving", reason="the node is stopping")

    async def _measure_links(self, host: ControlHost) -> None:
        """Reachability (the hub dials back), clock skew and bandwidth to the hub, hub-measured."""
        from .measure import measure_all

        try:
            res, bw = await measure_all(host, self.cfg.hub, self.hub_peer, self.identity, self._announce(host), timeout_s=10)
        except (Echo2Error, OSError) as exc:
            log.info("link measurement skipped: %s", exc)
            return
        self.reachable = res.reachable
        if abs(res.clock_skew_s) > 5:
            log.warning("clock differs from the hub's by %.1fs: tasks may look expired; sync your clock", res.clock_skew_s)
        if bw is not None:
            self.measured["upload_MBps"], self.measured["download_MBps"] = bw.upload_MBps, bw.download_MBps
        log.info("hub link: reachable=%s rtt %.1f ms, up %.1f MB/s, down %.1f MB/s", res.reachable, res.rtt_s * 1e3,
                 self.measured["upload_MBps"], self.measured["download_MBps"])

    def _listen_ports(self, host: ControlHost) -> list[int]:
        ports = [self.relay.server.port] if self.relay is not None else []
        try:
            return [host.listen_addr[1], *ports]
        except Echo2Error:  # no TCP listener (yet)
            return ports

    def _mapped_listen_addrs(self, host: ControlHost) -> list[str]:
        ports = self._listen_ports(host)
        return self.portmap.multiaddrs(ports[0], self.peer_id) if self.portmap is not None and ports else []

    async def _port_map_changed(self) -> None:
        if self.relay is not None and self.portmap is not None:
            await self.relay.set_public_addr(self.portmap.external_addr(self.relay.server.port))

    async def _measure_after_admissions(self, host: ControlHost) -> None:
        # After admission (the hub measures admitted nodes only), with the data plane up (so the
        # hub's dial-back can prove it), and again after each re-admission (a restarted hub knows
        # nothing of us): what the hub measures is what its broadcast planner trusts (A10, A12).
        if self.portmap is not None:  # measured after the router mapped our ports (or would not)
            with trio.move_on_after(15):
                await self.portmap.settled.wait()
        while True:
            admitted = self._admitted
            await self._measure_links(host)
            await admitted.wait()

    async def _admit(self, host: ControlHost) -> AdmissionDecision | None:
        backoff = Backoff(base_s=0.5, cap_s=HUB_BACKOFF_CAP_S)
        attempt = 0
        while True:
            try:
                attempt += 1
                self.steps.connecting(self.cfg.hub, attempt)
                await host.connect(self.cfg.hub)
                self.steps.admission(self.hub_peer)
                req = AdmissionRequest(peer_id=self.peer_id, join_token=self.cfg.join_token, announce=self._announce(host))
                resp = await host.request(
                    self.hub_peer, ADMISSION, envelope.seal(self.identity, req), max_response=MAX_CONTROL_REQUEST, timeout_s=30
                )
                v = envelope.open_envelope(resp, AdmissionDecision, replay=self.replay, allowed=self._hub_only)
                d = v.message
                self.stats.admitted, self.stats.admission_reason = d.admitted, d.reason
                self._write_state()
                if not d.admitted:
                    self.steps.refused(d.reason)
                    return None
                self._hub_data_addr = reachable_data_addr(d.hub_data_addr, host.remote_ip(self.hub_peer))
                self._admitted.set()
                self._admitted = trio.Event()
                log.info("admitted by hub %s (staleness %d, current version %d)", self.hub_peer, d.staleness, d.current_version)
                self.steps.admitted(d.current_version)
                return d
            except (Echo2Error, OSError) as exc:
                delay = backoff.failed()
                self.steps.unreachable(self.cfg.hub, attempt, exc, delay)
                await trio.sleep(delay)

    # --- policy versions -------------------------------------------------------------------------
    async def _policy_downlink(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Policy versions arrive through the relay runtime: chunks from the hub or from parent
        peers (star or pipelined, as the hub plans), verified against the signed manifest,
        stored crash-safely, forwarded to this node's children; complete versions get loaded.
        Stopped while the preferences stop relaying (see Pauser.while_relaying)."""
        await self.pauser.while_relaying(self._run_relay, task_status)

    async def _run_relay(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        relay = self.relay_cls(
            self.identity,
            self.store,
            self.hub_peer,
            self._hub_data_addr,
            # punch: the hub link leaves from the listen port, so that a hub with nat_punch can
            # join this node to another NAT-bound one by a punched hole (node.punch)
            RelayConfig(upload_MBps=self.cfg.max_upload_MBps, max_disk_bytes=self.pauser.prefs.max_disk_MiB * 1024**2,
                        punch=True),
            host=self.cfg.listen_host,
            on_holds=self._on_relay_holds,
            on_evidence=self._on_evidence,
            on_same_version=self._on_same_version,
        )
        relay.on_refused = self._on_version_refused
        if self.relay is not None:
            relay.held = self.relay.held  # a restarted relay: what is on disk and loaded stays known
        self.relay = relay
        await trio.lowlevel.checkpoint()
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            if self.portmap is not None:
                self.portmap.poke()  # a restarted relay listens on another port: map that one
            task_status.started()

    async def _on_relay_holds(self, info: Any) -> None:
        try:
            raw = await trio.to_thread.run_sync(self.store.load_raw_chunks, info.manifest)
            await self._load(HeldVersion(info.manifest, raw), info.seconds)
        except Echo2Error as exc:
            log.warning("version %d could not be loaded: %s", info.version, exc)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # the budget check passed but the machine had less to give: keep serving the old version
            log.error("version %d could not be loaded: out of memory (%s)", info.version, str(exc)[:200])

    def _on_version_refused(self, version: int, why: str) -> None:
        """A version this node cannot store: it cannot work on it either, so it pauses and tells
        the hub why (not a failure: no reputation cost) until a version fits (its load clears the
        block) or the owner changes the caps."""
        self.pauser.set_block("disk", f"version {version} does not fit this node's disk: {why}")

    def _on_same_version(self, version: int) -> None:
        # The hub sent a manifest identical to the version we hold and run (a hub resumed from a
        # checkpoint re-publishes what it retrains identically): report holding it, since we
        # will not load it again. Only for what the engine really runs: content equality was
        # checked against the relay's copy, which the engine loaded.
        if self.held is not None and self.held.version == version and self._pending_holds is None:
            self._pending_holds = HoldsVersion(peer_id=self.peer_id, version=version, seconds=0.0)

    def _on_evidence(self, version: int, evidence: Any) -> None:
        log.warning("version %d: peer %s sent a corrupt chunk %d (routed around)", version, evidence.peer, evidence.index)
        if evidence.peer == self.hub_peer or len(self._pending_reports) >= MAX_PENDING_REPORTS:
            return  # the hub's own chunks are not a relay's doing; and the queue stays bounded
        key = (evidence.peer, version)
        if key in self._reported:
            return  # the hub counts reporters, not chunks: one report per parent and version
        self._reported.add(key)
        if len(self._reported) > 4 * MAX_PENDING_REPORTS:
            self._reported.clear()
        self._pending_reports.append(
            RelayReport(
                peer_id=self.peer_id,
                accused=evidence.peer,
                version=version,
                index=evidence.index,
                expected_hash=evidence.expected_hash,
                got_hash=evidence.got_hash,
            )
        )

    async def _send_reports(self, host: ControlHost) -> None:
        while self._pending_reports:
            rep = self._pending_reports[0]
            try:
                await host.request(
                    self.hub_peer, REPORT, envelope.seal(self.identity, rep), max_response=MAX_CONTROL_REQUEST, timeout_s=10
                )
            except RemoteError as exc:
                if exc.code in _TRANSIENT_CODES:
                    log.debug("relay report deferred (%s); will retry", exc.code)
                    return
                # the hub refused it for what it says: sending it again would not help
                log.warning("relay report on %s refused by the hub: %s", rep.accused, exc)
            except Echo2Error as exc:
                log.debug("relay report failed (will retry): %s", exc)
                return
            else:
                log.info("reported %s to the hub: corrupt chunk %d of v%d", rep.accused, rep.index, rep.version)
            self._pending_reports.pop(0)

    async def _load(self, held: HeldVersion, receive_s: float) -> None:
        m = held.manifest
        t0 = time.monotonic()
        self.steps.loading(m.version)
        config_changed = self.held is None or self.held.manifest.model_config != m.model_config
        # sized before anything of it is allocated: a model over the budget is refused (ModelTooLarge)
        fp = await trio.to_thread.run_sync(self._check_fit, m.model_config) if config_changed else self._footprint
        sd = await trio.to_thread.run_sync(statedict.assemble, m, held.raw_chunks)
        async with self._engine_lock:
            await trio.to_thread.run_sync(self._engine.load_version, m.version, m.model_config, dict(m.artifacts), sd)
            if config_changed:
                self._footprint, self._rows_cap = fp, 0
                from .measure import measure_throughput

                self.steps.measuring(m.version)
                tp = await trio.to_thread.run_sync(lambda: measure_throughput(self._engine, budget_s=2.0))
                self.measured["tokens_per_s"], self.measured["rollouts_per_s"] = tp.tokens_per_s, tp.rollouts_per_s
                log.info("measured %.0f tokens/s, %.1f rollouts/s on version %d", tp.tokens_per_s, tp.rollouts_per_s, m.version)
        self.held = held
        self.pauser.clear_block()
        self.stats.versions_loaded.append(m.version)
        self.version_changed.set()
        self.version_changed = trio.Event()
        seconds = receive_s + (time.monotonic() - t0)
        log.info("holds version %d (%.2fs to receive and load)", m.version, seconds)
        self._write_state()
        self._pending_holds = HoldsVersion(peer_id=self.peer_id, version=m.version, seconds=seconds)

    def _budget(self) -> Budget:
        if self._mem_budget is None:
            eng = self._engine
            on_acc = getattr(eng, "name", "") == "vllm" or str(getattr(eng, "device", "")).startswith("cuda")
            hw = probe(self.cfg.data_dir)
            cap = memory_cap_MiB(self.pauser.prefs, self.cfg.memory_budget_MiB, hw.accelerator_memory_bytes if on_acc else 0)
            self._mem_budget = memory_budget(hw, configured_MiB=cap, on_accelerator=on_acc)
        return self._mem_budget

    def _prefs_changed(self, prefs: Prefs) -> None:
        self._mem_budget = None  # the memory cap may have changed: the next model and task use the new one
        self.pauser.clear_block()  # a model refused under the old cap is tried again with the next version
        if self.relay is not None:
            self.relay.cfg.max_disk_bytes = prefs.max_disk_MiB * 1024**2

    def _check_fit(self, model_config: str) -> Footprint:
        """The model's sizes, or ModelTooLarge (or ManifestError for a config a node refuses)."""
        from echo2.models.spec import hf_config_from_json, parse_model_config

        dtype = str(getattr(self._engine, "dtype", "float32")).removeprefix("torch.")
        try:
            # the sizes the config states, before a library builds anything from it; then with the
            # library's defaults filled in (a key left out may default to a large size)
            check_model(footprint(parse_model_config(model_config), dtype), self._budget())
            fp = footprint(hf_config_from_json(model_config).to_dict(), dtype)
            check_model(fp, self._budget())
        except Echo2Error as exc:
            log.error("refusing the hub's model: %s", exc.message)
            # e.g. over the memory the preferences allow: unavailable (the hub is told, with both
            # numbers) until a version that fits arrives
            self.pauser.set_block(exc.code, exc.message)
            raise
        atomic_write(self.cfg.data_dir / "model_config.json", model_config, durable=False)  # for `node doctor`
        log.info("model fits: %.1f M parameters (%s) in a memory budget of %s", fp.params / 1e6, dtype, self._budget())
        return fp

    async def _report_holds(self, host: ControlHost, holds: HoldsVersion) -> None:
        """Report holding a version and answer the hub's challenge (A5): the hub gives work on a
        version only to a node that proved it holds its bytes."""
        reply = await self._to_hub(host).request(self.hub_peer, HOLDS, envelope.seal(self.identity, holds), max_response=MAX_CONTROL_REQUEST,
                                   timeout_s=10)
        ch = envelope.open_envelope(reply, (HoldsChallenge, ErrorReply), replay=self.replay, allowed=self._hub_only).message
        if isinstance(ch, ErrorReply):
            if ch.code != "ok" or ch.message != "noted":
                log.info("hub on our holds report for v%d: %s", holds.version, ch.message)
            return
        assert isinstance(ch, HoldsChallenge)
        if ch.peer_id != self.peer_id:
            raise MeaningError("holds challenge names another node")
        held = self.held
        if held is not None and held.version == ch.version:
            holdsproof.check(ch, held.manifest)
            raw: bytes | None = held.raw_chunks[ch.index]
        else:  # a newer version loaded since the report (fast steps): its predecessor is in the store
            raw = await trio.to_thread.run_sync(self._stored_chunk, ch)
        if raw is None:
            log.info("holds challenge for v%d not answered: its bytes are gone", ch.version)
            return
        proof = HoldsProof(peer_id=self.peer_id, version=ch.version, nonce=ch.nonce,
                           digest=holdsproof.answer(ch.nonce, raw, ch.offset, ch.length))
        await self._to_hub(host).request(self.hub_peer, HOLDS, envelope.seal(self.identity, proof), max_response=MAX_CONTROL_REQUEST,
                           timeout_s=10)

    def _stored_chunk(self, ch: HoldsChallenge) -> bytes | None:
        """The raw chunk a challenge names, from the chunk store (blocking: file reads)."""
        env = self.store.manifest_envelope(ch.version)
        if env is None:
            return None
        m = envelope.open_envelope(env, Manifest, replay=None, allowed=self._hub_only, now=envelope.signed_at(env)).message
        holdsproof.check(ch, m)
        return self.store.get_or_none(m.chunks[ch.index].raw_hash)

    # --- control loops ---------------------------------------------------------------------------
    async def _heartbeat(self, host: ControlHost) -> None:
        last_announce = 0.0
        while True:
            holds = getattr(self, "_pending_holds", None)
            if holds is not None:
                try:
                    await self._report_holds(host, holds)
                    if self._pending_holds is holds:  # a newer version loaded meanwhile is still to report
                        self._pending_holds = None
                except RemoteError as exc:
                    if exc.code not in _TRANSIENT_CODES:
                        # e.g. a version this hub never published: ours is from before its restart
                        log.info("hub refused our holds report for v%d: %s", holds.version, exc)
                        if self._pending_holds is holds:
                            self._pending_holds = None
                    else:
                        log.debug("holds report deferred: %s", exc)
                except Echo2Error as exc:
                    log.debug("holds report failed: %s", exc)
            if self._pending_reports:
                await self._send_reports(host)
            if time.monotonic() - last_announce > 30:
                try:
                    await host.publish(ANNOUNCE_TOPIC, envelope.seal(self.identity, self._announce(host), ttl_s=120))
                    last_announce = time.monotonic()
                except Echo2Error as exc:
                    log.debug("announce failed: %s", exc)
            await trio.sleep(0.2)


def _select_engine(name: str, threads: int) -> Any:
    from echo2.models.engine import select_engine

    if threads:
        import torch

        torch.set_num_threads(threads)
    return select_engine(name)


def run_node(cfg: NodeConfig) -> int:
    os.umask(0o077)  # identity and state: the volunteer's only
    node = Node(cfg)

    async def main() -> int:
        return await node.run()

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        log.info("stopped")
        node._write_state()
        return 0
    except TransportError as exc:
        log.error("%s", exc)
        return 1
