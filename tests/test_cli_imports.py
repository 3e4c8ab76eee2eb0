"""The node and hub commands load neither the benches nor matplotlib; --plot without it says how to get it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from echo2.bench import plotting
from echo2.cli import main

_NOT_LOADED = "assert not [m for m in sys.modules if m.startswith(('matplotlib', 'echo2.bench'))], sorted(sys.modules)"


@pytest.mark.parametrize(
    "code",
    [
        "import sys, echo2.node.runtime, echo2.learner_hub.hub",
        "import sys, echo2.cli",
        "import sys, echo2.cli; echo2.cli.build_parser(['--log-level', 'INFO', 'hub', 'run', '--config', 'x'])",
        "import sys, echo2.cli; echo2.cli.build_parser(['node', 'run', '--hub', 'x'])",
    ],
)
def test_node_and_hub_do_not_import_bench_or_matplotlib(code: str) -> None:
    subprocess.run([sys.executable, "-c", f"{code}; {_NOT_LOADED}"], check=True, timeout=120)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra sees
    with pytest.raises(SystemExit, match=r'pip install "echo2\[bench\]"'):
        plotting.require()
    with pytest.raises(SystemExit, match=r'pip install "echo2\[bench\]"'):  # refused before the run starts
        main(["bench", "broadcast", "--simulate", "--nodes", "2", "--plot", str(tmp_path / "b.png")])
    assert not (tmp_path / "b.png").exists()


def test_figures_are_drawn(tmp_path: Path) -> None:
    report = {"task": "copy", "nodes": 2, "staleness": 1,
              "history": [{"step": i, "t": 0.5 * i, "reward": 0.1 * i} for i in range(1, 6)]}
    plotting.demo_figure(report, tmp_path / "demo.png")
    rows = [{"staleness": s, "curve": [(0.1 * i, 0.2 * i) for i in range(8)], "learner_busy_fraction": 0.5,
             "predicted_busy_fraction": 0.6} for s in (0, 2)]
    plotting.e2e_figure(rows, tmp_path / "e2e.png")
    for png in ("demo.png", "e2e.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
