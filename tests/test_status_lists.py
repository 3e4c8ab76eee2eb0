"""status.json's step lists: the same JSON as encoding them whole, each entry encoded once."""

from __future__ import annotations

import json
import math
from collections import deque

from echo2.learner_hub.status_lists import GrowingList, StepLists, WindowList


def test_growing_list_encodes_each_entry_once_and_matches_json() -> None:
    hist: list[dict] = []
    g = GrowingList(tail=1)
    for step in range(1, 301):
        hist.append({"step": step, "reward": step / 7, "loss": -step / 3})
        hist[-1]["overhead_s"] = 0.01 * step  # the newest entry still changes
        view = hist[:-1] + [dict(h) for h in hist[-1:]]  # as hub_status hands it over
        assert json.loads(g.text(view)) == hist
    # 299 stable entries once each, plus the one newest entry every write: not 300 * 301 / 2
    assert g.encoded == 299 + 300


def test_growing_list_starts_again_when_replaced_or_shortened() -> None:
    g = GrowingList(tail=1)
    a = [{"step": i} for i in range(10)]
    assert json.loads(g.text(a)) == a
    b = [{"step": 100 + i} for i in range(12)]  # a restore put another list in its place
    assert json.loads(g.text(b)) == b
    assert json.loads(g.text(b[:3])) == b[:3]
    assert g.text([]) == "[]"


def test_window_list_follows_a_deque_and_encodes_each_entry_once() -> None:
    d: deque[dict] = deque(maxlen=100)
    w = WindowList()
    for step in range(1, 501):
        d.append({"step": step, "x": [step, step * 0.5]})
        assert json.loads(w.text(list(d))) == list(d)
    assert w.encoded == 500


def test_non_finite_floats_are_null_and_members_join() -> None:
    s = StepLists()
    base = {"history": [{"step": 1, "loss": math.nan}, {"step": 2, "loss": math.inf}],
            "train_metrics": [{"step": 2, "reward": -math.inf}]}
    out = json.loads("{" + s.members(base) + "}")
    assert out == {"history": [{"step": 1, "loss": None}, {"step": 2, "loss": None}],
                   "train_metrics": [{"step": 2, "reward": None}]}
    assert s.members({}) == ""
