"""The ``echo2`` command: ``node``, ``hub``, ``bench`` and ``demo``.

Each subpackage registers its own subcommands; heavy imports (torch, libp2p) happen only when a
command runs, so ``echo2 --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from echo2 import __version__
from echo2.logconfig import configure

# subcommand -> module exposing register(parser) (which sets parser defaults func=...)
_GROUPS: dict[str, tuple[str, str]] = {
    "node": ("echo2.node.cli", "run a volunteer rollout node"),
    "hub": ("echo2.learner_hub.cli", "run and manage a learner hub"),
    "bench": ("echo2.bench.cli", "benchmarks with JSON output"),
    "demo": ("echo2.bench.demo", "run an embedded local swarm (hub + nodes) that learns a toy task"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="echo2",
        description="echo2: a peer-to-peer rollout fleet for RL post-training.",
    )
    parser.add_argument("--version", action="version", version=f"echo2 {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO or $ECHO2_LOG)")
    sub = parser.add_subparsers(dest="command", metavar="{node,hub,bench,demo}")
    sub.required = True
    for name, (module, help_text) in _GROUPS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).register(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure(args.log_level, json_mode=False)
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
