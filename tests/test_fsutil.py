from __future__ import annotations

import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from echo2.fsutil import TMP_PREFIX, atomic_write, atomic_write_with


def test_atomic_write_replaces_whole_file_with_mode(tmp_path: Path) -> None:
    p = tmp_path / "k"
    atomic_write(p, b"old")
    atomic_write(p, "new", mode=0o600)
    assert p.read_bytes() == b"new"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(TMP_PREFIX)]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    atomic_write(p, b"whole")

    def half(f: BinaryIO) -> None:
        f.write(b"ha")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write_with(p, half)
    assert p.read_bytes() == b"whole"
    assert [x.name for x in tmp_path.iterdir()] == ["state.json"]
