"""``echo2 bench learn``: does a real model get better through the swarm, and how fast?

A live hub and two node processes on 127.0.0.1 (``bench/swarm.py``) run a recipe directory
(default: the shipped ``examples/arith``: SmolLM2-135M-Instruct, single-digit additions,
TRL-style reward functions) for ``--minutes``. The hub evaluates the held-out
split through the swarm every ``eval_every`` steps, step 0 included; this bench reads those
figures from the hub's ``status.json`` (key ``eval``) and reports accuracy and mean reward
before training and after each evaluation, the steps taken, wall time and tokens per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.bench import plotting

#: The recipe shipped in the repository (examples/ sits beside the bench package's source).
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "examples" / "arith"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | PATH of a local HF model directory")
    p.add_argument("--minutes", type=float, default=30.0, help="training time (the swarm runs this long)")
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help=f"directory with hub.toml (default {DEFAULT_RECIPE})")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--eval-every", type=int, default=0, help="override the recipe's eval_every (0 = keep)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train LoRA adapters of rank R (alpha 2R, the hub's default target modules) instead of the recipe's setting")
    p.add_argument("--lr", type=float, default=0.0, help="override the recipe's learning rate (0 = keep; LoRA wants ~1e-4..5e-4)")
    p.add_argument("--dir", type=Path, default=None, help="where the hub and nodes keep their files (default: a temp dir)")
    p.add_argument("--json", type=Path, required=True, metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="eval accuracy and train reward vs wall time")


def recipe_config(recipe: Path, model: str, eval_every: int = 0) -> Any:
    """The recipe's hub.toml with its relative files made absolute (the hub runs elsewhere) and
    the model and run length set by this bench."""
    from echo2.learner_hub.config import load_config

    recipe = recipe.resolve()
    cfg = load_config(recipe / "hub.toml")
    cfg.model = model if model in ("smollm2", "tiny") else str(Path(model).resolve())
    if cfg.dataset.path and not Path(cfg.dataset.path).is_absolute():
        cfg.dataset.path = str(recipe / cfg.dataset.path)
    funcs = []
    for f in cfg.reward_funcs:
        file, sep, name = f.rpartition(":")
        if sep and file.endswith(".py") and not Path(file).is_absolute():
            f = f"{recipe / file}:{name}"
        funcs.append(f)
    cfg.reward_funcs = funcs
    if eval_every:
        cfg.eval_every = eval_every
    cfg.steps = 1_000_000  # the clock ends the run, not a step count
    cfg.exit_when_done = False
    cfg.listen_host = "127.0.0.1"
    cfg.status_port = 0
    return cfg


def plain_text_copy(src: Path, dst: Path) -> Path:
    """The recipe's jsonl splits with each conversational prompt replaced by its last user
    message as plain text: the tiny model's byte tokenizer has no chat template, and the reward
    functions take plain completions as well as message lists."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.jsonl")):
        out = []
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            prompt = row.get("prompt")
            if isinstance(prompt, list):
                row["prompt"] = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
            out.append(json.dumps(row))
        (dst / f.name).write_text("\n".join(out) + "\n", encoding="utf-8")
    return dst


def _eval_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    ev = status.get("eval")
    hist = ev.get("history") if isinstance(ev, dict) else None
    return [h for h in hist if isinstance(h, dict)] if isinstance(hist, list) else []


def build_report(status: dict[str, Any], *, model: str, minutes: float, wall_s: float, nodes: int) -> dict[str, Any]:
    """The JSON report from the hub's last status snapshot (pure: tested without a swarm)."""
    evals = [
        {k: h.get(k) for k in ("step", "wall_s", "accuracy", "mean_reward", "n")}
        for h in _eval_rows(status)
    ]
    train = [
        {"step": h.get("step"), "wall_s": h.get("t"), "reward": h.get("reward")}
        for h in status.get("history", []) if isinstance(h, dict)
    ]
    tokens = sum(int(n.get("tokens", 0) or 0) for n in status.get("nodes", []) if isinstance(n, dict))
    hub_wall = float(status.get("wall_s") or wall_s or 0.0)
    before = evals[0] if evals else None
    after = evals[-1] if len(evals) > 1 else None
    gain = None
    acc0, acc1 = (before or {}).get("accuracy"), (after or {}).get("accuracy")
    if acc0 is not None and acc1 is not None:
        gain = round(float(acc1) - float(acc0), 4)
    return {
        "model": model,
        "minutes": minutes,
        "nodes": nodes,
        "steps": int(status.get("step") or 0),
        "wall_s": round(wall_s, 2),
        "rollout_tokens": tokens,
        "tokens_per_s": round(tokens / hub_wall, 2) if hub_wall > 0 else 0.0,
        "eval_before": before,
        "eval_after": after,
        "accuracy_gain": gain,
        "evals": evals,
        "train": train,
    }


def summary_lines(rep: dict[str, Any]) -> list[str]:
    lines = [f"{rep['model']}: {rep['steps']} steps in {rep['wall_s']:.0f} s, {rep['tokens_per_s']:.1f} rollout tokens/s"]
    for e in rep["evals"]:
        acc, mr = e.get("accuracy"), e.get("mean_reward")
        lines.append(f"  eval at step {e.get('step')}: accuracy {acc if acc is None else round(acc, 3)}, "
                     f"mean reward {mr if mr is None else round(mr, 3)} (n={e.get('n')})")
    if rep["accuracy_gain"] is not None:
        lines.append(f"  accuracy gain: {rep['accuracy_gain']:+.3f}")
    elif not rep["evals"]:
        lines.append("  no evaluation in status.json (eval_every = 0, or the hub never reached one)")
    return lines


def run(args: argparse.Namespace) -> int:
    from echo2.bench.swarm import LocalSwarm

    if args.plot:
        plotting.require()
    if args.model == "smollm2":
        from echo2.models import gguf

        try:  # converted here, once, so the hub's start-up timeout does not pay for it
            gguf.resolve_model("smollm2")
        except gguf.GGUFError as e:
            raise SystemExit(str(e)) from e
    cfg = recipe_config(args.recipe, args.model, args.eval_every)
    if args.lora > 0:
        from echo2.learner_hub.config import LoraSpec

        cfg.lora = LoraSpec(r=args.lora, alpha=2 * args.lora)
    if args.lr > 0:
        cfg.lr = args.lr
    root = args.dir or Path(tempfile.mkdtemp(prefix="echo2-learn-"))
    if args.model == "tiny" and cfg.dataset.path and Path(cfg.dataset.path).is_dir():
        cfg.dataset.path = str(plain_text_copy(Path(cfg.dataset.path), root / "data-plain"))
    print(f"bench learn: {args.model}, recipe {args.recipe}, {args.nodes} nodes, {args.minutes:g} min, files in {root}",
          flush=True)
    seen = 0

    def progress(st: dict[str, Any]) -> None:
        nonlocal seen
        rows = _eval_rows(st)
        for h in rows[seen:]:
            print(f"  eval step {h.get('step')} at {h.get('wall_s')} s: accuracy {h.get('accuracy')}, "
                  f"mean reward {h.get('mean_reward')}", flush=True)
        seen = len(rows)

    t0 = time.monotonic()
    with LocalSwarm(root, cfg, args.nodes, threads=args.threads) as swarm:
        swarm.start_hub(timeout_s=600.0)
        for i in range(args.nodes):
            swarm.start_node(i)
        st = swarm.wait(args.minutes * 60.0, on_status=progress) or {}
    wall = time.monotonic() - t0
    st = swarm.status() or st  # the hub's last snapshot, written as it stopped
    rep = build_report(st, model=args.model, minutes=args.minutes, wall_s=wall, nodes=args.nodes)
    rep |= {"lr": cfg.lr, "lora": dataclasses.asdict(cfg.lora) if cfg.lora.enabled else None}
    for line in summary_lines(rep):
        print(line)
    args.json.write_text(json.dumps(rep, indent=1))
    print(f"report: {args.json}")
    if args.plot:
        plotting.learn_figure(rep, args.plot)
        print(f"plot: {args.plot}")
    return 0
