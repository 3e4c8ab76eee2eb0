"""Sharded checkpoints of the learner with ``torch.distributed.checkpoint`` (issue 17).

With ``learner_procs > 1`` each rank writes its own shards of the model and of AdamW's state into
``checkpoints/step-N.dcp/`` (no rank gathers the full state), and ``step-N.pt`` beside it holds
only the version, the trainer's extras and the folder's name. Such a checkpoint resumes with any
number of ranks (DCP reshards on load), including the one-process learner, which reads the same
folder without a process group. A one-process checkpoint (a full ``step-N.pt``) resumes into
ranks through the full state dict (distributed.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank (or the one process) writes its part of model and optimizer into ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder))


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank (or the one process) reads its part of ``folder``, whatever N wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)  # also creates AdamW's state to load into
    sd: dict[str, Any] = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def load_into(learner: Any, folder: Path, version: int) -> None:
    """Resume ``learner`` (a Learner or a ShardedLearner) from a sharded checkpoint folder."""
    if hasattr(learner, "load_sharded"):
        learner.load_sharded(folder, version)
        return
    load(learner.model, learner.optimizer, folder)
    learner.version = int(version)


__all__ = ["load", "load_into", "save"]
