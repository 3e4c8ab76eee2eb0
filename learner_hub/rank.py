"""Learner ranks on another machine (issue 17): ``torchrun ... -m echo2.learner_hub.rank``.

The hub starts ranks ``0..learner_local_procs-1`` itself; the rest of ``learner_procs`` join from
other machines with, on each (the hub logs the exact line)::

    torchrun --standalone --nproc-per-node K -m echo2.learner_hub.rank \\
        --join HUB_ADDR:PORT --world N --first-rank R [--device cuda]

torchrun starts K processes and gives each its ``LOCAL_RANK``; the rank is ``R + LOCAL_RANK``.
torchrun's own rendezvous stays on that machine (``--standalone``): the ranks meet at the hub's
``learner_master_addr:learner_master_port``, where rank 0 hands them everything else (the model
config, the learner's settings and the initial weights), so that machine needs echo2 and torch
only, no hub.toml and no model files. Plain ``python -m echo2.learner_hub.rank`` starts one rank
(``LOCAL_RANK`` unset: 0).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from typing import Any

import torch
from torch import Tensor

from .distributed import RankSpec, _rank_main

log = logging.getLogger(__name__)


def remote_command(addr: str, port: int, world: int, first_rank: int, nproc: int, device: str = "cpu") -> str:
    """The torchrun line that starts ranks ``first_rank..first_rank+nproc-1`` on another machine
    (rank.py): torchrun's own rendezvous stays local to that machine (``--standalone``); the
    ranks meet the hub's at ``addr:port``."""
    return (f"torchrun --standalone --nproc-per-node {nproc} -m echo2.learner_hub.rank --join {addr}:{port} "
            f"--world {world} --first-rank {first_rank} --device {device}")


def share_spec(rank: int, spec: RankSpec) -> RankSpec:
    """Rank 0's spec, initial weights included, to the ranks that joined from other machines
    (they start with only the rendezvous). The weights go tensor by tensor over a gloo group of
    rank 0 and those ranks (CPU tensors, whatever the main backend), never as one pickle: the
    largest message is the largest tensor."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if rank == 0:
        head = copy.copy(spec)
        head.init_state = {}
        box = [(head, [(k, tuple(v.shape), v.dtype) for k, v in spec.init_state.items()])]
    dist.broadcast_object_list(box, src=0)
    head, layout = box[0]
    members = [0, *head.remote]
    group = dist.new_group(members, backend="gloo")  # every rank calls new_group, members or not
    if rank not in members:
        return spec
    state: dict[str, Tensor] = {}
    for name, shape, dtype in layout:
        t = spec.init_state[name].contiguous() if rank == 0 else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0, group=group)
        state[name] = t
    if rank == 0:
        return spec
    head.init_state = state
    return head  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo2.learner_hub.rank", description=__doc__.splitlines()[0])
    # not --master: torchrun parses its own options anywhere on the line, and argparse would read
    # --master as an abbreviation of its --master-addr / --master-port
    ap.add_argument("--join", required=True, help="HOST:PORT of the hub's learner rendezvous (learner_master_addr/port)")
    ap.add_argument("--world", type=int, required=True, help="learner_procs: all ranks, on every machine")
    ap.add_argument("--first-rank", type=int, required=True, help="the rank of this machine's LOCAL_RANK 0")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.join.rpartition(":")
    if not host or not port.isdigit():
        ap.error(f"--join must be HOST:PORT, not {args.join!r}")
    rank = args.first_rank + int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 < rank < args.world:
        ap.error(f"rank {rank} is not one of the remote ranks 1..{args.world - 1} (rank 0 is the hub's)")
    spec = RankSpec(world=args.world, addr=host.strip("[]"), port=int(port), model_config="", init_state={},
                    pad_id=0, eos_id=0, device=args.device, local=1)
    log.info("learner rank %d of %d: joining %s", rank, args.world, args.join)
    _rank_main(rank, spec, None)
    log.info("learner rank %d: stopped", rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
