"""Writes data/train.jsonl and data/test.jsonl (HF datasets reads them as splits "train" and "test"): single-digit additions, seeded, disjoint.

Run once (``python make_data.py``); the files are committed, so a recipe run never depends on it.
Each row is conversational (TRL's ``prompt`` column as a list of messages) with an ``answer``
column that the reward functions receive as a keyword argument.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM = "Reply with only the number."
# One worked exchange before the question (a sum of the training split, so no held-out answer is
# shown). Measured on SmolLM2-135M-Instruct at the recipe's temperature 0.8: with the system prompt
# alone, 0 of 192 sampled replies were the bare right number ("The answer is 11.", "6 + 5 = 11"),
# so GRPO's groups almost never held a correct-format sample to learn from (two 30-minute swarm
# runs stayed at accuracy 0.00); with this exchange, 10 of 96 were. Greedy held-out accuracy
# before training: 0/30 without it, 1/30 with it.
SHOT = ("1 + 3 =", "4")
SEED = 16
N_EVAL = 30  # of the 81 sums of two digits 1-9; the other 51 are the training split


def questions() -> list[tuple[str, int]]:
    # Two-digit operands were tried first: SmolLM2-135M learnt the bare-number format but then
    # answered with the first operand (held-out accuracy 0.00 -> 0.10 in 20 min); single digits
    # are sums it knows once it stops talking.
    return [(f"{a} + {b} =", a + b) for a in range(1, 10) for b in range(1, 10)]


def row(question: str, answer: int) -> dict[str, object]:
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": SHOT[0]},
            {"role": "assistant", "content": SHOT[1]},
            {"role": "user", "content": question},
        ],
        "answer": str(answer),
    }


def main() -> None:
    qs = questions()
    random.Random(SEED).shuffle(qs)
    out = Path(__file__).with_name("data")
    out.mkdir(exist_ok=True)
    for name, part in (("test", qs[:N_EVAL]), ("train", qs[N_EVAL:])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for q, a in part:
                f.write(json.dumps(row(q, a)) + "\n")


if __name__ == "__main__":
    main()
