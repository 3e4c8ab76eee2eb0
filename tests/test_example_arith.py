"""The shipped recipe examples/arith: data splits and reward functions in TRL's form."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "arith"


def _rewards() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arith_rewards", RECIPE / "rewards.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (RECIPE / "data" / f"{name}.jsonl").read_text().splitlines()]


def test_splits_are_disjoint_and_regenerate_identically(tmp_path: Path) -> None:
    train, test = _rows("train"), _rows("test")
    assert len(train) == 51 and len(test) == 30
    key = lambda r: json.dumps(r["prompt"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    for r in train + test:
        msgs = r["prompt"]
        assert isinstance(msgs, list) and msgs[-1]["role"] == "user" and isinstance(r["answer"], str)
        a, op, b, _ = msgs[-1]["content"].split()
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    # the committed files are what the seeded script writes
    (tmp_path / "make_data.py").write_text((RECIPE / "make_data.py").read_text())
    subprocess.run([sys.executable, str(tmp_path / "make_data.py")], check=True, timeout=60)
    for name in ("train", "test"):
        assert (tmp_path / "data" / f"{name}.jsonl").read_text() == (RECIPE / "data" / f"{name}.jsonl").read_text()


def test_rewards_take_trl_keywords_and_score_conversational_and_plain_completions() -> None:
    r = _rewards()
    conv = [[{"role": "assistant", "content": c}] for c in ["12", " 12.", "The answer is 12.", "7 + 5 = 12", "13"]]
    answer = ["12"] * 5
    kw = {"prompts": [[{"role": "user", "content": "7 + 5 ="}]] * 5, "completion_ids": [[1]] * 5, "trainer_state": None}
    assert r.correctness(completions=conv, answer=answer, **kw) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert r.number_first(completions=conv, answer=answer, **kw) == [1.0, 1.0, 1.0, 0.0, 0.0]
    br = r.brevity(completions=conv, answer=answer, **kw)
    assert br[0] == 1.0 and br[2] < 0.1 and br[3] == br[4] == 0.0 and all(0.0 <= x <= 1.0 for x in br)
    # an empty reply, no number, the question echoed back: brevity alone must not be a way to score
    bad = [[{"role": "assistant", "content": x}] for x in ["", "ok", "user", "16 - 10"]]
    assert r.brevity(prompts=[""] * 4, completions=bad, answer=["6"] * 4) == [0.0] * 4
    # a plain-text dataset passes strings: the same functions work
    assert r.correctness(completions=["12", "no"], answer=["12", "12"], prompts=["", ""]) == [1.0, 0.0]


def test_only_an_exact_reply_reaches_the_pass_threshold() -> None:
    import tomllib

    r = _rewards()
    hub = tomllib.loads((RECIPE / "hub.toml").read_text())["hub"]
    funcs = [getattr(r, f.split(":")[1]) for f in hub["reward_funcs"]]
    weights = hub["reward_weights"]
    thr = hub["eval_pass_threshold"]

    def total(text: str) -> float:
        c = [[{"role": "assistant", "content": text}]]
        return sum(w * f(prompts=[""], completions=c, answer=["8"])[0] for f, w in zip(funcs, weights, strict=True))

    assert total("8") >= thr and total("8.") >= thr
    for wrong in ["9", "8 is it", "The answer is 8.", "", "3 + 5 = 8"]:
        assert total(wrong) < thr, wrong
