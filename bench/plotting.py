"""The benches' figures, drawn with matplotlib (the ``echo2[bench]`` extra) imported only here and
only when a figure is asked for, so the node and the hub never load it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

INSTALL_HINT = 'pip install "echo2[bench]"'


def require() -> None:
    """Fail before a long run, not after it, when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"--plot needs matplotlib: {INSTALL_HINT}") from None


@contextmanager
def _figure(path: Path | str, dpi: int, **subplots: Any) -> Iterator[Any]:
    require()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def demo_figure(report: dict[str, Any], path: Path | str) -> None:
    """Reward against learner step and against wall time."""
    hist = report["history"]
    with _figure(path, 100, nrows=1, ncols=2, figsize=(10, 4)) as (a, b):
        a.plot([h["step"] for h in hist], [h["reward"] for h in hist])
        a.set_xlabel("learner step")
        a.set_ylabel("mean reward")
        b.plot([h["t"] for h in hist], [h["reward"] for h in hist])
        b.set_xlabel("wall time (s)")
        a.figure.suptitle(f"echo2 demo: {report['task']}, {report['nodes']} nodes, S={report['staleness']}")


def e2e_figure(rows: Sequence[dict[str, Any]], path: Path | str) -> None:
    """Smoothed reward against wall time per S, and measured against predicted busy fraction."""
    with _figure(path, 100, nrows=1, ncols=2, figsize=(11, 4)) as (a, b):
        for r in rows:
            xs = [t for t, _ in r["curve"]]
            ys = [y for _, y in r["curve"]]
            k = max(1, len(ys) // 30)
            smooth = [sum(ys[max(0, i - k) : i + 1]) / len(ys[max(0, i - k) : i + 1]) for i in range(len(ys))]
            a.plot(xs, smooth, label=f"S={r['staleness']}")
        a.set_xlabel("wall time (s)")
        a.set_ylabel("mean reward (smoothed)")
        a.legend()
        labels = [f"S={r['staleness']}" for r in rows]
        x = range(len(rows))
        b.bar([i - 0.2 for i in x], [r["learner_busy_fraction"] for r in rows], width=0.4, label="measured")
        b.bar([i + 0.2 for i in x], [r["predicted_busy_fraction"] for r in rows], width=0.4, label="predicted")
        b.set_xticks(list(x), labels)
        b.set_ylim(0, 1.05)
        b.set_ylabel("learner busy fraction")
        b.legend()


def broadcast_figure(rows: Sequence[dict[str, Any]], modes: Sequence[str], *, mbytes: float, link_MBps: float,
                     hub_MBps: float, simulated: bool, path: Path | str) -> None:
    """Seconds until the last node holds the version against N, per mode, with the floor M/B."""
    with _figure(path, 120, figsize=(6, 4)) as ax:
        for mode in modes:
            pts = sorted((int(r["nodes"]), float(r["seconds"])) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} (last node)")
        floor = mbytes / (hub_MBps if hub_MBps else link_MBps)
        ax.axhline(floor, color="gray", linestyle="--", label=f"floor M/B = {floor:.1f} s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes N")
        ax.set_ylabel("seconds until the last node holds the version")
        sim = " (simulated)" if simulated else ""
        ax.set_title(f"broadcast of {mbytes:g} MB at {link_MBps:g} MB/s{sim}")
        ax.legend()


def learn_figure(report: dict[str, Any], path: Path | str) -> None:
    """Held-out accuracy (from the swarm's evaluations) and train reward against wall time."""
    evals = [e for e in report["evals"] if e.get("wall_s") is not None and e.get("accuracy") is not None]
    train = [t for t in report["train"] if t.get("wall_s") is not None and t.get("reward") is not None]
    with _figure(path, 100, nrows=1, ncols=2, figsize=(11, 4)) as (a, b):
        a.plot([e["wall_s"] for e in evals], [e["accuracy"] for e in evals], marker="o")
        a.set_xlabel("wall time (s)")
        a.set_ylabel("held-out accuracy")
        a.set_ylim(0, 1.05)
        b.plot([t["wall_s"] for t in train], [t["reward"] for t in train])
        b.set_xlabel("wall time (s)")
        b.set_ylabel("train reward (mean per step)")
        a.figure.suptitle(f"echo2 bench learn: {report['model']}, {report['nodes']} nodes, {report['steps']} steps")
