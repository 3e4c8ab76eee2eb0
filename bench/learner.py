"""``echo2 bench learner``: the GRPO learner as one process and as N FSDP2 ranks (issue 17).

Per configuration, on the same synthetic batches (random prompts and completions of the model's
vocabulary, behaviour log-probs the initial model's own, rewards drawn per row): step time (the
median over ``--steps``), training tokens per second (completion tokens, the ones the loss sees,
over the median step), parameter, gradient and optimizer bytes per rank (measured: the bytes of
each rank's local shards; gradients at their peak, before clipping), and publication time and
bytes of one version in the publish dtype. For N > 1 the equality check against one process:
the first step's loss and every fp32 weight after it (max |Δ| / max |w| per tensor).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--procs", default="1,2", help="comma-separated rank counts (1 = the one-process learner)")
    p.add_argument("--model", default="tiny", help='"tiny", "smollm2" or a local Hugging Face model directory')
    p.add_argument("--tiny-hidden", type=int, default=128)
    p.add_argument("--tiny-layers", type=int, default=2)
    p.add_argument("--lora", action="store_true", help="a LoRA policy: adapters only train (one process: procs > 1 "
                   "refuses LoRA, as the hub does)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r, the hub's default target modules)")
    p.add_argument("--steps", type=int, default=3, help="learner steps per configuration")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="FSDP2 bf16 parameters (procs > 1)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help='"auto" (a CUDA GPU when there is one), "cpu" or "cuda": where the '
                   "one-process learner trains; N ranks take a GPU each (as hub.toml's learner_device)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")


def _batches(model: Any, vocab: int, pad_id: int, args: argparse.Namespace) -> list[Any]:
    import torch

    from echo2.learner_hub.learner import Group, Sample
    from echo2.models import spec as modelspec

    rng = random.Random(args.seed)
    out = []
    for _ in range(args.steps):
        groups = []
        for _ in range(args.prompts):
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            comps = [[rng.randrange(3, vocab) for _ in range(args.completion_tokens)] for _ in range(args.group)]
            with torch.no_grad():
                lp, _ = modelspec.teacher_forced_batch(model, [(prompt, c) for c in comps], pad_id=pad_id, temperature=1.0)
            samples = [Sample(c, [float(x) for x in lp[i].tolist()], float(rng.random() < 0.4), 0, node_id="bench")
                       for i, c in enumerate(comps)]
            groups.append(Group(prompt_ids=prompt, samples=samples))
        out.append(groups)
    return out


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def run(args: argparse.Namespace) -> int:
    import torch

    from echo2.learner_hub.distributed import ShardedLearner, local_bytes, optimizer_bytes
    from echo2.learner_hub.learner import Learner
    from echo2.learner_hub.training import resolve_device
    from echo2.models import spec as modelspec
    from echo2.models.lora import ADAPTER_PREFIX
    from echo2.models.policy import load_policy

    procs = [int(x) for x in args.procs.split(",") if x.strip()]
    from echo2.learner_hub.config import ConfigError

    try:
        device = resolve_device(args.device)
    except ConfigError as e:
        print(e)
        return 2
    if args.lora and procs != [1]:
        # the hub refuses lora with learner_procs > 1 (config.check_lora): nothing to measure there
        print(f"--lora: a sharded LoRA learner is not supported yet; measuring procs 1 only (asked: {args.procs})")
        procs = [1]
    torch.manual_seed(args.seed)
    model, mc, arts = load_policy(args.model, args.tiny_hidden, args.tiny_layers)
    model = model.float().eval()
    tok = modelspec.load_tokenizer(arts)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    batches = _batches(model, min(vocab, int(tok.vocab_size)), tok.pad_id, args)
    if args.activation_checkpointing:
        from echo2.learner_hub.distributed import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    kw: dict[str, Any] = {"lr": 1e-5 if args.model != "tiny" else 3e-4, "micro_batch_tokens": args.micro_batch_tokens,
                          "publish_dtype": torch.bfloat16}
    n_params = sum(p.numel() for p in model.parameters())
    report: dict[str, Any] = {"model": args.model, "parameters": n_params, "steps": args.steps, "device": device,
                              "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                              "rows_per_step": args.prompts * args.group, "configs": []}
    if args.lora:
        from echo2.learner_hub.config import LoraSpec
        from echo2.models import lora

        spec = LoraSpec(r=args.lora_r, alpha=2 * args.lora_r)
        # as the hub's build_learner: peft injects the adapters, the learner runs the inner model
        model = lora.wrap(model, r=spec.r, alpha=spec.alpha, target_modules=spec.target_modules).get_base_model()
        kw["lr"] = 5e-4  # adapters want a larger step than a full fine-tune (the README's LoRA runs)
        report["lora"] = {"r": spec.r, "alpha": spec.alpha, "target_modules": spec.target_modules,
                          "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    base: dict[str, Any] | None = None  # one process: first step's loss and weights, memory

    class Measured(Learner):
        grad_bytes = 0

        def _clip_grads(self) -> float:
            self.grad_bytes = max(self.grad_bytes, local_bytes([p.grad for p in self.model.parameters() if p.grad is not None]))
            return super()._clip_grads()

    one_ref: dict[str, Any] | None = None
    for n in procs:
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t_start = time.perf_counter()
        learner: Any
        if n == 1:
            learner = Measured(copy.deepcopy(model), tok, device=device, **kw)
        else:
            learner = ShardedLearner(copy.deepcopy(model), tok, mc, procs=n, mixed_precision=args.mixed_precision,
                                     activation_checkpointing=False, device=device.split(":")[0], **kw)
        t_ready = time.perf_counter() - t_start
        try:
            times, losses, norms, tokens = [], [], [], 0
            first_weights: dict[str, Any] = {}
            for i, groups in enumerate(batches):
                t0 = time.perf_counter()
                st = learner.step(groups)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()  # the step's kernels, not their launch, are what it costs
                times.append(time.perf_counter() - t0)
                losses.append(st.loss)
                norms.append(st.grad_norm)
                tokens = st.tokens
                if i == 0:
                    first_weights = learner.checkpoint_state()["model"]
            last_weights = learner.checkpoint_state()["model"]
            t0 = time.perf_counter()
            pub = learner.state_dict_for_publish()
            pub_s = time.perf_counter() - t0
            pub_bytes = sum(t.numel() * t.element_size() for t in pub.values())
            # what a delta version really carries: for LoRA the adapter tensors (the base's chunks
            # are byte-identical in every version: zero-XOR frames, never fetched twice)
            changing = sum(t.numel() * t.element_size() for k, t in pub.items() if k.startswith(ADAPTER_PREFIX))
            if n == 1:
                mem = [{"params": local_bytes(list(learner.model.parameters())), "grads": learner.grad_bytes,
                        "optimizer": optimizer_bytes(learner.optimizer)}]
            else:
                mem = learner.memory()
        finally:
            if n > 1:
                learner.close()
        if n == 1 and one_ref is None:
            one_ref = {"losses": losses, "norms": norms, "first": first_weights, "last": last_weights}
        step_s = statistics.median(times)
        cfg: dict[str, Any] = {
            "procs": n, "start_s": round(t_ready, 2), "step_s": round(step_s, 4), "step_times_s": [round(t, 4) for t in times],
            "completion_tokens_per_step": tokens, "tokens_per_s": round(tokens / step_s, 1), "loss_first": losses[0],
            "memory_per_rank": mem,
            "params_optimizer_bytes_max_rank": max(m["params"] + m["optimizer"] for m in mem),
            "params_grads_optimizer_bytes_max_rank": max(m["params"] + m["grads"] + m["optimizer"] for m in mem),
            "publish_s": round(pub_s, 4), "publish_bytes": pub_bytes,
        }
        if device.startswith("cuda") and n == 1:
            cfg["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        if args.lora:
            cfg["adapter_bytes"] = changing
            cfg["adapter_vs_publish"] = round(changing / max(pub_bytes, 1), 5)
        if n > 1 and one_ref is not None:
            # The check is the issue's: one identical batch (the first step). AdamW's first update
            # is lr * sign(g) wherever |g| >> eps, so the weights agree even for slightly
            # different gradients: the gradient norm is the sharper check of the gradient sum.
            # Later steps are reported only: a GRPO loss is a small difference of large terms and
            # attention's key bias (zero at init, its gradient float noise) moves by lr whatever
            # the sign of that noise, so relative figures there measure noise, not the sum.
            loss_rel = abs(losses[0] - one_ref["losses"][0]) / max(abs(one_ref["losses"][0]), 1e-30)
            gn_rel = abs(norms[0] - one_ref["norms"][0]) / max(abs(one_ref["norms"][0]), 1e-30)
            w_rel = max(_rel(first_weights[k], one_ref["first"][k]) for k in one_ref["first"])
            later = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[1:], one_ref["losses"][1:], strict=True)]
            w_last = max(float((last_weights[k].double() - v.double()).norm() / v.double().norm().clamp(min=1e-30))
                         for k, v in one_ref["last"].items())
            cfg["equality"] = {"loss_rel": loss_rel, "grad_norm_rel": gn_rel, "weights_max_rel": w_rel,
                               "ok": bool(max(loss_rel, gn_rel, w_rel) <= 1e-5 and args.mixed_precision == "no"),
                               "later_steps_loss_rel_max": max(later, default=0.0), "last_step_weights_norm_rel_max": w_last}
        if base is None and n == 1:
            base = cfg
        if base is not None and n > 1:
            cfg["params_optimizer_ratio_vs_1"] = round(
                cfg["params_optimizer_bytes_max_rank"] / base["params_optimizer_bytes_max_rank"], 4)
        report["configs"].append(cfg)
        eq = cfg.get("equality")
        print(
            f"procs {n}: step {step_s:.3f} s, {cfg['tokens_per_s']:.0f} tokens/s, "
            f"params+optimizer {cfg['params_optimizer_bytes_max_rank'] / 1e6:.2f} MB/rank "
            f"(+grads {cfg['params_grads_optimizer_bytes_max_rank'] / 1e6:.2f} MB)"
            + (f", x{cfg['params_optimizer_ratio_vs_1']} of 1 process" if "params_optimizer_ratio_vs_1" in cfg else "")
            + f", publish {pub_s * 1000:.0f} ms / {pub_bytes / 1e6:.2f} MB"
            + (f" (adapter {cfg['adapter_bytes'] / 1e6:.2f} MB, x{cfg['adapter_vs_publish']})" if args.lora else "")
            + (f"; vs 1 process, step 1: loss rel {eq['loss_rel']:.1e}, grad norm rel {eq['grad_norm_rel']:.1e}, "
               f"weights max rel {eq['weights_max_rel']:.1e} "
               f"({'OK' if eq['ok'] else 'DIFFERENT'})" if eq else "")
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    bad = [c for c in report["configs"] if c.get("equality") and not c["equality"]["ok"] and args.mixed_precision == "no"]
    return 1 if bad else 0
