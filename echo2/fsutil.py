"""Atomic file writing: the one place echo2 replaces a file on disk.

A reader (a resumed hub, a node restarting, `echo2 hub report`, a person's `cat`) must only ever
see the old file or all of the new one, never a torn write. So every write goes to a temporary
name in the same directory, is flushed (and fsynced unless ``durable=False``), then renamed over
the final name; the directory is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: Prefix of temporary files; a store that finds such a file at start-up knows it is stray.
TMP_PREFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable; a no-op where the filesystem refuses it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write_with(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    *,
    mode: int = 0o600,
    durable: bool = True,
) -> None:
    """Call ``write(f)`` on a temporary file, then rename it over ``path`` atomically.

    ``mode`` is applied at creation (the file never exists with wider permissions, which matters
    for key files); ``durable=False`` skips the fsyncs for files that are cheap to lose (status
    snapshots rewritten every second).
    """

    def fill(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)

    atomic_write_path(path, fill, mode=mode, durable=durable)


def atomic_write_path(
    path: str | os.PathLike[str],
    write: Callable[[Path], object],
    *,
    mode: int = 0o600,
    durable: bool = True,
) -> None:
    """Like :func:`atomic_write_with` for writers that want a file name (``safetensors``'
    ``save_file``), not an open file: ``write(tmp_path)`` fills the temporary file."""
    p = Path(path)
    # pid and thread: two threads of a node writing the same file at once (two version loads
    # checking the model's fit) shared one temporary name, and the second replace found it gone
    # (FileNotFoundError in a CI run of test_e2e_hostile)
    tmp = p.parent / f"{TMP_PREFIX}{p.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        write(tmp)
        os.chmod(tmp, mode)
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(p.parent)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview | str,
    *,
    mode: int = 0o600,
    durable: bool = True,
) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` so it holds either the old file or all of it."""
    payload = data.encode() if isinstance(data, str) else data
    atomic_write_with(path, lambda f: f.write(payload), mode=mode, durable=durable)
