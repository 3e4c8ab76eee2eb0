"""CPU separation for ``echo2 bench attack``: the attacker's machine is not the victims'.

The attacks run in the bench process, on the same two cores as the hub and the honest nodes.
Without separation a flood's *own* work (its Noise handshakes, key generation and signatures:
about one core for A3's eight flooders, measured with :func:`cpu_seconds`) is taken from the
honest nodes' rollouts, so the honest rate falls whatever the hub does with the flood: A3 and A11
measured 0.45-0.64 that way. An attacker with one machine spends its own CPU; what the bench must
measure is what the flood costs the hub and the honest nodes. So by default the bench process
(the attacker) runs on the last CPU and the hub and honest nodes on the others, in the baseline
and the attack window alike, and each row reports the CPU seconds each side spent.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable
from pathlib import Path

_CLK = os.sysconf("SC_CLK_TCK")


def split(spec: str) -> tuple[set[int], set[int]] | None:
    """(victim cpus, attacker cpus) for ``--attacker-cpus``: ``auto`` (the last CPU for the
    attacker when there are two or more), ``none``, or a list like ``3`` or ``2,3``."""
    if spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if spec == "auto":
        if len(cpus) < 2:
            return None
        return set(cpus[:-1]), {cpus[-1]}
    attacker = {int(x) for x in spec.split(",") if x.strip()}
    victims = set(cpus) - attacker
    if not attacker <= set(cpus) or not victims:
        raise ValueError(f"--attacker-cpus {spec}: must name some but not all of the CPUs {cpus}")
    return victims, attacker


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads made later inherit their creator's set)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def ticks_cpu_s(stat_fields: list[str]) -> float:
    """utime + stime (fields 14 and 15 of /proc/PID/stat) in seconds, from the fields after the name."""
    return (int(stat_fields[11]) + int(stat_fields[12])) / os.sysconf("SC_CLK_TCK")


_LIBC = ctypes.CDLL(None, use_errno=True)


def process_cpu_s(pid: int, stat_fields: list[str] | None = None) -> float:
    """CPU seconds of process ``pid``, all its threads (exited ones included), to the nanosecond:
    its CPU-time clock (``clock_getcpuclockid``). Why not /proc/PID/stat alone: it counts in
    10 ms ticks per process, and the heartbeat phase at 100 nodes is ~0.25 s and ~150 ms of hub
    CPU over three processes (hub and 2 workers), so ticks alone were worth up to ±20% of the
    per-heartbeat figure. Falls back to the ticks where the clock cannot be read."""
    cid = ctypes.c_int()
    try:
        if _LIBC.clock_getcpuclockid(pid, ctypes.byref(cid)) == 0:
            return time.clock_gettime(cid.value)
    except OSError:  # the process is gone, or its clock is not ours to read
        pass
    if stat_fields is None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat_fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
    return ticks_cpu_s(stat_fields)


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of these processes so far, all their threads (0 for one that is gone)."""
    return sum(process_cpu_s(pid) for pid in pids)


def busy_seconds(cpus: Iterable[int]) -> float:
    """Seconds the given CPUs spent busy (not idle, not waiting on I/O) since boot, all processes."""
    want = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        f = line.split()
        if f and f[0] in want:
            v = [int(x) for x in f[1:]]
            total += sum(v[:8]) - v[3] - v[4]  # user nice system idle iowait irq softirq steal
    return total / _CLK


#: iterations of :func:`reference_loop_ms`'s loop (~0.3 s of one core here when the host is quiet)
REFERENCE_LOOP_N = 300_000


def reference_loop_ms(n: int = REFERENCE_LOOP_N, rounds: int = 3) -> float:
    """The median CPU ms (this thread's clock) of a fixed pure-Python loop, over ``rounds``.

    Why: these machines are shared, and the same code read 0.57-0.80 ms per result from one run
    to the next while this loop read 313-464 ms within a minute (2026-12-07). Recorded before and
    after a run, it shows in the run's own JSON how fast the host was, so milliseconds from two
    runs are compared only where the host was alike; ratios within one run need no such care."""
    times = []
    for _ in range(max(1, rounds)):
        t0 = time.thread_time()
        acc = 0
        for i in range(n):
            acc = (acc + i * i) % 1_000_003
        times.append((time.thread_time() - t0) * 1000)
    return round(sorted(times)[len(times) // 2], 1)
