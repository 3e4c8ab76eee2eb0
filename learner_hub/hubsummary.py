"""``echo2 hub status``: the running (or stopped) hub's status.json, summarised for a terminal.

Reads only DIR/status.json (written by the hub about once a second), so it costs the hub nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def load(hub_dir: Path) -> dict[str, Any] | None:
    path = hub_dir / "status.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def render(st: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(st.get("written_at", now))
    lines = [
        f"{'peer_id':24} {st.get('peer_id')}",
        f"{'step':24} {st.get('step')} of {st.get('steps')}{' (final)' if st.get('final') else ''}",
        f"{'status age':24} {age:.1f} s",
        f"{'results accepted':24} {st.get('results_accepted')} ({st.get('rollouts_accepted')} rollouts)",
        f"{'tasks issued':24} {st.get('tasks_issued')}, expired {st.get('tasks_expired')}, declined {st.get('tasks_declined')}",
        f"{'nodes':24} {st.get('node_count', len(st.get('nodes') or []))}",
    ]
    refused = st.get("refused_by_reason") or {}
    if refused:
        lines.append(f"{'refused':24} " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items())))
    lines += intake_pool_lines(st.get("intake_pool"))
    return "\n".join(lines)


def intake_pool_lines(pool: dict[str, Any] | None) -> list[str]:
    """The intake pool's counters (intake_pool.IntakePool.report), one line each."""
    if not pool:
        return []
    n = int(pool.get("workers", 0))
    if n == 0:
        head = "0 (results are checked in the hub process)"
    else:
        head = f"{pool.get('workers_alive', '?')} of {n} alive, {pool.get('restarts', 0)} restarts, {pool.get('in_flight', 0)} in flight"
    verdicts = pool.get("verdicts") or {}
    busy = pool.get("busy_by_reason") or {}
    return [
        f"{'intake workers':24} {head}",
        f"{'intake verdicts':24} checked {pool.get('checked', 0)}: "
        + (", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "none yet"),
        f"{'intake busy refusals':24} " + (", ".join(f"{k} {v}" for k, v in sorted(busy.items())) or "none"),
    ]
