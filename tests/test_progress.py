"""Issue 19 item 4: the node says what it waits for, at least every 5 s. The watcher's rule on a fake
clock, and the must-show: a captured terminal (a pty) of `echo2 node run` against a hub that is not
up names the address and the next retry, with no gap over 5 s."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo2.node.progress import REPEAT_S, NodeSteps, Progress
from echo2.protocol.identity import Identity


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def events(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_watcher_repeats_a_silent_step_with_a_fresh_countdown() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("json", out=out, clock=clock)
    steps = NodeSteps(p)
    steps.unreachable("/ip4/127.0.0.1/tcp/9/p2p/X", 3, "connection refused", 4.5)
    p.tick()
    clock.t += REPEAT_S - 0.5
    p.tick()
    assert len(events(out)) == 1  # said once, not yet again
    clock.t += 0.5
    p.tick()
    first, again = events(out)
    assert first["event"] == again["event"] == "connecting" and first["attempt"] == 3 and first["retry_in_s"] == 4.5
    assert "next retry in 4.5 s" in first["message"] and "next retry in 0.5 s" in again["message"]
    assert again["still"] and again["elapsed_s"] == REPEAT_S
    # waiting for work is the steady state: said, then only every minute
    steps.idle()
    clock.t += 30
    p.tick()
    assert [e["event"] for e in events(out)][-1] == "idle" and len(events(out)) == 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pty_session_against_a_hub_not_up_names_address_and_retry(tmp_path: Path) -> None:
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"  # nothing listens there
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "echo2", "node", "run", "--hub", addr, "--data-dir", str(tmp_path),
                             "--threads", "1"], stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    os.close(slave)
    lines: list[tuple[float, str]] = []
    buf = b""
    watch_until = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (watch_until is None or time.monotonic() < watch_until):
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                text = raw.decode(errors="replace").rstrip("\r")
                lines.append((time.monotonic(), text))
                if watch_until is None and "next retry in" in text:
                    watch_until = time.monotonic() + 12  # then watch 12 s of retries
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        os.close(master)
    session = "\n".join(t for _, t in lines)
    assert watch_until is not None, f"no retry line in the session:\n{session}"
    retry = [(t, s) for t, s in lines if addr in s and re.search(r"next retry in \d+\.\d s", s)]
    assert len(retry) >= 3, session
    # from the first line on, the session never goes quiet for more than 5 s
    stamps = [t for t, _ in lines]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(gaps) <= 5.0, f"silent for {max(gaps):.1f} s:\n{session}"
    assert any(f"try {n}" in s for n in (2, 3) for _, s in retry), session


def test_download_step_follows_the_relay_state(tmp_path: Path) -> None:
    """A version being received (the relay's real broadcast state): MB of MB, chunks, peers, ETA."""
    from test_messages import make_manifest

    from echo2.node.chunkstore import ChunkStore
    from echo2.node.progress import download_figures
    from echo2.node.relay_runtime import RelayNode
    from echo2.node.relay_state import Broadcast, star_view
    from echo2.protocol.relay import Relay

    me, hub = Identity.from_seed(b"\x03" * 32).peer_id, Identity.from_seed(b"\x04" * 32).peer_id
    m = make_manifest()  # two chunks: 100 and 50 encoded bytes
    plan = star_view(me, hub)
    relay = Relay(me, plan, [c.enc_hash for c in m.chunks], have=[0], now=10.0)
    bc = Broadcast(m, b"", plan, relay, 10.0)
    msg, f = download_figures(bc, {hub: object()}, hub, bc.t0, 12.0)
    assert (f["done"], f["total"], f["chunks_done"], f["chunks"], f["peers"]) == (100, 150, 1, 2, [hub])
    assert f["eta_s"] == 1.0  # 100 bytes in 2 s: 50 left
    assert msg.startswith("downloading version 4: 0.0 of 0.0 MB (1/2 chunks) from hub, ETA 1 s")
    # as the watcher sees it: the step becomes "download", said with its figures
    node = RelayNode(Identity.from_seed(b"\x03" * 32), ChunkStore(tmp_path / "store"), hub, "127.0.0.1:9")  # not started
    node.bc = bc
    out, clock = io.StringIO(), Clock()
    p = Progress("json", out=out, clock=clock)
    NodeSteps(p).poll_download(node, hub, None, 12.0)
    (ev,) = events(out)
    assert ev["event"] == "download" and ev["version"] == 4 and ev["chunks_done"] == 1
    NodeSteps(p).poll_download(node, hub, 4, 12.0)  # the version is held already: nothing to say
    assert len(events(out)) == 1
