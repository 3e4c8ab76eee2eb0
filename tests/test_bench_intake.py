"""``echo2 bench intake`` on a small fleet: every measured result is accepted by a real hub, and
each figure it reports was measured (not a default)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from echo2.bench import intake as bench_intake


def test_bench_intake_small_fleet(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_intake.add_arguments(parser)
    out = tmp_path / "i.json"
    args = parser.parse_args(["--nodes", "4", "--results", "4", "--holds", "2", "--status", "1", "--json", str(out)])
    assert bench_intake.run(args) == 0
    rep = json.loads(out.read_text())
    assert [r["nodes"] for r in rep["rows"]] == [4]
    for row in rep["rows"]:
        assert row["accepted"] == 4  # each measured result was accepted: the hub judged real work
        assert row["result"]["loop_cpu_ms"]["n"] == 4 and row["result"]["loop_cpu_ms"]["median"] > 0
        assert row["holds"]["loop_cpu_ms"]["n"] == 2
        assert row["status"]["bytes"] > 0 and row["result_bytes"] > 8 * 64
        assert row["admission"]["loop_cpu_ms"]["n"] == 20 and row["admission"]["loop_cpu_ms"]["median"] > 0
        # the HTTP server sent the status the hub wrote (then 20 more nodes joined: it is no larger)
        assert row["http_status"]["loop_cpu_ms"]["n"] == 1 and row["http_status"]["bytes"] == row["status"]["bytes"]


def test_bench_intake_with_intake_workers(tmp_path: Path) -> None:
    """``--workers 0,1``: the same small fleet with the checks in the hub and in one intake
    worker; both accept every result, and the hub process's CPU ratio is reported."""
    parser = argparse.ArgumentParser()
    bench_intake.add_arguments(parser)
    out = tmp_path / "i.json"
    args = parser.parse_args(["--nodes", "4", "--results", "4", "--holds", "1", "--status", "1", "--workers", "0,1",
                              "--packed", "--json", str(out)])
    assert bench_intake.run(args) == 0
    rep = json.loads(out.read_text())
    assert [(r["nodes"], r["workers"]) for r in rep["rows"]] == [(4, 0), (4, 1)]
    for row in rep["rows"]:
        assert row["accepted"] == 4 and row["packed"] is True
        assert row["result"]["process_cpu_ms"]["n"] == 4 and "loop_lag_p99_ms" in row["loop_lag_during_results"]
    assert rep["ratio_result_process_cpu_by_workers"]["4:1/0"] > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_intake_live_small_fleet(tmp_path: Path) -> None:
    """The live mode: a hub process, client processes over the channel, batches of 2; every result
    sent is judged (accepted: the tasks were real), and each figure was measured."""
    parser = argparse.ArgumentParser()
    bench_intake.add_arguments(parser)
    out = tmp_path / "live.json"
    args = parser.parse_args(["--nodes", "8", "--clients", "1", "--batch", "2", "--duration", "3", "--idle", "1",
                              "--json", str(out)])
    assert bench_intake.run(args) == 0
    row = json.loads(out.read_text())["rows"][0]
    r, h = row["results"], row["heartbeats"]
    assert r["accepted"] > 0 and not r["refused"] and not r["errors"]
    assert r["messages"] < r["accepted"]  # some results travelled together in a ResultBatch
    # small results, and tasks that came several to a WORK reply (TaskBundle)
    assert r["completions_per_result"] == 8.0 and r["tasks_per_heartbeat"] > 1
    assert r["hub_cpu_ms_per_result"] > 0 and h["answered"] > 0
    # /proc counts CPU in 10 ms ticks: a few heartbeats may read as none
    assert h["hub_cpu_ms_per_heartbeat"] is not None and h["hub_cpu_ms_per_heartbeat"] >= 0
    assert row["hub_rss_mb"] > 0 and r["loop_lag_max_ms"] >= r["loop_lag_p99_ms"] >= 0
    # the host's speed around the run, so milliseconds of two runs can be compared where it was alike
    assert row["reference_loop_ms"]["before"] > 0 and row["reference_loop_ms"]["after"] > 0


def test_size_ratio_is_per_worker_count() -> None:
    """``--nodes 100,10000 --workers 0,2``: each worker count's 10,000-node row over its own
    100-node row (the last row over the first mixed 2 workers with none)."""
    def row(n: int, w: int, loop: float, proc: float) -> dict[str, object]:
        return {"nodes": n, "workers": w, "result": {"loop_cpu_ms": {"median": loop}, "process_cpu_ms": {"median": proc}}}

    rows = [row(100, 0, 2.0, 4.0), row(100, 2, 1.0, 1.0), row(10000, 0, 3.0, 6.0), row(10000, 2, 1.5, 3.0)]
    out = bench_intake.size_ratios(rows, [0, 2])
    assert out["ratio_result_cpu_by_size"] == {"0": {"loop": 1.5, "process": 1.5}, "2": {"loop": 1.5, "process": 3.0}}
    assert (out["ratio_result_loop_cpu"], out["ratio_result_process_cpu"]) == (1.5, 1.5)


def test_live_summary_takes_ratios_within_a_repeat() -> None:
    """``--repeat 2 --workers 0,2``: each cell's median/min/max over its repeats, and the
    workers-over-none ratio taken within each repeat (back-to-back runs) before its median, so a
    repeat the machine ran slow in whole does not skew it."""
    from echo2.bench.intake_live import summarise

    def row(n: int, w: int, k: int, proc: float, hb: float) -> dict[str, object]:
        return {"nodes": n, "intake_workers": w, "repeat": k,
                "results": {"accepted_per_s": 100.0, "hub_cpu_ms_per_result": proc, "hub_process_cpu_ms_per_result": proc,
                            "loop_lag_p99_ms": 5.0 + k},
                "heartbeats": {"hub_cpu_ms_per_heartbeat": hb, "loop_lag_p99_ms": 1.0},
                "idle": {"hub_cpu_ms_per_s": 3.0, "loop_lag_p99_ms": None}}

    # repeat 1 ran on a machine twice as slow: per-cell medians mix the two, the ratio does not
    rows = [row(100, 0, 0, 1.0, 0.3), row(100, 2, 0, 0.5, 0.2), row(100, 0, 1, 2.0, 0.5), row(100, 2, 1, 1.0, 0.4),
            row(1000, 0, 0, 1.1, 0.3), row(1000, 0, 1, 2.4, 0.5)]
    out = summarise(rows)
    cells = {(c["nodes"], c["intake_workers"]): c for c in out["summary"]}
    assert set(cells) == {(100, 0), (100, 2), (1000, 0)}
    assert cells[(100, 0)]["results"]["hub_cpu_ms_per_result"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    assert cells[(100, 2)]["heartbeats"]["hub_cpu_ms_per_heartbeat"]["median"] == 0.3
    assert cells[(100, 0)]["results"]["loop_lag_p99_ms"]["max"] == 6.0
    assert "loop_lag_p99_ms" not in cells[(100, 0)]["idle"]  # never measured: no figure invented
    assert out["ratio_hub_process_cpu_by_workers"] == {"100:2/0": 0.5}
    assert out["ratio_hub_process_cpu_by_workers_spread"]["100:2/0"]["n"] == 2
    assert out["ratio_result_cpu"] == 1.15  # (1.1 / 1.0 + 2.4 / 2.0) / 2


def test_live_cpu_figures_count_every_thread_to_the_nanosecond() -> None:
    import os
    import subprocess
    import sys
    import threading
    import time

    from echo2.bench.attack_cpu import process_cpu_s
    from echo2.bench.intake_live import _thread_cpu_s, _tree_cpu_s

    def burn(s: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            pass

    worker = threading.Thread(target=burn, args=(0.05,))
    worker.start()
    worker.join()  # an exited thread's CPU stays in its process's figure
    mine, ours = process_cpu_s(os.getpid()), time.process_time()
    assert abs(mine - ours) < 0.005 and mine >= 0.05
    assert abs(_thread_cpu_s(os.getpid()) - time.thread_time()) < 0.005
    # a child process (an intake worker, say) counts in the tree, not in the parent's own figure
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.2: pass\ntime.sleep(5)"])
    try:
        deadline = time.monotonic() + 30
        while process_cpu_s(child.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree, own = _tree_cpu_s(os.getpid()), _tree_cpu_s(os.getpid(), own=True)
        assert tree - own >= 0.2 > abs(own - time.process_time())
    finally:
        child.kill()
        child.wait()


def test_reference_loop_reads_the_work_it_was_given() -> None:
    """A fixed loop's CPU grows with its length (a reading that ignored the work could not)."""
    from echo2.bench.attack_cpu import reference_loop_ms

    short, long = reference_loop_ms(20_000), reference_loop_ms(400_000)
    assert 0 < short < long and long / short > 5
