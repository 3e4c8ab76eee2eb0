"""``echo2 hub init | run``."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="hub_cmd", metavar="{init,run}")
    sub.required = True
    init = sub.add_parser("init", help="write a commented config and the hub's key", description="write a commented config and the hub's key")
    init.add_argument("--dir", type=Path, required=True, help="hub directory")
    init.add_argument("--task", default="copy", choices=["copy", "reverse", "arith", "jsonl"])
    init.add_argument("--model", default="tiny", help='"tiny" or a local Hugging Face model directory')
    init.add_argument("--force", action="store_true", help="overwrite an existing config")
    init.set_defaults(func=_init)
    run = sub.add_parser("run", help="run the hub", description="run the hub: learner, dispatcher, publisher")
    run.add_argument("--config", type=Path, required=True, help="hub.toml written by `echo2 hub init`")
    run.add_argument("--steps", type=int, default=None, help="override the config's step count")
    run.add_argument("--exit-when-done", action="store_true", help="stop after the last step")
    run.set_defaults(func=_run)


def _init(args: argparse.Namespace) -> int:
    from echo2.learner_hub.config import HubConfig, render_config
    from echo2.protocol.identity import Identity

    d: Path = args.dir
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "hub.toml"
    if cfg_path.exists() and not args.force:
        print(f"{cfg_path} exists (use --force to overwrite)")
        return 1
    cfg = HubConfig(dir=".", task=args.task, model=args.model)
    cfg.validate()
    cfg_path.write_text(render_config(cfg))
    ident = Identity.load_or_create(d / "hub.key")
    print(f"wrote {cfg_path}\nhub peer ID {ident.peer_id} (key in {d / 'hub.key'}, mode 0600)")
    print(f"start it with: echo2 hub run --config {cfg_path}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from echo2.learner_hub.config import load_config
    from echo2.learner_hub.hub import run_hub

    cfg = load_config(args.config)
    if args.steps is not None:
        cfg.steps = args.steps
    if args.exit_when_done:
        cfg.exit_when_done = True
    return run_hub(cfg)
