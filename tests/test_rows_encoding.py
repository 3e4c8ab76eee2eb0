"""The stored form of training rows (issue 20): the direct packer gives exactly the generic
canonical encoding, for every kind of sample, and refuses what the canonical encoder refuses."""

from __future__ import annotations

import math
import random
from array import array

import numpy as np
import pytest

from echo2.learner_hub.rows import Group, Sample, decode_groups, encode_groups, encode_groups_generic
from echo2.protocol.errors import SchemaError


def sample(rng: random.Random, packed: bool) -> Sample:
    n = rng.randrange(0, 300)
    ids = [rng.randrange(0, 2**31 - 1) for _ in range(n)]
    lps = [-rng.random() * 5 for _ in range(n)]
    parts = {rng.choice(["acc", "fmt", "é", "Z", "len_penalty"]): rng.uniform(-3, 3) for _ in range(rng.randrange(0, 4))}
    s = Sample(ids, array("f", lps) if packed else lps, rng.choice([0.0, 1.0, -0.5, 1e-300, 7]), rng.randrange(0, 2**40),
               rng.choice(["", "12D3KooWabc", "ß☃"]), rng.choice(["stop", "length"]), parts)
    if packed:
        s.packed = (np.asarray(ids, dtype="<i4").tobytes(), np.asarray(lps, dtype="<f4").tobytes())
    return s


@pytest.mark.parametrize("seed", range(20))
def test_direct_packer_equals_the_canonical_encoding(seed: int) -> None:
    rng = random.Random(seed)
    groups = [Group([rng.randrange(0, 2**40) for _ in range(rng.randrange(0, 70))],
                    [sample(rng, rng.random() < 0.5) for _ in range(rng.randrange(0, 9))]) for _ in range(rng.randrange(0, 5))]
    data = encode_groups(groups)
    assert data == encode_groups_generic(groups)
    back = decode_groups(data)
    assert [g.prompt_ids for g in back] == [g.prompt_ids for g in groups]
    assert [[s.reward_parts for s in g.samples] for g in back] == [[s.reward_parts for s in g.samples] for g in groups]


@pytest.mark.parametrize("bad", ["nan_reward", "inf_part", "bool_ids", "huge_id"])
def test_what_canonical_refuses_or_normalises_stays_so(bad: str) -> None:
    s = Sample([1, 2], [-0.5, -0.25], 1.0, 3)
    g = Group([5, 6], [s])
    if bad == "nan_reward":
        s.reward = math.nan
    elif bad == "inf_part":
        s.reward_parts = {"x": math.inf}
    elif bad == "bool_ids":
        g.prompt_ids = [True, 2]  # canonical keeps a bool a bool: the generic path encodes it
    else:
        g.prompt_ids = [2**70]
    if bad == "bool_ids":
        assert encode_groups([g]) == encode_groups_generic([g])
        return
    with pytest.raises(SchemaError):
        encode_groups([g])
