"""Where the tail of a real broadcast goes: ``echo2 bench broadcast --trace`` (pure analysis).

Input: the per-chunk traces (:mod:`echo2.node.relay_trace`) of the hub and of every node, the
plan, and the publication time, all on CLOCK_MONOTONIC. Output (:func:`tail_report`): lines that
say, in seconds after publication,

- when the hub's last send to each stripe root completed (the hub's upload is done there);
- the critical path of the last node's last chunk: at every hop, when the parent verified it
  (``rx``), when its relay queued it for the child (``q``: the window and the sibling rule let it
  go) and when the child verified it;
- per depth, the median and 90th percentile of each hop's two parts over the last chunks of each
  stripe: ``wait`` (parent verified -> queued for this child) and ``xfer`` (queued -> the child
  verified it: its turn on the link, the transfer, the child's receive and check), against one
  chunk's time at the stripe rate (``c·S/b``, what the pipeline costs per hop when a relay feeds
  ``S`` children at once);
- once the hub's upload is idle (its last send done), how many chunk deliveries the nodes still
  lacked, against how many the idle hub could have sent before the last node finished (what an
  endgame, the hub sending tail chunks straight to the nodes furthest behind, could take over).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Event = tuple[float, str, int, int, str]


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def tail_report(
    traces: Mapping[str, Sequence[Event]],
    plan: Any,
    t_pub: float,
    *,
    version: int,
    n_chunks: int,
    names: Mapping[str, str],
    chunk_seconds: float,
    tail_chunks: int = 8,
) -> list[str]:
    """Lines describing the tail (see the module doc). ``traces``: peer -> events (the hub under
    ``plan.hub``); ``names``: short names; ``chunk_seconds``: one chunk at the full link rate."""
    hub = plan.hub
    S = plan.stripes
    rx: dict[str, dict[int, float]] = {}
    q: dict[tuple[str, str], dict[int, float]] = {}
    tx: dict[tuple[str, str], dict[int, float]] = {}
    for peer, evs in traces.items():
        for t, ev, ver, i, other in evs:
            if ver != version:
                continue
            t -= t_pub
            if ev == "rx":
                rx.setdefault(peer, {}).setdefault(i, t)
            elif ev == "q":
                q.setdefault((peer, other), {}).setdefault(i, t)
            elif ev == "tx":
                tx.setdefault((peer, other), {})[i] = t
    rx[hub] = dict.fromkeys(range(n_chunks), 0.0)

    def nm(p: str) -> str:
        return names.get(p, p[-6:])

    lines: list[str] = []
    roots = [r for st in range(S) for r in plan.children[st].get(hub, [])]
    ends = [f"{nm(r)} {max(tx.get((hub, r), {0: float('nan')}).values()):.3f}" for r in roots]
    lines.append(f"hub's last send done: {', '.join(ends)} (floor M/b at the goodput of the link: see ideal)")
    nodes = [n for n in rx if n != hub and len(rx[n]) == n_chunks]
    if not nodes:
        return lines + ["no node's trace holds every chunk"]
    last = max(nodes, key=lambda n: max(rx[n].values()))
    i_last = max(rx[last], key=lambda i: rx[last][i])
    s = i_last % S
    path = [last]
    while path[-1] != hub and len(path) <= 64:
        path.append(plan.parent[s].get(path[-1], hub))
    path.reverse()
    hops = []
    for a, b in zip(path, path[1:], strict=False):
        qa = q.get((a, b), {}).get(i_last)
        hops.append(f"{nm(a)} rx {rx.get(a, {}).get(i_last, float('nan')):.3f} q {qa if qa is not None else float('nan'):.3f}")
    hops.append(f"{nm(last)} rx {rx[last][i_last]:.3f}")
    lines.append(f"last node {nm(last)}, its last chunk {i_last} (stripe {s}): " + " -> ".join(hops))
    # hop anatomy over the last chunks of each stripe
    tail = set(range(max(0, n_chunks - tail_chunks * S), n_chunks))
    by_depth: dict[int, tuple[list[float], list[float]]] = {}
    for st in range(S):
        depth = plan.depth(st)
        for child, parent in plan.parent[st].items():
            for i in tail:
                if i % S != st:
                    continue
                t_par, t_q, t_ch = rx.get(parent, {}).get(i), q.get((parent, child), {}).get(i), rx.get(child, {}).get(i)
                if t_par is None or t_q is None or t_ch is None:
                    continue  # pulled or served elsewhere
                w, x = by_depth.setdefault(depth.get(child, -1), ([], []))
                w.append(t_q - t_par)
                x.append(t_ch - t_q)
    per_hop = chunk_seconds * S
    for d in sorted(by_depth):
        w, x = by_depth[d]
        lines.append(f"depth {d}: {len(x)} hops of the last {tail_chunks} chunks per stripe: wait median "
                     f"{statistics.median(w):.3f} p90 {_pct(w, 0.9):.3f}, xfer median {statistics.median(x):.3f} "
                     f"p90 {_pct(x, 0.9):.3f} (one chunk at the stripe rate: {per_hop:.3f})")
    finish = sorted(max(r.values()) for n, r in rx.items() if n != hub and len(r) == n_chunks)
    lines.append("finish per node (trace): " + " ".join(f"{t:.3f}" for t in finish))
    # What an endgame could take over: once the hub's upload is idle, the chunk deliveries still
    # outstanding, against what the idle hub could send at full rate before the last node finished.
    hub_done = max((t for (p, _c), d in tx.items() if p == hub for t in d.values()), default=float("nan"))
    owed = {n: sum(1 for t in r.values() if t > hub_done) for n, r in rx.items() if n != hub and len(r) == n_chunks}
    if owed and hub_done == hub_done:
        lines.append(f"at the hub's last send ({hub_done:.3f}) nodes still lacked {sum(owed.values())} chunks "
                     f"(most {max(owed.values())}); the idle hub could send {(finish[-1] - hub_done) / chunk_seconds:.1f} "
                     "at full rate before the last node finished")
    return lines
