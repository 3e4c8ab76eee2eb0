"""The model card (README.md) of an exported policy: what was trained, on what, scored how, and
how it evaluated, from hub.toml and the hub's store (export.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import HubConfig


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _data_lines(cfg: HubConfig) -> list[str]:
    if cfg.environment:
        return [f"- verifiers environment `{cfg.environment}` (arguments {cfg.environment_args or '{}'})"]
    ds = cfg.dataset
    if cfg.task == "jsonl" or ds.path:
        lines = [f"- dataset `{ds.path}`, split `{ds.split}`, prompt column `{ds.prompt_column}`"]
        if ds.eval_split:
            lines.append(f"- held-out split `{ds.eval_split}` (first {cfg.eval_max_prompts} prompts per evaluation)")
        if ds.system_prompt:
            lines.append(f"- system prompt: {ds.system_prompt!r}")
        return lines
    return [f"- echo2's built-in `{cfg.task}` task (prompts generated from seed {cfg.seed}; held-out prompts on a seed apart)"]


def _reward_lines(cfg: HubConfig) -> list[str]:
    funcs = list(cfg.reward_funcs)
    if not funcs and not cfg.environment and not cfg.dataset.path:
        from .rewards_builtin import builtin_reward_spec

        funcs = [builtin_reward_spec(cfg.task)]
    if cfg.environment:
        return ["- the verifiers environment's rubric"]
    weights = list(cfg.reward_weights) or [1.0] * len(funcs)
    rows = ["| reward function | weight |", "|---|---|"]
    rows += [f"| `{f}` | {_fmt(float(w))} |" for f, w in zip(funcs, weights + [1.0] * (len(funcs) - len(weights)), strict=False)]
    return rows


def _some(evals: list[dict[str, Any]], step: int, most: int = 24) -> list[dict[str, Any]]:
    """At most ``most`` rows of a long run's evaluations: evenly spread, with the first, the last,
    the best and the exported one always in."""
    if len(evals) <= most:
        return evals
    keep = {0, len(evals) - 1}
    keep |= {i for i, e in enumerate(evals) if int(e["step"]) == step}
    scored = [i for i, e in enumerate(evals) if e.get("accuracy") is not None]
    if scored:
        keep.add(max(scored, key=lambda i: (evals[i]["accuracy"], evals[i].get("mean_reward") or 0.0)))
    stride = len(evals) / (most - len(keep))
    keep |= {int(k * stride) for k in range(most - len(keep))}
    return [evals[i] for i in sorted(keep)]


def model_card(
    cfg: HubConfig, toml_text: str, step: int, dtype: str, why: str, store: dict[str, Any], lora: bool, merged: bool,
    src: Path | None,
) -> str:
    base = "the built-in tiny model (initialised in code from seed " + str(cfg.seed) + ")" if src is None else f"`{src}`"
    kind = "LoRA adapter" + (" and the merged model" if merged else "") if lora else "full fine-tune"
    library = "transformers" if (merged or not lora) else "peft"
    out = [
        "---",
        f"library_name: {library}",
        "pipeline_tag: text-generation",
        "tags: [echo2, grpo, reinforcement-learning]",
        "---",
        "",
        f"# GRPO policy, version {step}, trained with echo2",
        "",
        f"Policy version {step} of an echo2 run (GRPO on a peer-to-peer swarm of rollout nodes): {why}. "
        f"Base model {base}; {kind}; weights in {dtype}"
        + (" (the run's publish_dtype: the policy nodes sampled and evaluations measured)." if dtype == cfg.publish_dtype
           else " (the learner's master weights)." if dtype == "float32" else "."),
        "",
    ]
    if lora:
        lo = cfg.lora
        out += [f"LoRA r={lo.r}, alpha={lo.alpha}, target modules {lo.target_modules}, dropout {lo.dropout}. "
                + ("The merged model is at the top of this folder and the adapter (peft's format) in `adapter/`."
                   if merged else "The adapter is in peft's format; `base_model_name_or_path` names its base."), ""]
    out += [
        "## Training",
        "",
        f"- GRPO, loss `{cfg.loss_type}`, lr {cfg.lr:g}, clip epsilon {cfg.epsilon:g}"
        + (f"/{cfg.epsilon_high:g}" if cfg.epsilon_high else "") + f", KL coefficient {cfg.kl_coef:g}",
        *(["- every prompt of the built-in task started with the tokenizer's bos token (`tokenizer.bos_token`)"]
          if src is None and not cfg.environment and (cfg.task == "jsonl" or not cfg.dataset.path) else []),
        f"- {cfg.prompts_per_step} prompts x {cfg.group_size} completions per step, up to {cfg.max_new_tokens} new tokens, "
        f"temperature {cfg.temperature:g}, staleness bound {cfg.staleness}",
        f"- steps planned {cfg.steps}; this is step {step}",
        "",
        "## Data",
        "",
        *_data_lines(cfg),
        "",
        "## Reward functions",
        "",
        *_reward_lines(cfg),
        "",
    ]
    evals = store.get("evaluations") or []
    out += ["## Evaluation", ""]
    if evals:
        out += [f"Held-out prompts through the swarm, temperature {cfg.eval_temperature:g}; a completion counts as correct "
                f"when its reward reaches {cfg.eval_pass_threshold:g}.", "",
                "| step | accuracy | mean reward | completions | |", "|---|---|---|---|---|"]
        for e in _some(evals, step):
            mark = "**exported**" if int(e["step"]) == step else ""
            out.append(f"| {e['step']} | {_fmt(e.get('accuracy'))} | {_fmt(e.get('mean_reward'))} | {e.get('n')} | {mark} |")
    else:
        out.append("No evaluation was recorded (eval_every = 0).")
    use = "AutoModelForCausalLM" if (merged or not lora) else "AutoPeftModelForCausalLM"
    mod = "transformers" if use == "AutoModelForCausalLM" else "peft"
    out += [
        "",
        "## Use",
        "",
        "```python",
        f"from {mod} import {use}",
        "from transformers import AutoTokenizer",
        "",
        f'model = {use}.from_pretrained("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
        "## Configuration (hub.toml)",
        "",
        "```toml",
        toml_text.rstrip(),
        "```",
        "",
    ]
    return "\n".join(out)


__all__ = ["model_card"]
