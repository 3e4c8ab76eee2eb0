"""``echo2 hub report``: a run's curves and summary from its store alone, during or after the run.

The hub's SQLite file is opened read-only (``mode=ro`` URI; WAL lets it be read while the hub
writes) and never migrated or changed, so the report works on a running hub and on a copy of a
finished one. What it reads:

* ``train_metrics`` (one JSON row of TRL-named figures per learner step; trainmetrics.py) for
  the train curves. A store written before that table existed has no per-step figures: the
  report then says so and draws the rest.
* ``evaluations`` (eval accuracy and mean reward by step), ``versions`` (broadcast times),
  ``results`` (each node's accepted tokens over time, the staleness of its trained rows, refusals
  by reason), ``ledger`` (cost, tokens, refusals per node), ``nodes`` (seen, banned). Refusals
  are those the store keeps (results refused, per node); the network edge's (``control.*``,
  ``dataplane.*`` in status.json) are counted in memory only and are not in a report.

Outputs: a JSON summary, a self-contained HTML file (the status page's charts, uPlot inlined),
and with ``--png DIR`` (echo2[bench]) the same curves as PNG files.
"""

from __future__ import annotations

import html
import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from .charts import charts_block
from .curves import BROADCAST_KEYS, CURVE_POINTS, EVAL_KEYS, series_of, train_figures
from .status_http import _table, json_safe
from .store import DB_NAME

#: the per-node throughput curve: about this many bins over the run, none shorter than NODE_BIN_S
NODE_BINS = 100
NODE_BIN_S = 10.0


def open_ro(hub_dir: Path) -> sqlite3.Connection:
    path = Path(hub_dir) / DB_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no hub database at {path}")
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def read_run(hub_dir: Path) -> dict[str, Any]:
    """Everything the report needs, read in one read transaction (a consistent snapshot)."""
    db = open_ro(hub_dir)
    try:
        db.execute("BEGIN")
        have = _tables(db)
        train: list[dict[str, Any]] = []
        if "train_metrics" in have:
            train = [{"step": int(s), "wall_s": float(w), **json.loads(m)}
                     for s, w, m in db.execute("SELECT step, wall_s, metrics FROM train_metrics ORDER BY step")]
        evals = [dict(zip(("step", "wall_s", "mean_reward", "accuracy", "n", "excluded"), r, strict=True))
                 for r in db.execute("SELECT step, wall_s, mean_reward, accuracy, n, excluded FROM evaluations ORDER BY step")] \
            if "evaluations" in have else []
        versions = [dict(zip(("version", "published_at", "first_s", "median_s", "last_s", "nodes"), r, strict=True))
                    for r in db.execute("SELECT version, published_at, first_s, median_s, last_s, nodes FROM versions ORDER BY version")]
        results = list(db.execute("SELECT node, accepted, reason, tokens, rollouts, received_at, version, trained_step FROM results"))
        ledger = list(db.execute("SELECT peer_id, cost_micro, accepted_tokens, accepted_rollouts, refused_by_reason FROM ledger"))
        nodes = list(db.execute("SELECT peer_id, first_seen, last_seen, state, banned, ban_reason FROM nodes"))
        db.execute("COMMIT")
    finally:
        db.close()
    return {"train": train, "train_table": "train_metrics" in have, "evals": evals, "versions": versions,
            "results": results, "ledger": ledger, "nodes": nodes}


def _first_last(rows: list[dict[str, Any]], key: str) -> tuple[Any, Any]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return (vals[0], vals[-1]) if vals else (None, None)


def node_table(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per node: tokens accepted, results refused, mean/max staleness of its trained results
    (learner step that trained it minus the version it was made with, minus one: 0 = fresh),
    cost, banned."""
    per: dict[str, dict[str, Any]] = {}
    for peer, _first, _last, state, banned, why in run["nodes"]:
        per[peer] = {"peer_id": peer, "state": state, "banned": bool(banned),
                     "ban_reason": why, "tokens": 0, "results": 0, "refused": 0, "cost_usd": 0.0}
    stale: dict[str, list[int]] = {}
    for node, acc, _reason, tokens, _ro, _at, version, trained in run["results"]:
        p = per.setdefault(node, {"peer_id": node, "tokens": 0, "results": 0, "refused": 0, "cost_usd": 0.0})
        if acc:
            p["tokens"] += int(tokens)
            p["results"] += 1
            if trained is not None:
                stale.setdefault(node, []).append(int(trained) - 1 - int(version))
        else:
            p["refused"] += 1
    for peer, cost_micro, _tok, _ro, _refused in run["ledger"]:
        per.setdefault(peer, {"peer_id": peer})["cost_usd"] = cost_micro / 1e6
    for peer, xs in stale.items():
        per[peer]["staleness_mean"] = round(sum(xs) / len(xs), 3)
        per[peer]["staleness_max"] = max(xs)
    return list(per.values())


def node_curves(run: dict[str, Any], t0: float) -> dict[str, Any]:
    """Accepted tokens/s per node in bins of wall time since ``t0`` (NODE_BINS over the run)."""
    bins: dict[str, Counter[int]] = {}
    last = 0
    span = max((r[5] - t0 for r in run["results"]), default=0.0)
    width = max(NODE_BIN_S, span / NODE_BINS)
    for node, acc, _r, tokens, _ro, at, _v, _t in run["results"]:
        if acc:
            b = int((at - t0) // width)
            bins.setdefault(node, Counter())[b] += int(tokens)
            last = max(last, b)
    if last > 0 and span - last * width < width / 2:  # a stub of a last bin joins the one before it
        for c in bins.values():
            c[last - 1] += c.pop(last, 0)
        last -= 1
    xs = list(range(last + 1)) if bins else []
    # the last bin ends at the last result, not a full width later
    ends = [span if b == last else (b + 1) * width for b in xs]
    return {"wall_s": ends,
            "series": {node: [c.get(b, 0) / max(e - b * width, 1e-9) for b, e in zip(xs, ends, strict=True)]
                       for node, c in bins.items()}}


def build_report(run: dict[str, Any]) -> dict[str, Any]:
    """The JSON summary and the curves (curves.py's shape) of a run read by :func:`read_run`."""
    train, evals, versions = run["train"], run["evals"], run["versions"]
    t0 = versions[0]["published_at"] if versions else min((r[5] for r in run["results"]), default=0.0)
    ends = [r["wall_s"] for r in train] + [e["wall_s"] for e in evals]
    ends += [v["published_at"] - t0 for v in versions] + [r[5] - t0 for r in run["results"]]
    r_first, r_last = _first_last(train, "reward")
    a_first, a_last = _first_last(evals, "accuracy")
    accs = [e for e in evals if e.get("accuracy") is not None]
    best = max(accs, key=lambda e: (e["accuracy"], -e["step"])) if accs else None
    refused: Counter[str] = Counter()
    for _p, _c, _t, _r, by_reason in run["ledger"]:
        refused.update({str(k): int(v) for k, v in json.loads(by_reason or "{}").items()})
    refused_results = Counter(str(r[2]) for r in run["results"] if not r[1])
    nodes = node_table(run)
    summary = {
        "steps": max((r["step"] for r in train), default=max((v["version"] for v in versions), default=0)),
        "wall_s": round(max(ends, default=0.0), 3),
        "reward_first": r_first,
        "reward_last": r_last,
        "eval_accuracy_first": a_first,
        "eval_accuracy_best": None if best is None else best["accuracy"],
        "eval_accuracy_best_step": None if best is None else best["step"],
        "eval_accuracy_last": a_last,
        "eval_mean_reward_first": _first_last(evals, "mean_reward")[0],
        "eval_mean_reward_best": max((e["mean_reward"] for e in evals if e.get("mean_reward") is not None), default=None),
        "eval_mean_reward_last": _first_last(evals, "mean_reward")[1],
        "evaluations": len(evals),
        "accepted_tokens": sum(int(r[3]) for r in run["results"] if r[1]),
        "accepted_results": sum(1 for r in run["results"] if r[1]),
        "cost_usd": round(sum(c for _p, c, *_ in run["ledger"]) / 1e6, 6),
        "nodes_seen": len(nodes),
        "bans": {n["peer_id"]: n.get("ban_reason", "") for n in nodes if n.get("banned")},
        "refused_by_reason": dict(sorted(refused.items())),
        "refused_results_by_reason": dict(sorted(refused_results.items())),
        "per_step_figures": run["train_table"],
    }
    train_keys = {k for r in train for k in train_figures(r)}
    curves = {
        "train": series_of((train_figures(r) | {"step": r["step"], "wall_s": r["wall_s"]} for r in train),
                           ("step", "wall_s"), train_keys, CURVE_POINTS).columns(),
        "eval": series_of(evals, ("step", "wall_s"), EVAL_KEYS).columns(),
        "broadcast": series_of(versions, ("version",), BROADCAST_KEYS).columns(),
        "nodes": node_curves(run, t0),
    }
    return {"summary": summary, "nodes": nodes, "evaluations": evals, "curves": curves}


def render_report_html(report: dict[str, Any], title: str) -> str:
    """One self-contained file: the charts (uPlot and the curves inlined), then the tables."""
    s = report["summary"]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(json.dumps(v) if isinstance(v, (dict, list)) else str(v))}</td></tr>"
                   for k, v in s.items())
    note = "" if s["per_step_figures"] else (
        "<p><b>This store has no per-step figures</b> (no train_metrics table: written by an older echo2);"
        " the train curves are empty.</p>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>echo2 run report: {html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}}th{{background:#f0f0f0}}</style>
</head><body>
<h1>echo2 run report: {html.escape(title)}</h1>
{note}
{charts_block(json_safe(report["curves"]), live=False)}
<div id="tables">
<h2>Summary</h2><table>{rows}</table>
<h2>Nodes ({len(report["nodes"])})</h2>
<p>staleness: learner step that trained a result minus one minus the version it was made with</p>
{_table(report["nodes"])}
<h2>Evaluations</h2>
{_table(report["evaluations"], limit=1000)}
</div>
</body></html>
"""


def write_pngs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """The curves as PNG files (matplotlib, echo2[bench]); returns the files written."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('--png needs matplotlib: pip install "echo2[bench]"') from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    c = report["curves"]
    t = c["train"]
    figs = [
        ("reward", "train reward", t, "step", ["reward"] + [k for k in t["series"] if k.startswith("rewards/")]),
        ("eval", "eval (held-out split)", c["eval"], "step", list(EVAL_KEYS)),
        ("completion_length", "completion length (tokens, mean)", t, "step", ["completions/mean_length"]),
        ("utilisation", "learner busy fraction vs capacity model", t, "step",
         ["echo2/learner_busy_fraction", "echo2/predicted_busy_fraction"]),
        ("broadcast", "broadcast time per version (s)", c["broadcast"], "version", list(BROADCAST_KEYS)),
        ("node_throughput", "accepted tokens/s per node", c["nodes"], "wall_s", list(c["nodes"]["series"])),
    ]
    written = []
    for name, title, block, x, keys in figs:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        try:
            for k in keys:
                ys = block["series"].get(k)
                if ys:
                    pts = [(a, b) for a, b in zip(block[x], ys, strict=False) if b is not None]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 40 else None,
                            label=k.removeprefix("rewards/").removesuffix("/mean") if k.startswith("rewards/") else k[-30:])
            ax.set_title(title)
            ax.set_xlabel(x)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        finally:
            plt.close(fig)
    return written


def run_report(hub_dir: Path, html_out: Path | None, json_out: Path | None, png_dir: Path | None) -> dict[str, Any]:
    report = build_report(read_run(hub_dir))
    if json_out is not None:
        json_out.write_text(json.dumps(json_safe({"summary": report["summary"], "nodes": report["nodes"],
                                                  "evaluations": report["evaluations"]}), indent=2) + "\n")
    if html_out is not None:
        html_out.write_text(render_report_html(report, Path(hub_dir).resolve().name), encoding="utf-8")
    if png_dir is not None:
        write_pngs(report, png_dir)
    return report
