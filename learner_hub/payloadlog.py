"""Accepted results' payloads in append-only segment files beside the hub's SQLite file.

Why not a BLOB column: SQLite writes a blob through its pages, so each byte of a payload went to
the WAL (copied and checksummed), then to the database file at a checkpoint, and its pages to the
freelist when the payload was freed. Measured here (``HubStore.record_accepted_many`` in a loop,
batches of 8, thread CPU): 0.057 ms of the store thread's CPU per small result (6.2 KB) and 0.37
ms per result of 8 x 1,024 tokens (66 KB), of 0.135 and 0.45 ms for the whole transaction. One
write of a batch's payloads to a file and one ``fdatasync`` cost 0.017 ms per small result.

Layout: ``<database>-payloads/seg-NNNNNNNN.log`` (beside ``hub.sqlite-wal``: move the three
together). A segment is only appended to, by the one process that has the store open, and a new
one is started at each open and once the current one passes :data:`SEGMENT_BYTES`. The database
holds each payload's (segment, offset, length) in ``payload_refs``; a segment is deleted once no
row refers to it (:meth:`PayloadLog.keep_only`, after payloads are pruned or dropped).

Durability: :meth:`PayloadLog.append` with ``sync`` makes the bytes durable before the caller
commits the rows that refer to them, so a crash leaves at worst bytes no row refers to (reclaimed
with their segment), never a row whose bytes are missing. A read that finds fewer bytes than its
row says (a segment lost or cut short outside the hub) is a :class:`PayloadMissing`, not garbage.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from echo2.fsutil import fsync_dir

log = logging.getLogger(__name__)

#: a segment is closed and a new one started once it holds this much (what one live payload can
#: keep on disk after the rest of its segment was freed)
SEGMENT_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^seg-(\d{8})\.log$")
#: os.writev takes at most IOV_MAX buffers a call (1024 on Linux)
_IOV = 1024

Ref = tuple[int, int, int]  # (segment, offset, length)


class PayloadMissing(OSError):
    """A payload's bytes are not (all) where its row says: its segment was lost or cut short."""


def _name(segment: int) -> str:
    return f"seg-{segment:08d}.log"


class PayloadLog:
    """The segment files of one store. Not thread-safe: the store calls it under its own lock."""

    def __init__(self, directory: str | os.PathLike[str], *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        created = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(self.dir.parent)
        self._fd: int | None = None
        self._size = 0
        self.segment = max(self.segments(), default=0)  # a new one is opened at the first append

    def segments(self) -> list[int]:
        """The segment numbers on disk, in order."""
        out = []
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _open_next(self) -> int:
        if self._fd is not None:
            os.close(self._fd)
        self.segment += 1
        self._fd = os.open(self.dir / _name(self.segment), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self._size = 0
        fsync_dir(self.dir)  # the new file's entry is as durable as the bytes its rows will point at
        return self._fd

    def append(self, blobs: Sequence[bytes | memoryview], *, sync: bool) -> list[Ref]:
        """Write ``blobs`` one after another; their refs, in order. ``sync``: durable on return."""
        fd = self._fd
        if fd is None or self._size >= self.segment_bytes:
            fd = self._open_next()
        refs = []
        at = self._size
        for b in blobs:
            refs.append((self.segment, at, len(b)))
            at += len(b)
        for lo in range(0, len(blobs), _IOV):
            part = [memoryview(b) for b in blobs[lo:lo + _IOV] if b]
            while part:
                n = os.writev(fd, part)
                while part and n >= len(part[0]):  # a short write: go on from where it stopped
                    n -= len(part[0])
                    part.pop(0)
                if part and n:
                    part[0] = part[0][n:]
        self._size = at
        if sync:
            os.fdatasync(fd)
        return refs

    def read(self, refs: Iterable[Ref]) -> list[bytes]:
        """The payloads at ``refs``, in order (each segment opened once)."""
        fds: dict[int, int] = {}
        try:
            out = []
            for seg, off, n in refs:
                fd = fds.get(seg)
                if fd is None:
                    try:
                        fd = fds[seg] = os.open(self.dir / _name(seg), os.O_RDONLY)
                    except FileNotFoundError as exc:
                        raise PayloadMissing(f"payload segment {_name(seg)} is missing from {self.dir}") from exc
                b = os.pread(fd, n, off)
                if len(b) != n:
                    raise PayloadMissing(f"payload segment {_name(seg)} holds {len(b)} of the {n} bytes at offset "
                                         f"{off} (cut short outside the hub?)")
                out.append(b)
            return out
        finally:
            for fd in fds.values():
                os.close(fd)

    def keep_only(self, live: Iterable[int]) -> int:
        """Delete every segment but those in ``live`` and the one being written; how many went."""
        keep = set(live)
        gone = 0
        for seg in self.segments():
            if seg in keep or (seg == self.segment and self._fd is not None):
                continue
            try:
                os.unlink(self.dir / _name(seg))
                gone += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # its rows are gone already: a file left behind costs only space
                log.warning("could not delete the freed payload segment %s: %s", _name(seg), exc)
        return gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["SEGMENT_BYTES", "PayloadLog", "PayloadMissing", "Ref"]
