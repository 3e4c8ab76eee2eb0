"""``ECHO2_INTAKE_STEPS=FILE`` for ``echo2 bench intake --clients K`` (bench/intake_live.py): the
hub's trio task steps that make its loop lag, and its garbage collections, through the results
phase. py-spy counts a thread waiting for a contended core as busy; this counts the loop thread's
own CPU per step next to its wall time.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class StepTimer:
    """A trio instrument: task steps over ``min_s`` of wall time, by the place each stopped (the
    innermost frames of its coroutine chain outside trio), with their count, total and longest,
    wall and the loop thread's own CPU (on a shared machine a step's wall time also counts the
    time the thread waited for a core)."""

    def __init__(self, min_s: float = 0.003) -> None:
        self.min_s, self.on = min_s, True
        self._t0: dict[int, tuple[float, float]] = {}
        self.by_place: dict[str, list[float]] = {}
        self.gc: dict[int, list[float]] = {}  # collections by generation: count, total, longest
        self._gc0 = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._gc0
        e = self.gc.setdefault(int(info.get("generation", -1)), [0, 0.0, 0.0])
        e[0], e[1], e[2] = e[0] + 1, e[1] + dt, max(e[2], dt)

    def before_task_step(self, task: Any) -> None:
        self._t0[id(task)] = (time.perf_counter(), time.thread_time())

    def after_task_step(self, task: Any) -> None:
        w0, c0 = self._t0.pop(id(task), (time.perf_counter(), time.thread_time()))
        dt = time.perf_counter() - w0
        if dt < self.min_s:
            return
        cpu = time.thread_time() - c0
        where, coro = [], task.coro
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None and "/trio/" not in frame.f_code.co_filename:
                where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        key = " > ".join(where[-3:]) or task.name
        e = self.by_place.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0])
        e[0], e[1], e[2], e[3], e[4] = e[0] + 1, e[1] + dt, max(e[2], dt), e[3] + cpu, max(e[4], cpu)

    def report(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = [{"at": k, "steps": int(v[0]), "total_ms": round(v[1] * 1e3, 1), "max_ms": round(v[2] * 1e3, 2),
                 "cpu_total_ms": round(v[3] * 1e3, 1), "cpu_max_ms": round(v[4] * 1e3, 2)}
                for k, v in self.by_place.items()]
        gcs = [{"at": f"gc generation {g}", "steps": int(v[0]), "total_ms": round(v[1] * 1e3, 1),
                "max_ms": round(v[2] * 1e3, 2)} for g, v in sorted(self.gc.items())]
        return gcs + sorted(rows, key=lambda r: -r["total_ms"])
