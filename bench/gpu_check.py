"""``python -m echo2.bench.gpu_check``: exercise the vLLM engine for real on a GPU machine.

Loads a policy into :class:`echo2.models.engine_vllm.VLLMEngine`, samples with per-token
log-probs, checks them against a teacher-forced recompute in transformers, then loads a new
version in place (no engine restart) and checks that the outputs follow the new weights. Prints a
JSON report; exits 2 (with the reason) where there is no CUDA GPU or no vLLM, 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo2.bench.gpu_check", description=__doc__)
    ap.add_argument("--model", default="tiny", help='"tiny" or a local Hugging Face model directory')
    ap.add_argument("--tolerance", type=float, default=0.05, help="max |Δ logprob| vs transformers (bf16 engine)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the vLLM check needs one", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print('vLLM is not installed: pip install "echo2[vllm]"', file=sys.stderr)
        return 2

    from echo2.models import spec as modelspec
    from echo2.models.engine_vllm import VLLMEngine

    torch.manual_seed(0)
    if args.model == "tiny":
        conf = modelspec.tiny_config(hidden=256, layers=4)
        model_config, artifacts = modelspec.artifacts_for(conf, modelspec.tokenizer_json())
        model = modelspec.model_from_config(model_config)
    else:
        model, model_config, artifacts = modelspec.load_local_model(args.model)
    tok = modelspec.load_tokenizer(artifacts)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    report: dict[str, object] = {"model": args.model, "gpu": torch.cuda.get_device_name(0)}

    eng = VLLMEngine()
    t0 = time.perf_counter()
    eng.load_version(0, model_config, artifacts, sd)
    report["load_s"] = round(time.perf_counter() - t0, 2)
    prompts = [tok.encode(t, add_bos=True) for t in ("12=", "345=", "The answer is")]
    t0 = time.perf_counter()
    comps = eng.generate(prompts, 8, 32, 1.0, 1.0, 1234)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in comps)
    report["tokens_per_s"] = round(tokens / dt, 1)

    ref = model.to(torch.bfloat16).float().eval()
    worst = 0.0
    for c in comps[:8]:
        lp = modelspec.teacher_forced_logprobs(ref, prompts[c.prompt_index], list(c.token_ids), 1.0)
        worst = max(worst, max((abs(a - b) for a, b in zip(lp, c.logprobs, strict=True)), default=0.0))
    report["max_logprob_diff"] = worst

    # a new version, loaded in place: greedy outputs must follow the new weights
    before = [list(c.token_ids) for c in eng.generate(prompts, 1, 16, 0.0, 1.0, 1)]
    sd2 = {k: (v + 0.05 * torch.randn_like(v.float()).to(v.dtype)) if v.is_floating_point() else v for k, v in sd.items()}
    t0 = time.perf_counter()
    eng.load_version(1, model_config, artifacts, sd2)
    report["update_s"] = round(time.perf_counter() - t0, 3)
    after = [list(c.token_ids) for c in eng.generate(prompts, 1, 16, 0.0, 1.0, 1)]
    report["outputs_changed_after_update"] = before != after
    report["engine_version_after_update"] = eng.version
    ok = worst <= args.tolerance and before != after and eng.version == 1
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
