"""The hub's checkpoint files (checkpoints/step-N.pt, the newest K kept) and their table. Mixed into
:class:`~echo2.learner_hub.store.HubStore`, whose transaction plumbing it uses.
"""

from __future__ import annotations

import logging
import re
import shutil
import sqlite3
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from echo2.fsutil import TMP_PREFIX, atomic_write_with

log = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointFiles:
    checkpoint_dir: Path
    keep_checkpoints: int

    def _tx(self, *, durable: bool = False) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        """``torch.save`` ``state`` to checkpoints/step-N.pt atomically; keep the newest K."""
        final, size = self.write_checkpoint_file(self.checkpoint_dir, step, state)
        self.record_checkpoint(step, final, size)
        return final

    @staticmethod
    def write_checkpoint_file(checkpoint_dir: Path, step: int, state: dict[str, Any]) -> tuple[Path, int]:
        """The file half of :meth:`save_checkpoint` (no database): the hub runs it in its own
        thread so a large model's write does not hold up the store's queue."""
        import torch

        if step < 0:
            raise ValueError("step must be >= 0")
        checkpoint_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = checkpoint_dir / f"step-{step}.pt"
        atomic_write_with(final, lambda f: torch.save(state, f))
        return final, final.stat().st_size

    def record_checkpoint(self, step: int, final: Path, size: int) -> None:
        """The database half of :meth:`save_checkpoint`: list the file, prune old ones."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (step, path, created, bytes) VALUES (?, ?, ?, ?)",
                (step, final.name, time.time(), size),
            )
        self._prune_checkpoints()

    def _checkpoint_files(self) -> list[tuple[int, Path]]:
        # The directory, not the table, is the truth: a crash between os.replace and the INSERT
        # still leaves a usable checkpoint.
        if not self.checkpoint_dir.is_dir():
            return []
        out = []
        for p in self.checkpoint_dir.iterdir():
            m = _CKPT_RE.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def _prune_checkpoints(self) -> None:
        files = self._checkpoint_files()
        old = files[: -self.keep_checkpoints]
        for _step, p in old:
            p.unlink(missing_ok=True)
        # sharded checkpoints' folders (step-N.dcp): those of pruned steps, and those a crash left
        # without their step-N.pt, older than the newest checkpoint (a newer one may be mid-write)
        kept = {s for s, _ in files[-self.keep_checkpoints:]} if files else set()
        newest = files[-1][0] if files else -1
        for d in self.checkpoint_dir.glob("step-*.dcp"):
            m = re.match(r"^step-(\d+)\.dcp$", d.name)
            if m and d.is_dir() and int(m.group(1)) not in kept and int(m.group(1)) < newest:
                shutil.rmtree(d, ignore_errors=True)
        # leftovers of a crash mid-write (fsutil's temporary names, and those of older echo2)
        for pattern in (f"{TMP_PREFIX}step-*.pt.*", ".step-*.pt.tmp"):
            for p in self.checkpoint_dir.glob(pattern):
                p.unlink(missing_ok=True)
        if old:
            with self._tx() as db:
                db.executemany("DELETE FROM checkpoints WHERE step = ?", [(s,) for s, _ in old])

    def checkpoint_steps(self) -> list[int]:
        return [s for s, _ in self._checkpoint_files()]

    def latest_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint that loads, as (step, state); None if there is none."""
        import torch

        for step, p in reversed(self._checkpoint_files()):
            try:
                state = torch.load(p, map_location="cpu", weights_only=True)
            except Exception as exc:  # a damaged file must not stop the hub from resuming an older one
                log.error("checkpoint %s cannot be loaded (%s); trying an older one", p, exc)
                continue
            if isinstance(state, dict):
                return step, state
            log.error("checkpoint %s does not hold a dict; ignored", p)
        return None
