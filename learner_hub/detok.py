"""Table-based detokeniser for byte-level BPE tokenizers (GPT-2, SmolLM2, Llama-3, Qwen style).

The hub turns every accepted completion back into text for the reward functions. With the
tokenizer's own ``decode_batch`` that was 0.57 s of the 0.92 s of hub CPU a 36 MB result cost
(3,431,280 tokens in 464 completions, `echo2 bench intake --big-result-MB 36`, issue 20).

A byte-level tokenizer's decoding is a lookup: each token id stands for a fixed byte string (its
symbols mapped back through GPT-2's byte <-> unicode table), the bytes of a sequence are the
concatenation of its tokens' bytes, and the text is those bytes read as UTF-8 with each invalid
part replaced by U+FFFD (Rust's ``String::from_utf8_lossy``, which follows the same "maximal
subpart" rule as Python's ``errors="replace"``). So the bytes of every token are computed once,
and a batch is decoded by gathering bytes with numpy (no per-token Python) and one
``bytes.decode`` per completion.

Nothing here is assumed: :func:`byte_table` builds the table only for a tokenizer whose decoder is
``ByteLevel``, then checks it against the tokenizer's own ``decode`` (every id alone, and seeded
random sequences mixing every kind of id), and returns None on any mismatch; the hub then keeps
the tokenizer's ``decode_batch``. :class:`BatchDecoder` is what the hub hands to intake: plain
data (numpy arrays, or the tokenizer), so it pickles into an intake worker process.

Semantics matched (tokenizers 0.23, checked by tests/test_detok.py): a special added token is
dropped when ``skip_special`` (it does not split the byte stream: bytes on either side join into
one character); a non-special added token, and a special one kept, goes through the ByteLevel
decoder like any token; a token with a symbol outside the byte alphabet contributes its UTF-8
text as is; an id the tokenizer does not know contributes nothing. The hub's tokenizer is the
``tokenizers`` one, not a ``transformers`` tokenizer: no ``clean_up_tokenization_spaces`` step
exists on this path, today or here.
"""

from __future__ import annotations

import codecs
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

IdSeq: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"

#: tokens gathered per numpy pass: the gather's temporaries are ~24 bytes per output byte, so a
#: 36 MB result (3.4 M tokens, ~14 MB of text for SmolLM2) stays under ~100 MB of scratch
CHUNK_TOKENS = 1 << 20

#: random sequences checked against the tokenizer when a table is built (on top of every id alone)
CHECK_SEQS, CHECK_LEN = 64, 96


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_CHAR_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """What the ByteLevel decoder makes of one token: its symbols mapped back to bytes, or (one
    symbol outside the byte alphabet, e.g. an added token with a space) the token's UTF-8 as is."""
    try:
        return bytes(_CHAR_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def is_byte_level(tokenizer: Any) -> bool:
    """Whether a ``tokenizers.Tokenizer`` decodes with the plain ByteLevel decoder (a Sequence
    of decoders, ByteFallback, Metaspace and the rest are not table-decodable here)."""
    from tokenizers import decoders

    return isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)


def lossy_utf8(data: bytes | memoryview) -> str:
    """Bytes as text the way the tokenizer's Rust side does it (``from_utf8_lossy``)."""
    return codecs.utf_8_decode(data, "replace", True)[0]


@dataclass(frozen=True)
class ByteTable:
    """Every token id's bytes: ``data[offsets[i]:offsets[i + 1]]`` (empty for a skipped special
    token or an id the tokenizer does not know). Plain arrays: pickles cheaply (~1 MB for a
    49 k vocabulary) into a worker process."""

    data: npt.NDArray[np.uint8]
    offsets: npt.NDArray[np.int64]
    # int32 copies for the gather: half the memory traffic of int64 over 3.4 M tokens
    lengths: npt.NDArray[np.int32] = field(init=False, repr=False, compare=False)
    _starts: npt.NDArray[np.int32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.data) >= 1 << 31:
            raise ValueError("token table over 2 GiB")
        object.__setattr__(self, "lengths", np.diff(self.offsets).astype(np.int32))
        object.__setattr__(self, "_starts", self.offsets[:-1].astype(np.int32))

    @property
    def vocab_size(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_token_bytes(cls, pieces: Sequence[bytes]) -> ByteTable:
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.frombuffer(b"".join(pieces), dtype=np.uint8).copy(), offsets)

    def gather(self, ids: npt.NDArray[np.integer[Any]], bounds: npt.NDArray[np.int64]
               ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """The bytes of ``ids`` back to back, and the byte offsets where the sequences that
        ``bounds`` delimits (token offsets, as from :func:`concat_ids`) start and end. Ids must be
        in range (the caller checks)."""
        ids = ids.astype(np.intp, copy=False)  # once: numpy would convert an int32 index at each use
        lens = self.lengths[ids]
        byte_bounds = np.zeros(len(bounds), dtype=np.int64)
        nonempty = bounds[:-1] < bounds[1:]
        if nonempty.any():
            # each sequence's byte count; empty sequences are left out of reduceat (it would
            # count the next token for them) and their 0 stays
            seq_bytes = np.zeros(len(bounds) - 1, dtype=np.int64)
            seq_bytes[nonempty] = np.add.reduceat(lens, bounds[:-1][nonempty], dtype=np.int64)
            np.cumsum(seq_bytes, out=byte_bounds[1:])
        if not byte_bounds[-1]:
            return np.zeros(0, np.uint8), byte_bounds
        if not lens.all():  # skipped specials and unknown ids add no bytes (and would collide below)
            keep = lens > 0
            ids, lens = ids[keep], lens[keep]
        starts = self._starts[ids]
        if int(lens.max()) == 1:  # the byte tokenizer, or a batch of one-byte tokens: a plain gather
            return self.data[starts], byte_bounds
        return np.concatenate([self._gather_chunk(starts[a:a + CHUNK_TOKENS], lens[a:a + CHUNK_TOKENS])
                               for a in range(0, len(starts), CHUNK_TOKENS)]), byte_bounds

    def _gather_chunk(self, starts: npt.NDArray[np.int32], lens: npt.NDArray[np.int32]) -> npt.NDArray[np.uint8]:
        # The source index of every output byte, built by a running sum: +1 inside a token, and at
        # each token's first output byte a jump from the previous token's last source byte to this
        # token's start. Two passes over the output (scatter, cumsum) instead of np.repeat's
        # per-element loop. int32 is exact: every partial sum is a source index (< 2^31, checked
        # at construction) and every jump a difference of two.
        out_starts = np.cumsum(lens, dtype=np.int64) - lens
        src = np.ones(int(out_starts[-1] + lens[-1]), dtype=np.int32)
        src[0] = starts[0]
        src[out_starts[1:]] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
        np.cumsum(src, out=src)
        return self.data[src]

    def decode_batch(self, seqs: Sequence[IdSeq]) -> list[str]:
        """Each sequence's text; ValueError if an id is outside the table (negative or too big:
        the tokenizer refuses or drops those, so the caller falls back to it)."""
        if not seqs:
            return []
        return self.decode_flat(*concat_ids(seqs))

    def decode_flat(self, ids: npt.NDArray[np.integer[Any]], bounds: npt.NDArray[np.int64]) -> list[str]:
        """:meth:`decode_batch` of sequences already joined: ``ids[bounds[k]:bounds[k + 1]]`` is
        the k-th (intake joins a packed result's ids once for its checks and texts alike)."""
        if len(bounds) < 2:
            return []
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError("token id outside the table")
        data, byte_bounds = self.gather(ids, bounds)
        buf = memoryview(data.tobytes())
        return [lossy_utf8(buf[a:b]) for a, b in itertools.pairwise(byte_bounds.tolist())]


def concat_ids(seqs: Sequence[IdSeq]) -> tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.int64]]:
    """All ids of ``seqs`` in one integer array (int32 stays int32: numpy indexes with it), and the token offsets where each sequence starts
    and ends (len(seqs) + 1 of them). Arrays are joined by numpy; lists of ints by one C-level
    pass (``np.fromiter``): ~25 ns a token, against ~170 ns a token for the Rust decode."""
    lengths = [len(s) for s in seqs]
    bounds = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    if all(isinstance(s, np.ndarray) for s in seqs):
        arrays = [np.asarray(s) for s in seqs]
        for a in arrays:
            if a.dtype.kind not in "iu":
                raise ValueError("token ids must be integers")
        flat = np.concatenate(arrays)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(bounds[-1]))
    return flat, bounds


def build_table(tokenizer: Any, *, skip_special: bool = True) -> ByteTable:
    """The table of a byte-level ``tokenizers.Tokenizer`` (no check: see :func:`byte_table`)."""
    n = int(tokenizer.get_vocab_size(with_added_tokens=True))
    added = tokenizer.get_added_tokens_decoder()
    n = max([n, *(i + 1 for i in added)])
    special = {i for i, t in added.items() if t.special}
    pieces: list[bytes] = []
    for i in range(n):
        tok = tokenizer.id_to_token(i)
        pieces.append(b"" if tok is None or (skip_special and i in special) else token_bytes(tok))
    return ByteTable.from_token_bytes(pieces)


def utf8_probes(tokenizer: Any) -> list[list[int]]:
    """Valid UTF-8 text spelt with the 256 one-symbol byte tokens: every lead byte (C2..F4) and
    every continuation byte (80..BF) in a character. A table byte wrong for a byte >= 0x80 is
    invisible when the id is decoded alone (one U+FFFD either way), and visible here. (C0, C1,
    F5..FF are invalid anywhere, so any of them decodes the same as another.)"""
    b2u = bytes_to_unicode()
    ids = [tokenizer.token_to_id(b2u[b]) for b in range(256)]
    cps = [*range(0x80, 0x800), 0x800, *range(0x1000, 0x10000, 0x1000), 0x10000, *range(0x40000, 0x110000, 0x40000)]
    chars = [chr(c).encode("utf-8") for c in cps]
    out = []
    for a in range(0, len(chars), 64):
        seq = [ids[b] for ch in chars[a:a + 64] for b in ch]
        if all(i is not None for i in seq):
            out.append([int(i) for i in seq])
    return out


def check_table(table: ByteTable, tokenizer: Any, *, skip_special: bool = True, seed: int = 0) -> str | None:
    """Why ``table`` does not decode as ``tokenizer`` does, or None when it agrees: every id
    alone, the byte symbols inside valid characters (:func:`utf8_probes`), then seeded random
    sequences that mix one-byte pieces >= 0x80 (partial UTF-8), added tokens and any id, compared
    exactly. Together these pin the byte map, the skipping and the added tokens' handling; a
    token of several symbols is those symbols' bytes (the ByteLevel decoder's rule)."""
    n = table.vocab_size
    singles = [[i] for i in range(n)]
    want = tokenizer.decode_batch(singles, skip_special_tokens=skip_special)
    got = table.decode_batch(singles)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w != g:
            return f"id {i}: tokenizer {w!r}, table {g!r}"
    rng = np.random.default_rng(seed)
    one = np.flatnonzero(table.lengths == 1)
    high = one[table.data[table.offsets[one]] >= 0x80]
    added = np.array(sorted(tokenizer.get_added_tokens_decoder()), dtype=np.int64)
    pools = [p for p in (high, added, np.arange(n)) if p.size]
    seqs = utf8_probes(tokenizer)
    for _ in range(CHECK_SEQS):
        which = rng.integers(0, len(pools), CHECK_LEN)
        seqs.append([int(pools[w][rng.integers(0, pools[w].size)]) for w in which])
    want = tokenizer.decode_batch(seqs, skip_special_tokens=skip_special)
    for s, w, g in zip(seqs, want, table.decode_batch(seqs), strict=True):
        if w != g:
            return f"sequence {s[:8]}...: tokenizer {w[:40]!r}, table {g[:40]!r}"
    return None


def byte_table(tokenizer: Any, *, skip_special: bool = True) -> ByteTable | None:
    """A checked table for ``tokenizer``, or None when it is not byte-level or any check fails
    (the caller then decodes with the tokenizer; the reason is logged)."""
    if not is_byte_level(tokenizer):
        return None
    try:
        table = build_table(tokenizer, skip_special=skip_special)
        why = check_table(table, tokenizer, skip_special=skip_special)
    except Exception as exc:  # an exotic tokenizer this module does not know: the tokenizer decodes
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        log.info("byte-level tokenizer decodes itself: its byte table disagrees (%s)", why[:200])
        return None
    return table


class BatchDecoder:
    """``decode_batch(seqs) -> texts`` for intake: the byte table when the tokenizer has a
    checked one, else the tokenizer's own ``decode_batch``. Picklable (a ``tokenizers.Tokenizer``
    pickles as its JSON; the table as arrays), so an intake worker process gets the same one."""

    def __init__(self, tokenizer: Any, *, skip_special: bool = True, table: ByteTable | None = None,
                 build: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.table = table if table is not None or not build else byte_table(tokenizer, skip_special=skip_special)

    @property
    def kind(self) -> str:
        return "table" if self.table is not None else "tokenizer"

    def decode_flat(self, ids: npt.NDArray[np.integer[Any]], bounds: npt.NDArray[np.int64]) -> list[str]:
        """Each ``ids[bounds[k]:bounds[k + 1]]``'s text, as :meth:`__call__` gives for the
        sequences apart (the packed intake's path: its ids are joined once, intake_check.py)."""
        if self.table is not None:
            try:
                return self.table.decode_flat(ids, bounds)
            except (ValueError, OverflowError, TypeError):
                pass  # an id out of range: the tokenizer's own answer (or error), as __call__
        return self([ids[a:b] for a, b in itertools.pairwise(bounds.tolist())])

    def __call__(self, seqs: Sequence[IdSeq]) -> list[str]:
        if self.table is not None:
            try:
                return self.table.decode_batch(seqs)
            except (ValueError, OverflowError, TypeError):
                pass  # an id out of range or not an int: the tokenizer's own answer (or error)
        lists = [s.tolist() if isinstance(s, np.ndarray) else list(s) for s in seqs]
        return [str(t) for t in self.tokenizer.decode_batch(lists, skip_special_tokens=self.skip_special)]
