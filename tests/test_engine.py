from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from echo2.models import spec as ms
from echo2.models.engine import Engine, EngineError, TransformersEngine, select_engine
from echo2.protocol.errors import ManifestError
from echo2.protocol.messages import Completion


def _tiny(seed: int = 0) -> tuple[str, dict[str, bytes], dict[str, torch.Tensor]]:
    cj, arts = ms.artifacts_for(ms.tiny_config(), ms.tokenizer_json())
    torch.manual_seed(seed)
    return cj, arts, ms.model_from_config(cj).state_dict()


@pytest.fixture(scope="module")
def setup() -> tuple[TransformersEngine, str, dict[str, bytes], dict[str, torch.Tensor]]:
    cj, arts, sd = _tiny(0)
    eng = TransformersEngine(device="cpu")
    eng.load_version(3, cj, arts, sd)
    return eng, cj, arts, sd


@pytest.fixture
def engine(setup) -> TransformersEngine:  # type: ignore[no-untyped-def]
    eng, cj, arts, sd = setup
    eng.load_version(3, cj, arts, sd)  # undo what a test may have loaded
    return eng


def _prompts(eng: TransformersEngine) -> list[list[int]]:
    assert eng.tokenizer is not None
    # Different lengths exercise left padding.
    return [eng.tokenizer.encode(t, add_bos=True) for t in ("1+2=", "12+345=", "x", "hello, world: ")]


def _max_dev(eng: TransformersEngine, prompts: list[list[int]], cs: list[Completion], t: float) -> float:
    worst = 0.0
    for c in cs:
        ref = ms.teacher_forced_logprobs(eng.model, prompts[c.prompt_index], c.token_ids, t)
        worst = max(worst, max((abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)), default=0.0))
    return worst


def test_is_an_engine(engine: TransformersEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name == "transformers" and engine.version == 3


def test_shapes_and_limits(engine: TransformersEngine) -> None:
    prompts = _prompts(engine)
    cs = engine.generate(prompts, 3, 9, 1.0, 1.0, 1)
    assert len(cs) == len(prompts) * 3
    assert [c.prompt_index for c in cs] == [i for i in range(len(prompts)) for _ in range(3)]
    for c in cs:
        assert isinstance(c, Completion)
        assert 1 <= len(c.token_ids) <= 9 and len(c.logprobs) == len(c.token_ids)
        assert all(0 <= t < 259 for t in c.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 9 and 2 not in c.token_ids
        else:
            assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
        Completion.from_wire(c.to_wire())  # passes the wire schema
    one = engine.generate([[1, 5]], 1, 1, 1.0, 1.0, 0)
    assert len(one) == 1 and len(one[0].token_ids) == 1


def test_deterministic_per_seed_and_seeds_differ(engine: TransformersEngine) -> None:
    prompts = _prompts(engine)
    a = engine.generate(prompts, 4, 16, 1.0, 1.0, 42)
    b = engine.generate(prompts, 4, 16, 1.0, 1.0, 42)
    c = engine.generate(prompts, 4, 16, 1.0, 1.0, 43)
    assert a == b
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # Samples within a group differ from each other too.
    assert len({tuple(x.token_ids) for x in a[:4]}) > 1


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (0.0, 1.0)])
def test_logprobs_match_teacher_forced(engine: TransformersEngine, temperature: float, top_p: float) -> None:
    prompts = _prompts(engine)
    cs = engine.generate(prompts, 4, 24, temperature, top_p, 9)
    assert _max_dev(engine, prompts, cs, temperature) < 1e-4


def test_greedy_and_tiny_top_p_pick_argmax(engine: TransformersEngine) -> None:
    prompts = _prompts(engine)
    g = engine.generate(prompts, 2, 12, 0.0, 1.0, 1)
    g2 = engine.generate(prompts, 2, 12, 0.0, 1.0, 2)
    assert g == g2  # greedy ignores the seed
    assert g[0].token_ids == g[1].token_ids
    nucleus = engine.generate(prompts, 2, 12, 1.0, 1e-9, 5)
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in g]
    # Reported log-probs stay those of the full T distribution, not the (one-token) nucleus.
    assert any(x < -1e-3 for c in nucleus for x in c.logprobs)


def test_stops_at_eos(engine: TransformersEngine) -> None:
    # A near-uniform random model emits eos (1/259 per token) in some of 64 rows x 64 tokens.
    cs = engine.generate([[1, 40], [1, 41, 42]], 32, 64, 1.5, 1.0, 0)
    stopped = [c for c in cs if c.finish_reason == "stop"]
    assert stopped and len(stopped) < len(cs)
    for c in stopped:
        assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
        assert len(c.token_ids) <= 64
    assert _max_dev(engine, [[1, 40], [1, 41, 42]], stopped, 1.5) < 1e-4


def test_stop_ids_from_generation_config(setup) -> None:  # type: ignore[no-untyped-def]
    _, cj, arts, sd = setup
    eng = TransformersEngine(device="cpu")
    eng.load_version(0, cj, arts, sd)
    first = eng.generate([[1, 50, 51]], 1, 8, 0.0, 1.0, 0)[0]
    assert first.finish_reason == "length"
    extra = dict(arts)
    extra["generation_config.json"] = f'{{"eos_token_id": [2, {first.token_ids[2]}]}}'.encode()
    model = eng.model
    eng.load_version(1, cj, extra, sd)  # same config: weights in place, tokenizer artifacts reread
    assert eng.model is model and eng.version == 1
    c = eng.generate([[1, 50, 51]], 1, 8, 0.0, 1.0, 0)[0]
    stop_at = first.token_ids.index(first.token_ids[2]) + 1
    assert c.finish_reason == "stop" and c.token_ids == first.token_ids[:stop_at]


def test_new_state_dict_changes_outputs_and_version(engine: TransformersEngine) -> None:
    prompts = _prompts(engine)
    before = engine.generate(prompts, 2, 16, 1.0, 1.0, 7)
    model_before = engine.model
    cj = engine.model_config_json
    assert cj is not None
    _, arts, sd2 = _tiny(1)
    engine.load_version(4, cj, arts, sd2)
    assert engine.version == 4 and engine.model is model_before  # loaded in place
    after = engine.generate(prompts, 2, 16, 1.0, 1.0, 7)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert _max_dev(engine, prompts, after, 1.0) < 1e-4


def test_bad_state_dict_refused(engine: TransformersEngine) -> None:
    cj = engine.model_config_json
    assert cj is not None
    _, arts, sd = _tiny(0)
    broken = dict(sd)
    broken.pop(next(iter(broken)))
    with pytest.raises(ManifestError):
        engine.load_version(5, cj, arts, broken)
    wrong = {k: torch.zeros(1) for k in sd}
    with pytest.raises(ManifestError):
        engine.load_version(5, cj, arts, wrong)
    assert engine.version == 3


@pytest.mark.parametrize(
    ("prompts", "g", "n", "t", "p"),
    [
        ([], 1, 4, 1.0, 1.0),
        ([[]], 1, 4, 1.0, 1.0),
        ([[1, 259]], 1, 4, 1.0, 1.0),
        ([[1, -1]], 1, 4, 1.0, 1.0),
        ([[1]], 0, 4, 1.0, 1.0),
        ([[1]], 1, 0, 1.0, 1.0),
        ([[1]], 1, 4, -1.0, 1.0),
        ([[1]], 1, 4, 1.0, 0.0),
        ([[1]], 1, 4, float("nan"), 1.0),
    ],
)
def test_bad_requests_refused(
    engine: TransformersEngine, prompts: list[list[int]], g: int, n: int, t: float, p: float
) -> None:
    with pytest.raises(EngineError):
        engine.generate(prompts, g, n, t, p, 0)


def test_generate_before_load_refused() -> None:
    with pytest.raises(EngineError):
        TransformersEngine(device="cpu").generate([[1]], 1, 1, 1.0, 1.0, 0)


def test_select_engine() -> None:
    assert isinstance(select_engine("transformers"), TransformersEngine)
    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        assert isinstance(select_engine("auto"), TransformersEngine)
    with pytest.raises(ValueError):
        select_engine("nope")


_HAS_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_VLLM, reason="needs a CUDA GPU and vllm")
def test_vllm_engine_matches_teacher_forced_and_updates_in_place() -> None:
    from echo2.models.engine_vllm import VLLMEngine

    cj, arts, sd = _tiny(0)
    eng = VLLMEngine(dtype=torch.float32, gpu_memory_utilization=0.3, enforce_eager=True)
    eng.load_version(1, cj, arts, sd)
    prompts = [[1, 20, 21, 22], [1, 30]]
    a = eng.generate(prompts, 4, 16, 1.0, 1.0, 5)
    assert a == eng.generate(prompts, 4, 16, 1.0, 1.0, 5)
    assert len(a) == 8 and [c.prompt_index for c in a] == [0] * 4 + [1] * 4
    ref = ms.model_from_config(cj)
    ref.load_state_dict(sd)
    for c in a:
        tf = ms.teacher_forced_logprobs(ref, prompts[c.prompt_index], c.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(tf, c.logprobs, strict=True)) < 1e-3
    _, _, sd2 = _tiny(1)
    eng.load_version(2, cj, arts, sd2)
    b = eng.generate(prompts, 4, 16, 1.0, 1.0, 5)
    assert eng.version == 2 and [c.token_ids for c in b] != [c.token_ids for c in a]
    ref.load_state_dict(sd2)
    for c in b:
        tf = ms.teacher_forced_logprobs(ref, prompts[c.prompt_index], c.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(tf, c.logprobs, strict=True)) < 1e-3
