from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from echo2.models import spec as ms
from echo2.protocol.errors import ManifestError


@pytest.fixture(scope="module")
def handle() -> ms.TokenizerHandle:
    _, arts = ms.artifacts_for(ms.tiny_config(), ms.tokenizer_json())
    return ms.load_tokenizer(arts)


def test_special_and_byte_ids_looked_up_by_token() -> None:
    tok = ms.build_byte_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 259
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    # Every byte value has its own id 3 + b, in byte order (ids of the ByteLevel symbols).
    vocab = tok.get_vocab(with_added_tokens=True)
    assert sorted(vocab.values()) == list(range(259))
    b2u = ms._bytes_to_unicode()
    assert set(b2u.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert all(vocab[b2u[b]] == 3 + b for b in range(256))
    h = ms.load_tokenizer({"tokenizer.json": ms.tokenizer_json()})
    assert (h.pad_id, h.bos_id, h.eos_id) == (0, 1, 2)
    assert h.stop_ids == frozenset({2})
    assert h.encode("A") == [3 + ord("A")]
    assert h.encode("\x00\x7f") == [3, 3 + 127]
    assert h.encode("é") == [3 + 0xC3, 3 + 0xA9]
    assert h.encode("hi", add_bos=True) == [1, 3 + ord("h"), 3 + ord("i")]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_text(text: str) -> None:
    h = ms.load_tokenizer({"tokenizer.json": ms.tokenizer_json()})
    ids = h.encode(text)
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert h.decode(ids) == text


def test_round_trip_non_ascii_and_literal_specials(handle: ms.TokenizerHandle) -> None:
    for text in ["héllo wörld", "日本語 ✓ 😀", " lead and trail ", "<eos><pad>x<bos>", "\t\n\r\x00"]:
        ids = handle.encode(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert handle.decode(ids) == text
    # Control tokens are skipped on decode by default, kept when asked.
    assert handle.decode([1, 3 + ord("a"), 2]) == "a"
    assert handle.decode([1, 3 + ord("a"), 2], skip_special=False) == "<bos>a<eos>"


def test_tokenizer_json_round_trip() -> None:
    raw = ms.tokenizer_json()
    assert raw == ms.tokenizer_json()  # deterministic bytes (content addressing)
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    assert tok.to_str().encode("utf-8") == raw


def test_artifacts_round_trip() -> None:
    cfg = ms.tiny_config(hidden=64, layers=1)
    cj, arts = ms.artifacts_for(cfg, ms.tokenizer_json())
    assert json.loads(cj) == cfg
    assert set(arts) == {"tokenizer.json"}
    assert ms.parse_model_config(cj)["hidden_size"] == 64
    assert cfg["eos_token_id"] == 2 and cfg["pad_token_id"] == 0 and cfg["vocab_size"] == 259


def test_model_from_config_deterministic_given_seed() -> None:
    cj, _ = ms.artifacts_for(ms.tiny_config(), ms.tokenizer_json())
    torch.manual_seed(7)
    a = ms.model_from_config(cj)
    torch.manual_seed(7)
    b = ms.model_from_config(cj)
    torch.manual_seed(8)
    c = ms.model_from_config(cj)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    n = sum(p.numel() for p in a.parameters())
    assert 400_000 < n < 700_000  # the brief's ~0.5 M-parameter model
    assert not a.training
    assert next(a.parameters()).dtype == torch.float32


def test_llama_arch_and_bfloat16() -> None:
    cj, _ = ms.artifacts_for(ms.tiny_config(hidden=32, layers=1, heads=2, arch="llama"), ms.tokenizer_json())
    m = ms.model_from_config(cj, dtype=torch.bfloat16)
    assert type(m).__name__ == "LlamaForCausalLM"
    assert next(m.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "text",
    ["not json", "[1, 2]", json.dumps({"model_type": "bert"}), json.dumps({"hidden_size": 4})],
)
def test_bad_model_config_refused(text: str) -> None:
    with pytest.raises(ManifestError):
        ms.model_from_config(text)


def test_bad_tokenizer_artifacts_refused() -> None:
    with pytest.raises(ManifestError):
        ms.load_tokenizer({})
    with pytest.raises(ManifestError):
        ms.load_tokenizer({"tokenizer.json": b"{not json"})
    with pytest.raises(ManifestError):
        ms.load_tokenizer({"tokenizer.json": ms.tokenizer_json(), "tokenizer_config.json": b"\xff"})


def test_generation_config_adds_stop_ids() -> None:
    arts = {
        "tokenizer.json": ms.tokenizer_json(),
        "generation_config.json": b'{"eos_token_id": [2, 40, 99999]}',
    }
    h = ms.load_tokenizer(arts)
    assert h.stop_ids == frozenset({2, 40})  # out-of-vocabulary ids are ignored


def test_load_local_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cj, arts = ms.artifacts_for(ms.tiny_config(hidden=32, layers=1, heads=2), ms.tokenizer_json())
    torch.manual_seed(0)
    m = ms.model_from_config(cj)
    m.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(arts["tokenizer.json"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    m2, cj2, arts2 = ms.load_local_model(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(arts2)
    assert set(arts2) <= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert arts2["tokenizer.json"] == arts["tokenizer.json"]
    assert json.loads(cj2)["hidden_size"] == 32
    s1, s2 = m.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    # The shipped config rebuilds the same architecture.
    m3 = ms.model_from_config(cj2)
    m3.load_state_dict(s2, strict=True)
    assert ms.load_tokenizer(arts2).eos_id == 2


def test_load_local_model_without_tokenizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cj, _ = ms.artifacts_for(ms.tiny_config(hidden=32, layers=1, heads=2), ms.tokenizer_json())
    ms.model_from_config(cj).save_pretrained(tmp_path)
    with pytest.raises(ManifestError):
        ms.load_local_model(tmp_path)


def test_teacher_forced_logprobs_reference() -> None:
    cj, _ = ms.artifacts_for(ms.tiny_config(hidden=32, layers=1, heads=2), ms.tokenizer_json())
    torch.manual_seed(1)
    m = ms.model_from_config(cj)
    prompt, comp = [1, 10, 11, 12], [20, 21, 2]
    got = ms.teacher_forced_logprobs(m, prompt, comp, 0.5)
    with torch.no_grad():
        logits = m(torch.tensor([prompt + comp])).logits[0]
    for i, tok in enumerate(comp):
        want = torch.log_softmax(logits[len(prompt) - 1 + i] / 0.5, -1)[tok].item()
        assert math.isclose(got[i], want, abs_tol=1e-6)
    assert all(x <= 0 for x in got)
    # Greedy (T == 0) is scored at T == 1.
    assert ms.teacher_forced_logprobs(m, prompt, comp, 0.0) == ms.teacher_forced_logprobs(
        m, prompt, comp, 1.0
    )
    assert ms.teacher_forced_logprobs(m, prompt, [], 1.0) == []
    with pytest.raises(ValueError):
        ms.teacher_forced_logprobs(m, [], comp, 1.0)
