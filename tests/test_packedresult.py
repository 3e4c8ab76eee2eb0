"""PackedResult (issue 20 item 3): packing, the receiver's length and range checks, intake of the
packed form next to the list form, and the store's packed payload."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
from test_intake import STOP, VOCAB, answer, issue, make_intake, submit

from echo2.learner_hub.intake import Accept, Punish
from echo2.learner_hub.recipe import PromptItem
from echo2.learner_hub.rewards import TrainerState, batch_of, reward_kwargs
from echo2.learner_hub.rows import Group, Sample, decode_groups, encode_groups
from echo2.protocol import canonical, envelope
from echo2.protocol.errors import DecodeError, SchemaError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Result
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs
from echo2.protocol.wire import MAX_RESULT

NODE = Identity.from_seed(b"\x07" * 32)


def comp(ids: bytes, lps: bytes, i: int = 0) -> PackedCompletion:
    return PackedCompletion(prompt_index=i, token_ids=ids, logprobs=lps, finish_reason="length")


def result(comps: list[PackedCompletion]) -> PackedResult:
    return PackedResult(task_id="t-1", task_hash=b"\x01" * 32, node_id=NODE.peer_id, version=0, completions=comps,
                        started_at=0.0, gen_seconds=0.1, tokens=0)


def test_pack_round_trips_and_refuses_what_int32_cannot_hold() -> None:
    ids, lps = [0, 5, 2**31 - 1], [-0.5, -0.0, -1e3]
    c = comp(pack_ids(ids), pack_logprobs(lps)).validate()
    assert np.frombuffer(c.token_ids, "<i4").tolist() == ids
    assert np.frombuffer(c.logprobs, "<f4").tolist() == lps
    assert c.n_tokens == 3
    with pytest.raises(ValueError, match="outside"):
        pack_ids([2**31])
    with pytest.raises(ValueError, match="outside"):
        pack_ids([-1])


@pytest.mark.parametrize(("ids", "lps", "match"), [
    (b"\x01\x00\x00", b"\x00\x00\x00", "not a whole number of int32"),  # truncated id
    (pack_ids([1, 2]), pack_logprobs([-1.0]), "must match"),  # one log-prob short
    (pack_ids([1]), pack_logprobs([-1.0]) + b"\x00", "must match"),
    (np.array([-5], "<i4").tobytes(), pack_logprobs([-1.0]), "negative"),
    (pack_ids([1, 2]), pack_logprobs([-1.0, math.nan]), "log-prob 1 is nan"),
    (pack_ids([1]), pack_logprobs([0.5]), "log-prob 0 is 0.5"),
    (pack_ids([1]), pack_logprobs([math.inf]), "log-prob 0 is inf"),
    (pack_ids([1]), pack_logprobs([-math.inf]), "must be finite"),
    (pack_ids([1] * 8193), pack_logprobs([-1.0] * 8193), "exceeds"),  # past max_new_tokens int32s
])
def test_bad_arrays_are_refused_with_a_clear_error(ids: bytes, lps: bytes, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        result([comp(ids, lps)]).validate()


def test_packed_result_travels_signed_and_a_truncated_frame_is_refused() -> None:
    r = result([comp(pack_ids([3, 4]), pack_logprobs([-0.25, -2.0]))])
    data = envelope.seal(NODE, r)
    got = envelope.open_envelope(data, (PackedResult, Result), replay=None, max_size=MAX_RESULT).message
    assert got == r
    with pytest.raises((DecodeError, SchemaError)):
        envelope.open_envelope(data[:-7], (PackedResult, Result), replay=None, max_size=MAX_RESULT)
    # a tampered array byte: the signature over the raw bytes fails before any decoding
    i = data.index(pack_logprobs([-0.25, -2.0]))
    bad = data[:i] + b"\x01" + data[i + 1:]
    with pytest.raises(Exception, match="signature"):
        envelope.open_envelope(bad, PackedResult, replay=None, max_size=MAX_RESULT)


def packed_answer(r: Result) -> PackedResult:
    comps = [PackedCompletion(c.prompt_index, pack_ids(c.token_ids), pack_logprobs(c.logprobs), c.finish_reason)
             for c in r.completions]
    return PackedResult(**{**r.__dict__, "completions": comps})


def test_intake_judges_the_packed_form_as_the_list_form() -> None:
    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    v = intake.judge(t.node_id, packed_answer(answer(t, tokens=[VOCAB + 1])), 1.0, 0)
    assert isinstance(v, Punish) and "vocabulary" in v.error.message
    v = intake.judge(t.node_id, packed_answer(answer(t, tokens=[STOP, 5])), 1.0, 0)
    assert isinstance(v, Punish) and "after a stop token" in v.error.message
    list_form = answer(t)
    v = intake.judge(t.node_id, packed_answer(list_form), 1.0, 0)
    assert isinstance(v, Accept)
    items = [g.item for g in v.task.groups]
    assert v.texts == [[item] * 2 for item in items]  # the stop token is not in the text
    s = v.rows[0].samples[0]
    assert list(s.token_ids) == list(list_form.completions[0].token_ids) and s.finish_reason == "stop"
    assert list(s.logprobs) == [-0.5, -0.5] and s.packed is not None


def test_a_packed_samples_ids_are_no_container_for_the_collector_and_reward_functions_get_lists() -> None:
    # a buffered sample is walked by every young collection until trained: no instance dict, and
    # ids and log-probs whose traversal visits no element (a list of 64 ids visits 64 ints); TRL's
    # completion_ids stay lists
    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    list_form = answer(t)
    v = intake.judge(t.node_id, packed_answer(list_form), 1.0, 0)
    assert isinstance(v, Accept)
    s = v.rows[0].samples[0]
    assert not hasattr(s, "__dict__") and len(s.token_ids) == 2
    assert not [x for x in gc.get_referents(s.token_ids, s.logprobs) if not isinstance(x, type)]
    items = [PromptItem(text=str(g.item), prompt=str(g.item)) for g in v.task.groups]
    kw = reward_kwargs(batch_of(v.rows, items, v.texts), TrainerState())
    assert kw["completion_ids"][0] == list(list_form.completions[0].token_ids)
    assert all(type(ids) is list and all(type(x) is int for x in ids) for ids in kw["completion_ids"])


def test_intake_refuses_a_logprob_below_the_floor_in_either_form() -> None:
    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    r = answer(t)
    low = Result(**{**r.__dict__, "completions": [
        type(c)(c.prompt_index, c.token_ids, [-0.5, -1e5], c.finish_reason) for c in r.completions]})
    for msg in (low, packed_answer(low)):
        v = intake.judge(t.node_id, msg, 1.0, 0)
        assert isinstance(v, Punish) and "log-prob 1" in v.error.message and "floor" in v.error.message


def test_store_keeps_packed_arrays_as_received_and_reads_old_payloads() -> None:
    ids, lps = pack_ids([7, 8, 9]), pack_logprobs([-0.1, -0.2, -0.3])
    packed = Sample(np.frombuffer(ids, "<i4").tolist(), np.frombuffer(lps, "<f4").tolist(), 1.0, 2, "n", "length",
                    {"f": 1.0}, packed=(ids, lps))
    plain = Sample([1, 2], [-0.5, -0.25], 0.5, 2, "n", "stop")
    payload = encode_groups([Group([1], [packed, plain])])
    stored = canonical.decode(payload, max_size=1 << 20)[0]["samples"]
    assert stored[0]["token_ids"] == ids and stored[0]["logprobs"] == lps  # the bytes as received
    back = decode_groups(payload)[0].samples
    assert back[0] == packed and back[1] == plain
    old = canonical.encode([{"prompt_ids": [1], "samples": [{
        "token_ids": [1, 2], "logprobs": [-0.5, -0.25], "reward": 0.5, "version": 2, "node_id": "n",
        "finish_reason": "stop", "reward_parts": {}}]}])
    assert decode_groups(old)[0].samples == [plain]
