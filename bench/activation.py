"""``echo2 bench activation``: cost-aware activation on a synthetic heterogeneous fleet.

Fleet model. Each node is drawn from the GPU classes below (weights = share of the fleet), then
jittered per node: rate x lognormal(0, 0.15) (driver, clocks, host CPU, network), price x
uniform(0.75, 1.35) (host-set marketplace prices), rounded to $0.001/h as marketplaces quote.

Rates are rollouts/s for a ~1.5B-parameter policy generating ~512-token completions with a batched
engine (vLLM), i.e. aggregate decode throughput / 512. Prices are *plausible 2025-2026 marketplace
prices* (community GPU rental sites and on-demand clouds), not quotes from a specific provider.

=========  ======  ===========  =========
class      share   rollouts/s   $/hour
=========  ======  ===========  =========
RTX 3060   0.20     4.0         0.07
RTX 3090   0.20    10.0         0.20
RTX 4090   0.20    16.0         0.35
A10        0.10     9.0         0.45
L4         0.10     7.0         0.40
A100 80G   0.10    24.0         1.10
H100 80G   0.10    40.0         2.00
=========  ======  ===========  =========

Compared: the exact solver (``method="exact"``: proven optimum, or the best set and a proven lower
bound when prices are off-grid), echo2's production choice (``method="auto"``), activating all
nodes, and "cheapest first" (by price until the rate is met). ``gap`` = echo2_cost / exact_cost - 1
(against the proven lower bound if the exact stage could not close the gap; see ``exact_proven``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

GPU_CLASSES: list[tuple[str, float, float, float]] = [
    # name, share, rollouts/s, $/h
    ("RTX 3060", 0.20, 4.0, 0.07),
    ("RTX 3090", 0.20, 10.0, 0.20),
    ("RTX 4090", 0.20, 16.0, 0.35),
    ("A10", 0.10, 9.0, 0.45),
    ("L4", 0.10, 7.0, 0.40),
    ("A100 80G", 0.10, 24.0, 1.10),
    ("H100 80G", 0.10, 40.0, 2.00),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1000, help="fleet size (default 1000)")
    parser.add_argument("--seed", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one or more seeds")
    parser.add_argument("--fraction", type=float, default=0.30, help="required rate / fleet total")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats of echo2's solve (min)")
    parser.add_argument("--json", default=None, help="write results to this file")


def make_fleet(n: int, seed: int) -> list[Any]:
    import numpy as np

    from echo2.learner_hub.activation import NodeOffer

    rng = np.random.default_rng(seed)
    shares = np.array([c[1] for c in GPU_CLASSES])
    cls = rng.choice(len(GPU_CLASSES), size=n, p=shares / shares.sum())
    out = []
    for i, c in enumerate(cls.tolist()):
        _, _, rate, price = GPU_CLASSES[c]
        r = float(rate * rng.lognormal(0.0, 0.15))
        p = max(0.01, round(float(price * rng.uniform(0.75, 1.35)), 3))
        out.append(NodeOffer(f"node{i:05d}", p, r))
    return out


def cheapest_first(nodes: list[Any], required: float) -> float:
    cost = rate = 0.0
    for nd in sorted(nodes, key=lambda x: (x.price, -x.rate)):
        if rate >= required:
            break
        cost += nd.price
        rate += nd.rate
    return cost


def run_seed(n: int, seed: int, fraction: float, repeat: int) -> dict[str, Any]:
    from echo2.learner_hub.activation import solve

    fleet = make_fleet(n, seed)
    total = sum(x.rate for x in fleet)
    required = fraction * total
    t0 = time.perf_counter()
    ex = solve(fleet, required, "exact")
    exact_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        ech = solve(fleet, required, "auto")
        times.append((time.perf_counter() - t0) * 1e3)
    ref = ex.cost if ex.exact else float(ex.lower_bound or ex.cost)
    return {
        "seed": seed,
        "nodes": n,
        "required_rate": required,
        "fleet_rate": total,
        "exact_cost": ex.cost,
        "exact_proven": ex.exact,
        "lower_bound": ex.lower_bound,
        "exact_ms": exact_ms,
        "echo2_cost": ech.cost,
        "echo2_method": ech.method,
        "echo2_selected": len(ech.selected),
        "gap": ech.cost / ref - 1.0,
        "echo2_ms": min(times),
        "all_cost": sum(x.price for x in fleet),
        "cheapest_first_cost": cheapest_first(fleet, required),
    }


def run(args: argparse.Namespace) -> int:
    rows = [run_seed(args.nodes, s, args.fraction, args.repeat) for s in args.seed]
    print(
        f"{'seed':>4} {'R*':>8} {'exact $/h':>10} {'proven':>6} {'echo2 $/h':>10} {'gap':>8} "
        f"{'echo2 ms':>9} {'exact ms':>9} {'all $/h':>9} {'cheap1st':>9}"
    )
    for r in rows:
        print(
            f"{r['seed']:>4} {r['required_rate']:>8.1f} {r['exact_cost']:>10.3f} {str(r['exact_proven']):>6} "
            f"{r['echo2_cost']:>10.3f} {r['gap']:>8.2%} {r['echo2_ms']:>9.2f} {r['exact_ms']:>9.1f} "
            f"{r['all_cost']:>9.2f} {r['cheapest_first_cost']:>9.2f}"
        )
    med: dict[str, Any] = {"nodes": args.nodes, "seeds": list(args.seed), "fraction": args.fraction}
    for k in (
        "required_rate",
        "exact_cost",
        "echo2_cost",
        "gap",
        "echo2_ms",
        "exact_ms",
        "all_cost",
        "cheapest_first_cost",
    ):
        med[k] = statistics.median(r[k] for r in rows)
    med["exact_proven_all"] = all(r["exact_proven"] for r in rows)
    med["echo2_method"] = rows[0]["echo2_method"]
    if len(rows) > 1:
        med["per_seed"] = rows
    print(
        f"median over {len(rows)} seed(s): gap {med['gap']:.3%}, echo2 {med['echo2_ms']:.2f} ms, "
        f"exact {med['exact_ms']:.1f} ms, echo2 saves {1 - med['echo2_cost'] / med['cheapest_first_cost']:.1%} "
        f"vs cheapest-first and {1 - med['echo2_cost'] / med['all_cost']:.1%} vs all"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(med, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
