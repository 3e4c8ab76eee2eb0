"""The ``echo2`` command: ``node``, ``hub``, ``model``, ``bench`` and ``demo``.

Each subpackage registers its own subcommands, and only the group named on the command line is
imported: ``echo2 node run`` and ``echo2 hub run`` never load the benches (nor matplotlib), and
heavy imports (torch, libp2p) happen only when a command runs, so ``echo2 --help`` stays instant.
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
    "model": ("echo2.models.cli", "prepare local model directories (import-gguf)"),
    "bench": ("echo2.bench.cli", "benchmarks with JSON output"),
    "demo": ("echo2.bench.demo", "run an embedded local swarm (hub + nodes) that learns a toy task"),
}


def _chosen_group(argv: Sequence[str]) -> str | None:
    """The subcommand group named in ``argv`` (skipping the top-level options), if any."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg if arg in _GROUPS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the group it names registers its subcommands (the others
    are listed by name and help only). Without ``argv``, every group registers."""
    chosen = _chosen_group(argv) if argv is not None else None
    parser = argparse.ArgumentParser(
        prog="echo2",
        description="echo2: a peer-to-peer rollout fleet for RL post-training.",
    )
    parser.add_argument("--version", action="version", version=f"echo2 {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO or $ECHO2_LOG)")
    sub = parser.add_subparsers(dest="command", metavar="{node,hub,model,bench,demo}")
    sub.required = True
    for name, (module, help_text) in _GROUPS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == chosen:
            importlib.import_module(module).register(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure(args.log_level, json_mode=False)
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args([*argv, "--help"])
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
