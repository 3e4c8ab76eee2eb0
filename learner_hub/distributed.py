"""The sharded GRPO learner (issue 17): N rank processes running FSDP2 over torch.distributed.

The hub process is not a rank. :class:`ShardedLearner` starts N ranks (torch.multiprocessing's
spawn context; gloo on CPU, NCCL on CUDA) and talks to rank 0 over a multiprocessing Pipe. Each
rank builds the same model from the hub's initial weights, applies ``fully_shard`` per decoder
layer and then on the root over a 1-D device mesh, and holds AdamW over its own shards.

A step: rank 0 turns the groups into the step's plan (:meth:`Learner.plan`: advantages and the
*global* normaliser over every rank's rows), splits the micro-batches round-robin over the ranks
and scatters each rank its rows. Each rank runs :meth:`Learner.run_passes`, the same GRPO loop
as the one-process learner; FSDP2 reduce-scatters the gradients as a plain sum (its default
divides by the world size), so the summed gradient is exactly the one-process gradient up to
float summation order. A rank with fewer micro-batches than another runs zero-weight placeholder
passes: every rank must join the same collectives. Gradient clipping takes the total norm over
the DTensor shards. The figures of each rank are gathered on rank 0 and merged into one
:class:`StepStats`.

Publication gathers a full state dict (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True, cpu_offload=True``) on rank 0, which sends it to the hub through the Pipe
(torch.multiprocessing moves tensors through shared memory, not a pickled copy). The hub's
checkpoints are sharded ``torch.distributed.checkpoint`` folders, each rank writing its own shards
(shardckpt.py: they resume with any N, one process included). :meth:`ShardedLearner.checkpoint_state`
and :meth:`ShardedLearner.load_checkpoint_state` also speak the one-process format (``step-N.pt``:
a model state dict and a parameter-index keyed optimizer state dict, converted on the way), which
is how a one-process run resumes into ranks.

Every wait of the hub on the ranks is bounded by a poll and a liveness check: a rank that dies
or fails makes every call raise :class:`RankError` (the hub's training stops with that error)
and the other ranks are terminated.
"""

from __future__ import annotations

import copy
import datetime
import logging
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import shardckpt
from .learner import Learner, PassResult, StepPlan, StepStats, grad_sq_sum
from .rows import Group

log = logging.getLogger(__name__)

#: the hub checks the ranks' liveness this often while it waits for an answer
POLL_S = 1.0
#: an idle rank 0 sends the others a no-op this often, so their wait never reaches the
#: process group's timeout while the hub verifies or waits for rollouts
IDLE_PING_S = 30.0
#: a collective that waits longer fails (a hung peer must not hang a rank forever)
PG_TIMEOUT_S = 1800.0
#: how long the ranks may take to start (spawned interpreters import torch and transformers)
START_TIMEOUT_S = 600.0


class RankError(RuntimeError):
    """A learner rank died or failed; the sharded learner is unusable."""


@dataclass
class _Tok:
    pad_id: int
    eos_id: int


@dataclass
class RankSpec:
    """What every rank needs to build its part of the learner."""

    world: int
    addr: str
    port: int
    model_config: str
    init_state: dict[str, Tensor]
    pad_id: int
    eos_id: int
    learner_kwargs: dict[str, Any] = field(default_factory=dict)
    mixed_precision: str = "no"  # "bf16": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    activation_checkpointing: bool = False
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl, one device per rank)
    #: ranks 0..local-1 are the hub's children; the others joined from elsewhere (rank.py, torchrun)
    #: and learn everything else in this spec, the initial weights included, from rank 0
    local: int = 0

    @property
    def remote(self) -> list[int]:
        return list(range(self.local or self.world, self.world))


# ---------------------------------------------------------------------------- model preparation


def decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.ModuleList, int]]:
    """(container, index) of each transformer block: the members of a ModuleList whose classes
    transformers names in ``_no_split_modules`` (e.g. Qwen2DecoderLayer), or else of the model's
    longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    hit = [m for m in lists if names and all(type(c).__name__ in names for c in m)]
    chosen = hit or sorted(lists, key=len, reverse=True)[:1]
    return [(ml, i) for ml in chosen for i in range(len(ml))]


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Wrap each transformer block in torch's non-reentrant checkpoint wrapper: its activations
    are recomputed in the backward instead of kept. Returns the blocks wrapped. The wrapper's
    state-dict hooks keep the parameter names unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = decoder_layers(model)
    for ml, i in blocks:
        ml[i] = checkpoint_wrapper(ml[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return len(blocks)


def shard_model(model: torch.nn.Module, mesh: Any, mixed_precision: str = "no") -> None:
    """``fully_shard`` per transformer block, then on the root, with a plain-sum gradient
    reduction (the loss is already divided by the global normaliser on every rank)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for ml, i in decoder_layers(model):
        fully_shard(ml[i], **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # FSDP2 averages over ranks by default; forced SUM with factor 1 also avoids
            # PREMUL_SUM, which gloo lacks
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def local_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor's local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        loc = t.to_local() if isinstance(t, DTensor) else t
        total += loc.numel() * loc.element_size()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return local_bytes([v for st in optimizer.state.values() for v in st.values() if isinstance(v, Tensor)])


class _RankLearner(Learner):
    """The GRPO learner on one rank: its parameters are DTensor shards."""

    grad_bytes = 0  # local gradient bytes at the last clip: the gradient's peak

    def params(self) -> list[Tensor]:
        """The sharded parameters (the optimizer's). After a no-grad forward FSDP2 leaves the
        root's parameters unsharded (it expects a backward), so ``model.parameters()`` then
        yields full tensors without gradients: measured here, the tied embedding's."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def reshard(self) -> None:
        """Free the unsharded parameters a no-grad forward left behind (see :meth:`params`)."""
        from torch.distributed.fsdp import FSDPModule

        for model in (self.model, self.ref_model):
            for m in model.modules() if model is not None else ():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _clip_grads(self) -> float:

        self.reshard()
        params = [p for p in self.params() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        self.grad_bytes = max(self.grad_bytes, local_bytes(grads))
        # the norm over every rank's shards: local sums of squares, all-reduced (every rank joins,
        # with or without gradients of its own)
        sq = grad_sq_sum(grads).to(self.device) if grads else torch.zeros((), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(sq)
        total = sq.sqrt().float()
        if self.max_grad_norm and self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
        return float(total)


def _build_rank_learner(spec: RankSpec, mesh: Any, device: torch.device) -> _RankLearner:
    from echo2.models import spec as modelspec

    model = modelspec.model_from_config(spec.model_config)
    model.load_state_dict(spec.init_state)
    kw = dict(spec.learner_kwargs)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if kw.get("kl_coef", 0.0) > 0 else None
    if spec.activation_checkpointing:
        apply_activation_checkpointing(model)
    learner = _RankLearner(model, _Tok(spec.pad_id, spec.eos_id), device=device, ref_model=ref, **kw)
    shard_model(learner.model, mesh, spec.mixed_precision)
    if learner.ref_model is not None:
        shard_model(learner.ref_model, mesh, spec.mixed_precision)
    # AdamW again, now over the shards (the Learner built it over the full parameters)
    learner.optimizer = torch.optim.AdamW(
        [p for p in learner.model.parameters() if p.requires_grad],
        lr=kw.get("lr", 3e-4), betas=kw.get("betas", (0.9, 0.99)), weight_decay=kw.get("weight_decay", 0.0),
    )
    return learner


# ---------------------------------------------------------------------------- the step's split


def split_plan(
    plan: StepPlan, chunks: tuple[list[list[int]], list[list[int]]], world: int
) -> list[tuple[StepPlan, tuple[list[list[int]], list[list[int]]], list[int]]]:
    """Per rank: its rows as a plan of their own (the global normaliser kept), its micro-batches
    in its own row indices (padded with empty placeholders to the same count on every rank), and
    the global index of each of its rows."""
    out = []
    for r in range(world):
        mine = [chunks[0][r::world], chunks[1][r::world]]
        for k in (0, 1):
            mine[k] = mine[k] + [[] for _ in range(math.ceil(len(chunks[k]) / world) - len(mine[k]))]
        gidx = sorted({i for part in mine for c in part for i in c})
        pos = {g: j for j, g in enumerate(gidx)}
        sub = StepPlan(v_before=plan.v_before, groups=plan.groups, norm=plan.norm)
        for g in gidx:
            sub.rows.append(plan.rows[g])
            sub.behav.append(plan.behav[g])
            sub.advs.append(plan.advs[g])
            sub.active.append(plan.active[g])
            sub.sound.append(plan.sound[g])
            sub.versions.append(plan.versions[g])
        local = ([[pos[i] for i in c] for c in mine[0]], [[pos[i] for i in c] for c in mine[1]])
        out.append((sub, local, gidx))
    return out


def merge_results(parts: Sequence[PassResult], gidx: Sequence[Sequence[int]]) -> PassResult:
    """The ranks' figures as one (mismatch rows back in the step's global indices)."""
    res = PassResult(grad_norm=parts[0].grad_norm)
    for part, idx in zip(parts, gidx, strict=True):
        for k, v in part.acc.items():
            res.acc[k] += v
        res.ratio_max = max(res.ratio_max, part.ratio_max)
        res.is_ratio_min = min(res.is_ratio_min, part.is_ratio_min)
        res.is_ratio_max = max(res.is_ratio_max, part.is_ratio_max)
        res.logp_diff_max = max(res.logp_diff_max, part.logp_diff_max)
        res.mismatch.extend((idx[i], d) for i, d in part.mismatch)
    return res


# ---------------------------------------------------------------------------- the rank processes


def _rank_main(rank: int, spec: RankSpec, conn: Any) -> None:
    try:
        _serve(rank, spec, conn)
    except BaseException as exc:
        if conn is not None:
            try:
                conn.send(("error", f"learner rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            except (OSError, ValueError):
                pass
        raise


def _serve(rank: int, spec: RankSpec, conn: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    # a rank torchrun started knows its place on its machine from torchrun's environment
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", spec.local or spec.world))
    if spec.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        # the ranks on one machine share its cores: each gets its share, not all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    dist.init_process_group(
        backend, init_method=f"tcp://{spec.addr}:{spec.port}", rank=rank, world_size=spec.world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    if spec.remote:
        from .rank import share_spec  # ranks on other machines (rank.py imports this module)

        spec = share_spec(rank, spec)
    mesh = init_device_mesh(device.type, (spec.world,))
    learner = _build_rank_learner(spec, mesh, device)
    del spec.init_state
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    put = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if rank == 0:
        conn.send(("ok", None))
    while True:
        cmd: Any = None
        if rank == 0:
            cmd = ("ping",)
            if conn.poll(IDLE_PING_S):
                try:
                    cmd = conn.recv()
                except EOFError:  # the hub is gone
                    cmd = ("stop",)
            if cmd[0] == "step":
                try:
                    plan = learner.plan(cmd[1])
                except ValueError as exc:  # a bad batch: refused before any rank starts the step
                    conn.send(("refused", exc))
                    continue
                t0 = time.perf_counter()
                pieces = split_plan(plan, learner.plan_chunks(plan), spec.world)
        # the command's name (and a loaded version) to every rank; payloads travel by collectives
        box: list[Any] = [None, None]
        if rank == 0:
            box = [cmd[0], cmd[1]["version"] if cmd[0] == "load" else cmd[1] if cmd[0] in ("save_dcp", "load_dcp") else None]
        dist.broadcast_object_list(box, src=0)
        what = box[0]
        if what == "step":
            got: list[Any] = [None]
            dist.scatter_object_list(got, [(p, c) for p, c, _ in pieces] if rank == 0 else None, src=0)
            part = learner.run_passes(got[0][0], got[0][1])
            learner.version += 1
            parts: list[Any] = [None] * spec.world if rank == 0 else []
            dist.gather_object(part, parts if rank == 0 else None, dst=0)
            if rank == 0:
                merged = merge_results(parts, [g for _, _, g in pieces])
                conn.send(("ok", learner.step_stats(plan, merged, time.perf_counter() - t0)))
        elif what == "publish":
            sd: dict[str, Any] = dict(get_model_state_dict(learner.model, options=full))
            if rank == 0:
                pub = {k: (v.to(learner.publish_dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
                conn.send(("ok", pub))
            del sd
        elif what == "checkpoint":
            msd = get_model_state_dict(learner.model, options=full)
            osd = get_optimizer_state_dict(learner.model, learner.optimizer, options=full)
            if rank == 0:
                conn.send(("ok", {"version": learner.version, "model": msd, "optimizer": osd}))
            del msd, osd
        elif what == "load":
            st = cmd[1] if rank == 0 else {"model": {}, "optimizer": {}}
            set_model_state_dict(learner.model, st["model"], options=put)
            set_optimizer_state_dict(learner.model, learner.optimizer, st["optimizer"], options=put)
            learner.version = int(box[1])
            if rank == 0:
                conn.send(("ok", None))
        elif what in ("save_dcp", "load_dcp"):
            folder, version = box[1]
            if what == "save_dcp":
                shardckpt.save(learner.model, learner.optimizer, Path(folder))
            else:
                shardckpt.load(learner.model, learner.optimizer, Path(folder))
                learner.version = int(version)
            if rank == 0:
                conn.send(("ok", None))
        elif what == "memory":
            figures = {
                "params": local_bytes(learner.params()),
                "grads": learner.grad_bytes,
                "optimizer": optimizer_bytes(learner.optimizer),
            }
            every: list[Any] = [None] * spec.world if rank == 0 else []
            dist.gather_object(figures, every if rank == 0 else None, dst=0)
            if rank == 0:
                conn.send(("ok", every))
        elif what == "stop":
            if rank == 0:
                try:
                    conn.send(("ok", None))
                except OSError:  # the hub left first
                    pass
            dist.destroy_process_group()
            return


# ---------------------------------------------------------------------------- the hub's proxy


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def optimizer_to_fqn(osd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A one-process optimizer state dict (keys: parameter positions) keyed by parameter names,
    as ``torch.distributed.checkpoint.state_dict`` wants it."""
    return {
        "state": {names[int(i)]: v for i, v in osd["state"].items()},
        "param_groups": [g | {"params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]],
    }


def optimizer_from_fqn(osd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_to_fqn`."""
    pos = {n: i for i, n in enumerate(names)}
    return {
        "state": {pos[n]: v for n, v in osd["state"].items()},
        "param_groups": [g | {"params": [pos[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


class ShardedLearner:
    """The hub's handle on N FSDP2 ranks, with the interface Trainer and Verifier use of
    :class:`Learner`: ``version``, ``step``, ``state_dict_for_publish``, ``checkpoint_state``,
    ``load_checkpoint_state``, ``reference_logprobs`` and ``model``.

    ``model`` stays a plain CPU copy of the initial weights in the hub: the Verifier deep-copies
    it as the template of its shadow model and loads published weights into it, so it never
    needs the trained weights. It costs one full model of hub memory (acceptable for now; the
    verifier could build its shadow from the config instead). ``learner_kwargs`` are
    :class:`Learner`'s."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_handle: Any,
        model_config: str,
        *,
        procs: int,
        local_procs: int = 0,
        addr: str = "127.0.0.1",
        port: int = 0,
        mixed_precision: str = "no",
        activation_checkpointing: bool = False,
        device: str = "cpu",
        start_timeout_s: float = START_TIMEOUT_S,
        **learner_kwargs: Any,
    ) -> None:
        if procs < 1:
            raise ValueError("procs must be >= 1")
        local = local_procs or procs
        if not 1 <= local <= procs:
            raise ValueError(f"local_procs must be in 1..{procs}, not {local_procs}")
        if local < procs and not port:
            raise ValueError("ranks on other machines need a fixed rendezvous port (learner_master_port)")
        if mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be no or bf16, not {mixed_precision!r}")
        self.procs = procs
        local_kw = {k: learner_kwargs[k] for k in ("temperature", "dtype", "publish_dtype", "micro_batch_tokens") if k in learner_kwargs}
        # the hub's own forward passes (verification) run on this plain copy
        self._local = Learner(model, tokenizer_handle, **local_kw)
        self.model = self._local.model
        self.temperature = self._local.temperature
        self.version = 0
        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self._lock = threading.Lock()
        spec = RankSpec(
            world=procs, addr=addr, port=port or _free_port(addr), model_config=model_config,
            init_state=self.model.state_dict(), pad_id=int(tokenizer_handle.pad_id),
            eos_id=int(getattr(tokenizer_handle, "eos_id", tokenizer_handle.pad_id)), learner_kwargs=dict(learner_kwargs),
            mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing, device=device,
            local=local,
        )
        if spec.remote:
            from .rank import remote_command  # rank.py imports this module

            log.warning(
                "sharded learner: ranks %d..%d run elsewhere; on the other machine(s) start them with: %s",
                local, procs - 1, remote_command(spec.addr, spec.port, procs, local, procs - local, device),
            )
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._procs = [
            ctx.Process(target=_rank_main, args=(r, spec, child if r == 0 else None), daemon=True, name=f"echo2-learner-rank{r}")
            for r in range(local)
        ]
        self._broken: str | None = None
        for p in self._procs:
            p.start()
        child.close()  # ours: a dead rank 0 then reads as EOF
        self._recv(deadline=time.monotonic() + start_timeout_s)
        log.info("sharded learner: %d ranks (%d here) on %s (FSDP2, %s, port %d)", procs, local, device,
                 "gloo" if device == "cpu" else "nccl", spec.port)

    # --- plumbing -------------------------------------------------------------------------------
    def _fail(self, why: str) -> RankError:
        self._broken = why
        log.error("sharded learner: %s; stopping the ranks", why)
        self._terminate()
        return RankError(why)

    def _terminate(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def _recv(self, deadline: float | None = None) -> Any:
        while not self._conn.poll(POLL_S):
            dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                raise self._fail(f"learner rank {dead[0][0]} died (exit code {dead[0][1]})")
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail("learner ranks did not start in time")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._fail(f"learner rank 0 is gone ({type(exc).__name__})") from exc
        if kind == "error":
            # a peer's death reaches rank 0 as a collective's error: name the dead rank first
            end = time.monotonic() + 2.0
            while time.monotonic() < end and all(p.is_alive() for p in self._procs[1:]):
                time.sleep(0.1)
            dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
            first = f"learner rank {dead[0][0]} died (exit code {dead[0][1]}); " if dead else ""
            raise self._fail(first + str(payload).strip().splitlines()[0])
        if kind == "refused":
            raise payload
        return payload

    def _call(self, *cmd: Any) -> Any:
        with self._lock:
            if self._broken is not None:
                raise RankError(self._broken)
            try:
                self._conn.send(cmd)
            except (OSError, ValueError) as exc:
                raise self._fail(f"cannot reach learner rank 0 ({exc})") from exc
            return self._recv()

    def close(self) -> None:
        """Stop the ranks (bounded); safe to call twice."""
        if self._broken is None and any(p.is_alive() for p in self._procs):
            try:
                self._call("stop")
            except RankError:
                pass
            for p in self._procs:
                p.join(timeout=30)
        self._broken = self._broken or "closed"
        self._terminate()

    # --- the Learner interface ------------------------------------------------------------------
    def step(self, groups: Sequence[Group]) -> StepStats:
        stats: StepStats = self._call("step", list(groups))
        self.version = stats.version
        return stats

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = self._call("publish")
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        st: dict[str, Any] = self._call("checkpoint")
        st["optimizer"] = optimizer_from_fqn(st["optimizer"], self._names)
        st["seed"] = self._local.seed
        return st

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        osd = state["optimizer"]
        if osd.get("state") or osd.get("param_groups"):
            osd = optimizer_to_fqn(osd, self._names)
        self._call("load", {"version": int(state["version"]), "model": state["model"], "optimizer": osd})
        self.version = int(state["version"])

    def save_sharded(self, folder: Path) -> None:
        """Each rank writes its shards of model and optimizer into ``folder`` (shardckpt.py)."""
        self._call("save_dcp", (str(folder), self.version))

    def load_sharded(self, folder: Path, version: int) -> None:
        self._call("load_dcp", (str(folder), int(version)))
        self.version = int(version)

    def memory(self) -> list[dict[str, int]]:
        """Per rank, bytes of its parameter shards, its largest gradient (at the last clip) and
        its optimizer state."""
        out: list[dict[str, int]] = self._call("memory")
        return out

    def reference_logprobs(self, model: torch.nn.Module, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        return self._local.reference_logprobs(model, rows)


__all__ = ["RankError", "ShardedLearner", "apply_activation_checkpointing", "shard_model"]
