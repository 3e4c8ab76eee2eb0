"""Key files: 0600 and atomic on save, refused on load when too open or not a key file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from echo2.keyfile import load_identity, load_or_create_identity, save_identity
from echo2.protocol.errors import IdentityError
from echo2.protocol.identity import Identity


def test_round_trip_mode_and_no_stray_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "node.key"
    ident = load_or_create_identity(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_identity(path).peer_id == ident.peer_id
    assert load_or_create_identity(path).peer_id == ident.peer_id  # loads, does not regenerate
    other = Identity.generate()
    save_identity(other, path)
    assert load_identity(path).peer_id == other.peer_id
    assert os.listdir(path.parent) == ["node.key"]


def test_refusals(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    save_identity(Identity.generate(), path)
    os.chmod(path, 0o640)
    with pytest.raises(IdentityError, match="readable by others"):
        load_identity(path)
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key\n")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="not an echo2 key file"):
        load_identity(bad)
    with pytest.raises(IdentityError, match="cannot read"):
        load_identity(tmp_path / "missing.key")
