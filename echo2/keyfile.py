"""Key files on disk: where an Identity is read from and written to.

The key-file format (magic line, hex seed) is ``echo2.protocol.identity``'s; this module is the I/O
the sans-IO core leaves out. A key file is written atomically with mode 0600 (never half-written,
never readable by others even for a moment) and refused on load when group or others can read it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from echo2.fsutil import atomic_write, fsync_dir
from echo2.protocol.errors import IdentityError
from echo2.protocol.identity import Identity


def save_identity(identity: Identity, path: str | os.PathLike[str]) -> None:
    """Write ``identity``'s key file at ``path`` (mode 0600, atomic), creating its folder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fsync_dir(p.parent.parent)  # the key's folder may be new: its entry must survive a crash too
    atomic_write(p, identity.key_file_bytes(), mode=0o600)


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """The identity in the key file at ``path``; IdentityError if unreadable, too open or corrupt."""
    p = Path(path)
    try:
        st = p.stat()
        data = p.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read key file {p}: {exc.strerror}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(f"key file {p} is readable by others; run: chmod 600 {p}")
    return Identity.from_key_file_bytes(data, str(p))


def load_or_create_identity(path: str | os.PathLike[str]) -> Identity:
    """The identity at ``path``, or a new one saved there when no key file exists yet."""
    if Path(path).exists():
        return load_identity(path)
    ident = Identity.generate()
    save_identity(ident, path)
    return ident
