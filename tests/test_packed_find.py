"""intake_check.packed_find (issue 20): a packed result's checks, finishes and texts from one join
of its arrays give exactly what the per-completion path gives (completions_problem, then
compact_rows), for honest and broken results alike, with either kind of decoder."""

from __future__ import annotations

import random

import numpy as np
import pytest

from echo2.learner_hub.detok import BatchDecoder, ByteTable
from echo2.learner_hub.intake_check import (
    Limits,
    compact_rows,
    completions_problem,
    packed_find,
    packed_find_many,
)
from echo2.protocol.identity import Identity
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

VOCAB, STOP = 50, frozenset({0, 7})
LIM = Limits(VOCAB, 12, STOP)
STOP_ARR = np.array(sorted(STOP), dtype=np.int64)
NODE = Identity.from_seed(b"\x0b" * 32).peer_id
TABLE = ByteTable.from_token_bytes([b"" if i in STOP else bytes([97 + i % 26]) * (1 + i % 3) for i in range(VOCAB)])


def listed(seqs: list[object]) -> list[str]:
    """A decoder without decode_flat (as a tokenizer's own decode_batch)."""
    return [",".join(str(int(x)) for x in s) for s in seqs]  # type: ignore[attr-defined]


DECODERS = [listed, BatchDecoder(None, table=TABLE, build=False)]


def result(comps: list[tuple[int, list[int], list[float]]]) -> PackedResult:
    pcs = [PackedCompletion(i, pack_ids(ids), pack_logprobs(lps), "length") for i, ids, lps in comps]
    return PackedResult(task_id="t", task_hash=b"\x01" * 32, node_id=NODE, version=0, completions=pcs,
                        started_at=0.0, gen_seconds=0.1, tokens=0)


def reference(groups: tuple[int, ...], r: PackedResult, decode: object) -> tuple[object, object, object]:
    problem = completions_problem(groups, r, LIM, STOP_ARR)
    if problem is not None:
        return problem, None, None
    return (None, *compact_rows(len(groups), r, LIM, decode))  # type: ignore[arg-type]


def honest(rng: random.Random, groups: tuple[int, ...]) -> list[tuple[int, list[int], list[float]]]:
    out = []
    for p, size in enumerate(groups):
        for _ in range(size):
            n = rng.randrange(0, LIM.max_new_tokens + 1)
            ids = [rng.choice([i for i in range(VOCAB) if i not in STOP]) for _ in range(n)]
            if ids and rng.random() < 0.5:
                ids[-1] = rng.choice(sorted(STOP))
            out.append((p, ids, [-rng.random() * 5 for _ in ids]))
    return out


def broken(rng: random.Random, comps: list[tuple[int, list[int], list[float]]]) -> list[tuple[int, list[int], list[float]]]:
    comps = [(p, list(ids), list(lps)) for p, ids, lps in comps]
    k = rng.randrange(len(comps))
    p, ids, lps = comps[k]
    how = rng.randrange(6)
    if how == 0 or not ids:
        ids, lps = ids + [1] * (LIM.max_new_tokens + 1 - len(ids)), lps + [-1.0] * (LIM.max_new_tokens + 1 - len(lps))
    elif how == 1:
        ids[rng.randrange(len(ids))] = VOCAB + rng.randrange(3)
    elif how == 2:
        lps[rng.randrange(len(lps))] = rng.choice([-2e4, 1e-3])
    elif how == 3 and len(ids) > 1:
        ids[rng.randrange(len(ids) - 1)] = 7  # a stop token inside
    elif how == 4:
        p = rng.choice([p + 1, 9])  # the wrong prompt, or one outside the task
    else:
        comps.pop(k)
        return comps
    comps[k] = (p, ids, lps)
    return comps


@pytest.mark.parametrize("decode", DECODERS)
def test_packed_find_equals_the_per_completion_path(decode: object) -> None:
    rng = random.Random(5)
    for trial in range(300):
        groups = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 4)))
        comps = honest(rng, groups)
        if trial % 3 == 0:
            comps = broken(rng, comps)
        if trial % 5 == 0:
            rng.shuffle(comps)  # prompts out of order: the texts still come per prompt
        r = result(comps)
        if not r.completions:
            continue
        got = packed_find(groups, r, LIM, decode, STOP_ARR)  # type: ignore[arg-type]
        assert got == reference(groups, r, decode), (trial, comps)


def test_many_stop_tokens_are_refused_without_a_set_of_their_positions() -> None:
    r = result([(0, [7] * 12, [-1.0] * 12)])
    assert packed_find((1,), r, LIM, listed, STOP_ARR)[0] == "completion goes on after a stop token"


def test_the_table_decoder_decodes_joined_ids_as_it_decodes_them_apart() -> None:
    dec = DECODERS[1]
    assert isinstance(dec, BatchDecoder)
    seqs = [np.array(s, dtype="<i4") for s in ([1, 2, 3], [], [4], [5, 6, 8, 9])]
    ids = np.concatenate(seqs)
    bounds = np.array([0, 3, 3, 4, 8], dtype=np.int64)
    assert dec.decode_flat(ids, bounds) == dec(seqs)
    # an id outside the table: both fall back to the tokenizer (None here: it raises alike)
    with pytest.raises(AttributeError):
        dec.decode_flat(np.array([VOCAB + 1], dtype="<i4"), np.array([0, 1], dtype=np.int64))


@pytest.mark.parametrize("decode", DECODERS)
def test_a_batch_checked_together_equals_each_result_checked_alone(decode: object) -> None:
    """A node's batch is checked on one join of all its results' arrays; a broken result among
    honest ones gets its own fault, and the honest ones their rows and texts, as alone."""
    rng = random.Random(11)
    for trial in range(150):
        items = []
        for _ in range(rng.randrange(1, 9)):
            groups = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 3)))
            comps = honest(rng, groups)
            if rng.random() < 0.15:
                comps = broken(rng, comps)
            if rng.random() < 0.1:
                rng.shuffle(comps)
            items.append((groups, result(comps)))
        got = packed_find_many(items, LIM, decode, STOP_ARR)  # type: ignore[arg-type]
        assert got == [reference(g, r, decode) for g, r in items], trial


def test_int32_list_reads_little_endian_ids_as_numpy_does() -> None:
    from echo2.learner_hub.intake import int32_list

    for ids in ([], [0], [1, 2, 3], [-(2**31), 2**31 - 1, -1, 65_536]):
        data = np.array(ids, dtype="<i4").tobytes()
        assert int32_list(data) == np.frombuffer(data, dtype="<i4").tolist() == ids


def test_arrays_from_views_of_a_reply_buffer_read_the_numbers_not_the_bytes() -> None:
    """The hub decodes a worker's reply with a sample's arrays as views of the reply's buffer:
    ``array(code, view)`` would iterate the view and make one element per byte."""
    import msgspec

    from echo2.learner_hub.intake import float32_array, int32_array, sample_of
    from echo2.learner_hub.intake_check import CompactSample

    ids, lps = [5, 70_000, 0, 2**31 - 1], [-0.5, -1.25, 0.0, -7.0]
    sent = CompactSample(memoryview(pack_ids(ids)), memoryview(pack_logprobs(lps)), True, "length")
    buf = bytearray(msgspec.msgpack.encode([sent]))  # as _read_reply receives a reply
    (got,) = msgspec.msgpack.Decoder(list[CompactSample]).decode(buf)
    assert isinstance(got.ids, memoryview) and got.ids.obj is buf  # a view, not a copy
    assert list(int32_array(got.ids)) == ids
    assert list(float32_array(got.logprobs)) == lps
    s = sample_of(got, 3, "peer")
    assert list(s.token_ids) == ids and list(s.logprobs) == lps
    assert s.packed is not None and bytes(s.packed[0]) == pack_ids(ids)


def test_a_sample_holding_views_of_a_reply_pickles_for_the_learner_ranks() -> None:
    """The distributed learner sends its ranks their groups pickled; a sample's packed arrays
    may be views of a worker's reply, which do not pickle: they travel as bytes."""
    import pickle
    from array import array

    from echo2.learner_hub.rows import Sample

    buf = bytearray(pack_ids([1, 2, 3]) + pack_logprobs([-0.5, -1.0, -2.0]))
    s = Sample(array("i", [1, 2, 3]), array("f", [-0.5, -1.0, -2.0]), 0.5, 3, "peer", "length", {"f": 0.5},
               packed=(memoryview(buf)[:12], memoryview(buf)[12:]))
    got = pickle.loads(pickle.dumps(s))
    assert got == s and got.packed == (pack_ids([1, 2, 3]), pack_logprobs([-0.5, -1.0, -2.0]))
    assert pickle.loads(pickle.dumps(Sample([1], [-0.1], 0.0, 1))).packed is None
