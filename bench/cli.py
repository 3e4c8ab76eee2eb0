"""``echo2 bench ...``: each benchmark lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; heavy imports stay inside ``run``."""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "pack": ("echo2.bench.pack", "policy packing: delta compression ratio and encode/decode speed"),
    "transport": ("echo2.bench.transport", "raw TCP vs py-libp2p stream vs echo2 data plane"),
    "broadcast": ("echo2.bench.broadcast", "policy broadcast: star vs pipelined relay (real processes or --simulate)"),
    "node": ("echo2.bench.node", "node throughput: raw engine vs the full signed task path"),
    "e2e": ("echo2.bench.e2e", "the whole loop per staleness bound: busy fraction (measured vs predicted), wall time, reward"),
    "fuzz": ("echo2.bench.fuzz", "hostile peers against a real swarm: survival, memory, progress, refusals"),
    "attack": ("echo2.bench.attack", "issue 15's attacks A1-A12 against a live swarm: honest rate, memory, survival, effect blocked?"),
    "activation": ("echo2.bench.activation", "cost-aware activation: exact vs echo2 vs all vs cheapest-first"),
    "learn": ("echo2.bench.learn", "a real model through a live swarm on a recipe: held-out accuracy before and after, tokens/s"),
    "learner": ("echo2.bench.learner", "the GRPO learner as 1 process and N FSDP2 ranks: step time, tokens/s, memory per rank, equality, publication"),
    "intake": ("echo2.bench.intake", "hub CPU per result, heartbeat and holds, and status writing, as the fleet grows (issue 20)"),
    "crash": ("echo2.bench.crash", "SIGKILL the hub at random moments: acknowledged results and ledger entries vs found after restart"),
}


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHES) + "}")
    sub.required = True
    for name, (module, help_text) in BENCHES.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
