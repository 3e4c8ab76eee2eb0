"""Training: the learner loop. Accepted rows wait in the replay buffer; a full batch becomes a
GRPO step (in a worker thread) once its rows are verified (verify.py: recomputed under the
published version each names; a node's failing rows never reach the step), the new version is
published, and every K steps a checkpoint is written. The trio loop only schedules: every heavy stage runs in a thread.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echo2.protocol.errors import Echo2Error

from .config import ConfigError, HubConfig, check_lora, check_sampling
from .intake import TaskBook
from .learner import Learner
from .publisher import PolicyPublisher
from .replay_buffer import ReplayBuffer
from .rows import Group, decode_groups
from .store import HubStore
from .storeworker import StoreWorker
from .tracking import Tracker
from .trainmetrics import broadcast_metrics, eval_metrics, step_metrics
from .verify import Verifier, published_weights

if TYPE_CHECKING:
    from .distributed import ShardedLearner

log = logging.getLogger(__name__)

Item = tuple[str, Group]  # (task id, group) as buffered
StoreJob = Callable[[HubStore], None]
#: steps whose figures status.json carries (``train_metrics``; ~2 KB each): the store keeps them all
TRAIN_METRICS_KEPT = 100


def build_learner(cfg: HubConfig) -> tuple[Learner | ShardedLearner, Any, str, dict[str, bytes]]:
    """The policy to train (tiny, or a local model), its tokenizer, config and artifacts. The
    learner is a :class:`Learner`, or with ``learner_procs > 1`` a
    :class:`~echo2.learner_hub.distributed.ShardedLearner` with the same interface."""
    import torch

    from echo2.models import spec as modelspec
    from echo2.models.policy import load_policy

    check_sampling(cfg)  # also for a HubConfig built in code, which never passed load_config
    check_lora(cfg)
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    model, model_config, artifacts = load_policy(cfg.model, cfg.tiny_hidden, cfg.tiny_layers)
    tok = modelspec.load_tokenizer(artifacts)
    kw: dict[str, Any] = dict(
        lr=cfg.lr, clip_eps=cfg.epsilon, kl_coef=cfg.kl_coef, temperature=cfg.temperature, dtype=dtype,
        publish_dtype=torch.bfloat16 if cfg.publish_dtype == "bfloat16" else torch.float32, seed=cfg.seed,
        epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards,
        max_is_ratio=cfg.max_is_ratio, mask_truncated_completions=cfg.mask_truncated_completions,
        num_iterations=cfg.num_iterations, max_completion_length=cfg.max_new_tokens, micro_batch_tokens=cfg.micro_batch_tokens,
    )
    if cfg.learner_procs > 1:
        from .distributed import ShardedLearner

        # a LoRA policy (issue 17 item 3) is trained by the one-process learner only, for now
        if cfg.lora.enabled:
            raise ConfigError("lora with learner_procs > 1 is not supported yet: set learner_procs = 1 for a LoRA policy")
        device = resolve_device(cfg.learner_device).split(":")[0]  # each rank takes its own GPU
        here = cfg.learner_local_procs or cfg.learner_procs
        if device == "cuda" and here > torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU
            raise ConfigError(f"{here} learner ranks on this machine need as many GPUs; it has {torch.cuda.device_count()}")
        sharded = ShardedLearner(
            model, tok, model_config, procs=cfg.learner_procs, local_procs=cfg.learner_local_procs,
            addr=cfg.learner_master_addr, port=cfg.learner_master_port,
            mixed_precision=cfg.mixed_precision, activation_checkpointing=cfg.activation_checkpointing, device=device, **kw,
        )
        return sharded, tok, model_config, artifacts
    if cfg.activation_checkpointing:
        from .distributed import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    ref_model: Any = None
    if cfg.lora.enabled:
        from echo2.models import lora

        lo = cfg.lora
        peft_model = lora.wrap(model, r=lo.r, alpha=lo.alpha, target_modules=lo.target_modules, dropout=lo.dropout)
        # nodes learn the adapter's shape from this artifact; publication carries base + adapter
        # (echo2.models.lora explains the layout)
        artifacts = {**artifacts, lora.ADAPTER_CONFIG: lora.adapter_config_json(peft_model)}
        # the learner runs the inner model (peft injected the adapters into it); only they train
        model = peft_model.get_base_model()
        # the KL reference: the base, i.e. this very model with its adapters off (no second copy)
        ref_model = lora.AdapterOff(peft_model) if cfg.kl_coef > 0 else None
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d", lo.r, lo.alpha, lo.target_modules,
                 trained, sum(p.numel() for p in model.parameters()))
    elif cfg.kl_coef > 0:
        # The KL reference is the initial policy, frozen.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    device = resolve_device(cfg.learner_device)
    learner = Learner(model, tok, ref_model=ref_model, device=device, **kw)
    log.info("learner on %s", device)
    return learner, tok, model_config, artifacts


def resolve_device(want: str) -> str:
    """``learner_device`` as a torch device string: "auto" is the first CUDA GPU when torch sees
    one (a hub on a GPU machine trains there without being told), else the CPU; an explicit
    CUDA device that is not there is a configuration error, not a silent fall back to the CPU."""
    import torch

    if want == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        index = int(want.split(":")[1]) if ":" in want else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ConfigError(f"learner_device = {want!r}, but torch sees {seen} CUDA device(s) here")
        return f"cuda:{index}"
    return "cpu"


def learner_memory(cfg: HubConfig) -> Any:
    """The learner's memory plan for ``cfg`` (memory.py), from the model's config alone: printed
    at start-up and refused, before anything is loaded, when a rank cannot hold its share."""
    from echo2.models.policy import policy_config

    from . import memory

    model_config = policy_config(cfg.model, cfg.tiny_hidden, cfg.tiny_layers)
    lora = cfg.lora if cfg.lora.enabled else None
    ranks = cfg.learner_procs
    mem = memory.plan(
        memory.count_params(model_config, lora), ranks=ranks, micro_batch_tokens=cfg.micro_batch_tokens,
        compute_dtype=cfg.dtype, publish_dtype=cfg.publish_dtype, kl_reference=cfg.kl_coef > 0, lora=bool(lora),
        activation_checkpointing=cfg.activation_checkpointing, kept_versions=cfg.staleness + 2,
        step_tokens=cfg.prompts_per_step * cfg.group_size * (cfg.max_prompt_tokens + cfg.max_new_tokens),
    )
    log.info("%s", mem.describe())
    if cfg.memory_check:
        device = resolve_device(cfg.learner_device)  # the device build_learner trains on
        warning = memory.check(
            mem, memory.available_bytes(device, local_ranks=cfg.learner_local_procs or ranks),
            what=f"each of the {ranks} learner rank(s)",
            micro_batch_tokens=cfg.micro_batch_tokens,
        )
        if warning:
            log.warning("%s", warning)
    return mem


class Trainer:
    """The training room. ``book`` is intake's: a task's entry goes when its last group leaves."""

    def __init__(
        self, cfg: HubConfig, learner: Learner | ShardedLearner, publisher: PolicyPublisher, sender: Any, store: StoreWorker, book: TaskBook
    ) -> None:
        self.cfg = cfg
        self.learner = learner
        self.publisher = publisher
        self.sender = sender
        self.store = store
        self.book = book
        self.buffer: ReplayBuffer[Item] = ReplayBuffer(cfg.staleness, on_drop=self._dropped)
        self.history: list[dict[str, Any]] = []
        self.busy_s = 0.0
        self.t_first_batch: float | None = None
        self.t_last_step_end: float | None = None
        self.training = False
        self.spot_checks = 0
        self.prompt_seq = 0
        self.started = time.time()
        #: every row is checked against the published weights it was made with before a step
        self.verifier = Verifier(learner, published_weights(publisher), cfg.logprob_tolerance, fraction=cfg.verify_fraction)
        self.trained_rows: Counter[str] = Counter()  # node -> rows that entered a GRPO step
        self.trained_staleness: Counter[str] = Counter()  # node -> sum of those rows' staleness (status page)
        self._buffer_changed = trio.Event()
        self._trained: set[str] = set()  # tasks with a group trained and groups still buffered
        # each step's figures (trainmetrics.py): the last ones for status.json, all to the store and trackers
        self.train_metrics: deque[dict[str, Any]] = deque(maxlen=TRAIN_METRICS_KEPT)
        self.tracker = Tracker([], run_name="", config={}, config_text="")  # the hub sets its own (report_to)
        self.hub_figures: Callable[[], dict[str, float]] | None = None  # the hub's echo2/ figures at a step
        self.num_tokens = 0  # prompt + completion tokens trained (TRL's num_tokens)
        publisher.on_closed = self._version_closed

    def _version_closed(self, h: dict[str, Any]) -> None:
        self.store.submit(HubStore.set_version_times, h["version"], h["first_s"], h["median_s"], h["last_s"], h["nodes"])
        self.tracker.log(int(h["version"]), broadcast_metrics(h))

    def record_eval(self, rec: dict[str, Any]) -> None:
        """A finished evaluation's figures to the trackers (TRL's eval_* names), at its step."""
        self.tracker.log(int(rec["step"]), eval_metrics(rec))

    def _record_metrics(self, groups: list[Group], stats: Any) -> None:
        """The step's figures: status.json's last ones, the store's table and the trackers (never
        blocking: the tracker has its own thread). A non-finite value (a diverged loss) is left
        out: JSON has no NaN and the status page parses status.json."""
        lr = float(getattr(self.learner, "lr", self.cfg.lr))
        m = step_metrics(groups, stats, learning_rate=lr, num_tokens=self.num_tokens, kl=self.cfg.kl_coef > 0)
        if self.hub_figures is not None:
            m |= self.hub_figures()
        m = {k: v for k, v in m.items() if math.isfinite(v)}
        step, wall = self.learner.version, float(self.history[-1]["t"])
        self.train_metrics.append({"step": step, "wall_s": wall, **m})
        self.store.submit(HubStore.record_train_metrics, step, wall, m)
        self.tracker.log(step, m)

    # --- rows in -----------------------------------------------------------------------------------
    def add(self, task_id: str, groups: list[Group], version: int) -> int:
        """Buffer an accepted result's rows; returns how many were admissible."""
        n = sum(self.buffer.add((task_id, g), version, self.learner.version) for g in groups)
        self.book.buffered(task_id, n)
        if n == 0:
            self.store.submit(HubStore.drop_pending, [task_id], "stale")
        self._buffer_changed.set()
        return n

    def _dropped(self, item: Item, reason: str = "stale") -> None:
        """A buffered group left without being trained (stale, evicted, its node banned, or it
        failed verification)."""
        tid = item[0]
        if self.book.group_gone(tid):
            if tid in self._trained:
                self._trained.discard(tid)
                self.store.submit(HubStore.mark_trained, [tid], self.learner.version)
            else:
                self.store.submit(HubStore.drop_pending, [tid], reason)

    def drop_rows_of(self, peer: str) -> None:
        self.buffer.remove_if(lambda item: any(smp.node_id == peer for smp in item[1].samples))

    # --- figures ----------------------------------------------------------------------------------
    def consume_step(self) -> int:
        """The learner step that rollouts dispatched now will feed: the next one while a step is
        training. Tasks ask for a version that will still be admissible then (>= step - S)."""
        return self.learner.version + (1 if self.training else 0)

    def busy_fraction(self) -> float:
        if self.t_first_batch is None or self.t_last_step_end is None:
            return 0.0
        wall = self.t_last_step_end - self.t_first_batch
        return self.busy_s / wall if wall > 0 else 0.0

    def t_train(self) -> float:
        recent = [h["train_s"] for h in self.history[-20:]]
        return sum(recent) / len(recent) if recent else 0.0

    def step_overhead(self) -> float:
        recent = [h["overhead_s"] for h in self.history[-20:] if "overhead_s" in h]
        return sum(recent) / len(recent) if recent else 0.0

    # --- resume and checkpoints ------------------------------------------------------------------
    def resume(self) -> tuple[int | None, int]:
        """Continue from the last checkpoint (before the loop runs); results accepted after it go
        back into the buffer. Returns (the step resumed from, results restored)."""
        ck = self.store.latest_checkpoint()
        if ck is None:
            return None, 0
        step, state = ck
        if "dcp" in state:  # written by sharded ranks: any rank count (or one process) reads it
            from . import shardckpt

            shardckpt.load_into(self.learner, self.store.checkpoint_dir / str(state["dcp"]), int(state["version"]))
        else:
            self.learner.load_checkpoint_state(state)
        self.prompt_seq = int(state.get("prompt_seq", 0))
        self.history[:] = list(state.get("history", []))
        self.num_tokens = int(self.history[-1].get("num_tokens", 0)) if self.history else 0
        self.train_metrics.extend(r for r in self.store.train_metrics(TRAIN_METRICS_KEPT) if r["step"] <= step)
        self.busy_s = float(state.get("busy_s", 0.0))
        restored = 0
        for pr in self.store.pending_results(after_step=step):
            try:
                groups = decode_groups(pr.payload)
            except Echo2Error as exc:
                log.warning("dropping unreadable pending result %s: %s", pr.task_id, exc)
                self.store.drop_pending([pr.task_id], "unreadable")
                continue
            self.add(pr.task_id, groups, pr.version)
            restored += 1
        log.info("resumed from checkpoint at step %d; %d accepted results not yet trained restored", step, restored)
        return step, restored

    async def checkpoint(self) -> None:
        extra = {"prompt_seq": self.prompt_seq, "history": copy.deepcopy(self.history), "busy_s": self.busy_s}
        step = self.learner.version

        def write() -> tuple[Path, int]:
            # the learner is not stepped while this runs: only the learner loop steps it, and it awaits this
            save_sharded = getattr(self.learner, "save_sharded", None)
            if save_sharded is not None:
                # each rank writes its own shards (no full copy anywhere); step-N.pt, written after
                # them, names the folder, so a crash mid-write leaves the previous checkpoint
                folder = self.store.checkpoint_dir / f"step-{step}.dcp"
                self.store.checkpoint_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                save_sharded(folder)
                state = {"version": step, "dcp": folder.name} | extra
            else:
                state = self.learner.checkpoint_state() | extra
            return HubStore.write_checkpoint_file(self.store.checkpoint_dir, step, state)

        final, size = await trio.to_thread.run_sync(write)
        self.store.submit(HubStore.record_checkpoint, step, final, size)

    async def publish(self) -> None:
        # in a thread: gathering SmolLM2-135M from 2 ranks took 2.1-3.0 s here (the one-process
        # copy 0.2-1.0 s), the loop's to stall; only this loop steps the learner, and it awaits this
        sd = await trio.to_thread.run_sync(self.learner.state_dict_for_publish)
        pub = await self.publisher.publish(self.learner.version, sd)
        self.sender.notify()
        enc = sum(len(e) for e in pub.packed.encoded)
        self.store.submit(HubStore.record_version, pub.version, pub.published_at, pub.packed.manifest.total_bytes, enc)

    async def _persist_step(self, task_ids: list[str], fleet_job: StoreJob) -> None:
        """Mark fully trained results, checkpoint every K steps, then the fleet's own snapshot
        (taken on the loop by the caller) written in the store's thread."""
        step = self.learner.version
        done = []
        for tid in task_ids:
            if self.book.group_gone(tid):
                self._trained.discard(tid)
                done.append(tid)
            else:
                self._trained.add(tid)
        self.store.submit(HubStore.mark_trained, done, step)
        if step % max(1, self.cfg.checkpoint_every) == 0 or step >= self.cfg.steps:
            await self.checkpoint()
            self.store.submit(HubStore.prune_payloads, step)
        await self.store.call(fleet_job)

    # --- the loop ----------------------------------------------------------------------------------
    async def run(
        self,
        feed: Callable[[], None],
        checked: Callable[[dict[str, float]], None],
        predicted_busy: Callable[[], float],
        fleet_job: Callable[[int], StoreJob],
        after_step: Callable[[], Awaitable[None] | None],
    ) -> None:
        """Train until ``cfg.steps``. ``feed`` refills and dispatches, ``checked`` gets each node's
        worst log-prob difference, ``fleet_job(step)`` snapshots what the fleet persists."""
        while self.learner.version < self.cfg.steps:
            feed()
            batch = self.buffer.take_batch(self.learner.version, self.cfg.prompts_per_step)
            if batch is None:
                self._buffer_changed = trio.Event()
                with trio.move_on_after(1.0):
                    await self._buffer_changed.wait()
                continue
            t0 = time.time()
            if self.t_first_batch is None:
                self.t_first_batch = t0
            self.training = True
            try:
                # the batch just left the buffer: hand out the next one now, so that generation
                # overlaps this step (that is what the staleness bound buys)
                feed()
                batch = await self._verified(batch, checked)
                if not batch:
                    continue
                groups = [g for _, (_, g) in batch]
                stats = await trio.to_thread.run_sync(self.learner.step, groups)
            finally:
                self.training = False
            for g in groups:
                for smp in g.samples:
                    self.trained_rows[smp.node_id] += 1
                    self.trained_staleness[smp.node_id] += self.learner.version - 1 - smp.version
            t1 = time.time()
            self.busy_s += t1 - t0
            self.t_last_step_end = t1
            self.num_tokens += stats.input_tokens
            self.history.append(
                {
                    "step": self.learner.version,
                    "t": round(t1 - self.started, 3),
                    "reward": stats.reward_mean,
                    "loss": stats.loss,
                    "staleness_mean": stats.staleness_mean,
                    "mismatch_max": stats.mismatch_max,
                    "rows": stats.sequences,
                    # rows that taught (non-zero advantage, not masked, sound log-probs) and why others did not
                    "active_rows": stats.active_rows,
                    "zero_adv_groups": stats.zero_adv_groups,
                    "masked_truncated": stats.masked_truncated,
                    "bad_rows": stats.bad_rows,
                    "clip_frac": stats.clip_frac,
                    "train_s": round(t1 - t0, 4),
                    "busy_fraction": self.busy_fraction(),
                    "predicted_busy_fraction": predicted_busy(),
                    "num_tokens": self.num_tokens,
                }
            )
            self._record_metrics(groups, stats)
            log.info(
                "step %d reward %.3f loss %.4f staleness %.2f busy %.2f",
                self.learner.version, stats.reward_mean, stats.loss, stats.staleness_mean, self.busy_fraction(),
            )
            await self.publish()
            feed()
            await self._persist_step([tid for _, (tid, _) in batch], fleet_job(self.learner.version))
            self.history[-1]["overhead_s"] = round(time.time() - t1, 4)
            res = after_step()
            if res is not None:
                await res
        log.info("finished %d steps", self.cfg.steps)
        # the last versions never leave the publisher's window: their broadcast figures as they stand
        for h in self.publisher.open_metrics():
            self.tracker.log(int(h["version"]), broadcast_metrics(h))

    # --- verification (BRIEF §7; see verify.py) ----------------------------------------------------
    async def _verified(self, batch: list[tuple[int, Item]], checked: Callable[[dict[str, float]], None]) -> list[tuple[int, Item]]:
        """The batch with every group of a node that failed the check removed, topped up from the
        buffer (those checked too) while it has groups; each node's worst difference goes to
        ``checked`` (the fleet's reputation) before any row of the batch is trained."""
        good: list[tuple[int, Item]] = []
        worst: dict[str, float] = {}
        failed: set[str] = set()
        while batch:
            verdict = await trio.to_thread.run_sync(self.verifier.check, [g for _, (_, g) in batch])
            for peer, d in verdict.worst.items():
                worst[peer] = max(d, worst.get(peer, 0.0))
            good.extend(batch[i] for i in verdict.kept)
            for i in verdict.rejected:
                self._dropped(batch[i][1], "mismatch")
            for i in verdict.unverifiable:
                self._dropped(batch[i][1], "unverifiable")
            if verdict.failed:
                failed |= verdict.failed
                log.warning("verification: rows of %s failed (max |Δlogprob| %s); dropped before the step",
                            sorted(verdict.failed), {p: f"{worst[p]:.3g}" for p in sorted(verdict.failed)})
            # a liar's groups that passed (earlier in this batch, or unsampled) go too
            for item in [e for e in good if any(s.node_id in failed for s in e[1][1].samples)]:
                good.remove(item)
                self._dropped(item[1], "mismatch")
            missing = self.cfg.prompts_per_step - len(good)
            batch = (self.buffer.take_batch(self.learner.version, missing) or []) if missing > 0 and len(batch) > len(verdict.kept) else []
        self.spot_checks = self.verifier.rows_checked
        checked(worst)
        return good
