"""The fast decoder's whole-result check of a PackedResult's completions (issue 20): it vouches
for exactly the completions whose own ``_check_fields`` passes, and a refused payload gets the
reference path's error word for word."""

from __future__ import annotations

import math

import numpy as np
import pytest

from echo2.protocol import canonical, fastdecode
from echo2.protocol.errors import SchemaError
from echo2.protocol.identity import Identity
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

NODE = Identity.from_seed(b"\x09" * 32)
GOOD = (pack_ids([1, 2, 3]), pack_logprobs([-0.5, -0.0, -3.0]))
BAD = [
    (b"\x01\x00\x00", b"\x00\x00\x00"),  # truncated id
    (pack_ids([1, 2]), pack_logprobs([-1.0])),  # one log-prob short
    (np.array([-5], "<i4").tobytes(), pack_logprobs([-1.0])),  # negative id
    (pack_ids([1, 2]), pack_logprobs([-1.0, math.nan])),
    (pack_ids([1]), pack_logprobs([0.5])),
    (pack_ids([1]), pack_logprobs([1e-30])),  # the smallest positive float32s too
    (pack_ids([1]), pack_logprobs([math.inf])),
    (pack_ids([1]), pack_logprobs([-math.inf])),
]


def comp(ids: bytes, lps: bytes, i: int = 0) -> PackedCompletion:
    return PackedCompletion(prompt_index=i, token_ids=ids, logprobs=lps, finish_reason="length")


def payload(comps: list[PackedCompletion]) -> bytes:
    r = PackedResult(task_id="t-1", task_hash=b"\x01" * 32, node_id=NODE.peer_id, version=0, completions=comps,
                     started_at=0.0, gen_seconds=0.1, tokens=0)
    return canonical.encode(r.to_wire())


def outcome(fn: object) -> object:
    try:
        return ("ok", fn())  # type: ignore[operator]
    except SchemaError as exc:
        return ("refused", str(exc))


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", [0, 1, 3])
def test_one_bad_completion_anywhere_is_not_vouched_for_and_refused_as_the_reference_does(
        bad: tuple[bytes, bytes], where: int) -> None:
    comps = [comp(*GOOD) for _ in range(4)]
    comps[where] = comp(*bad)
    with pytest.raises(SchemaError):
        comps[where]._check_fields("")
    assert not PackedCompletion.fast_check_all(comps)
    data = payload(comps)
    fast = outcome(lambda: fastdecode.decode_payload(PackedResult, data, max_size=1 << 26))
    ref = outcome(lambda: PackedResult.from_wire(canonical.decode(data, max_size=1 << 26)))
    assert fast[0] == "refused"
    assert fast == ref


def test_good_completions_are_vouched_for_together_without_a_check_each(monkeypatch: pytest.MonkeyPatch) -> None:
    comps = [comp(*GOOD, i=0) for _ in range(8)] + [comp(b"", b"")]
    assert PackedCompletion.fast_check_all(comps)
    assert PackedCompletion.fast_check_all([])
    data = payload(comps)
    want = PackedResult.from_wire(canonical.decode(data, max_size=1 << 26))

    def per_completion(self: PackedCompletion, path: str) -> None:
        raise AssertionError("checked one completion at a time")

    # the fast path no longer calls _check_fields per completion (~8 us each for a small result);
    # the reference path (canonical.decode removed) would, and fail here
    with monkeypatch.context() as mp:
        mp.setattr(PackedCompletion, "_check_fields", per_completion)
        mp.setattr(canonical, "decode", None)
        assert fastdecode.decode_payload(PackedResult, data, max_size=1 << 26) == want
