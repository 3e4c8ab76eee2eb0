"""An environment written for the classic verifiers API (verifiers < 0.4): a module-level
``load_environment`` returning a ``vf.SingleTurnEnv``. verifiers 0.4 removed that API."""

from __future__ import annotations

from typing import Any

import verifiers as vf


def load_environment(**kwargs: Any) -> Any:
    def exact(completion: Any, answer: str, **_: Any) -> float:
        return 1.0 if completion[-1]["content"] == answer else 0.0

    rubric = vf.Rubric(funcs=[exact], weights=[1.0])
    dataset = [{"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}]
    return vf.SingleTurnEnv(dataset=dataset, rubric=rubric, **kwargs)
