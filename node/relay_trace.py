"""A per-chunk trace of the pipelined broadcast, for benches (``relay_main --trace FILE``).

One line per event, ``<time.monotonic()> <event> <version> <chunk> <peer>``:

- ``rx``: this process verified chunk ``i`` (its relay took it in; ``peer`` is ``-``);
- ``q``: its relay gave the driver a Send of chunk ``i`` to ``peer`` (the window and the sibling
  rule let it go: it is queued on that peer's link);
- ``tx``: that send completed (written, at most the link's unsent low-water mark left in the
  socket: the relay's acknowledgement).

``time.monotonic()`` is CLOCK_MONOTONIC, one clock for every process of the machine (network
namespaces do not change it; trio's clock has a random offset per process), so the bench merges
the hub's trace and the nodes' (:mod:`echo2.bench.broadcast_trace`). Lines are written as they
happen (line-buffered), so a node stopped by a signal leaves its trace complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from echo2.protocol.net.relaydriver import RelayDriver
from echo2.protocol.relay import Relay, Send


def install(driver: RelayDriver, path: str, me: str) -> TextIO:
    """Trace every version ``driver`` runs from now on into ``path`` (appended; a first line
    ``<t> me 0 0 <me>`` names the process's peer); the file is returned for the caller to close."""
    f = open(path, "a", buffering=1)  # noqa: SIM115  (open for the process's life; the caller closes it)
    f.write(f"{time.monotonic():.6f} me 0 0 {me}\n")
    start: Callable[[int, Relay | None], None] = driver.start
    act: Callable[[list[Any]], None] = driver.act

    def traced_start(version: int, relay: Relay | None) -> None:
        if relay is not None:
            _wrap(relay, version, f)
        start(version, relay)

    def traced_act(actions: list[Any]) -> None:
        t = time.monotonic()
        for a in actions:
            if isinstance(a, Send):
                f.write(f"{t:.6f} q {driver.version} {a.index} {a.peer}\n")
        act(actions)

    setattr(driver, "start", traced_start)  # noqa: B010  (an instance attribute over the method)
    setattr(driver, "act", traced_act)  # noqa: B010
    return f


def _wrap(relay: Relay, version: int, f: TextIO) -> None:
    verified = relay.on_chunk_verified
    acked = relay.on_child_ack

    def on_chunk_verified(i: int, *, now: float | None = None) -> list[Any]:
        if 0 <= i < relay.n and i not in relay.have:
            f.write(f"{time.monotonic():.6f} rx {version} {i} -\n")
        return verified(i, now=now)

    def on_child_ack(child: str, i: int, *, now: float | None = None) -> list[Any]:
        f.write(f"{time.monotonic():.6f} tx {version} {i} {child}\n")
        return acked(child, i, now=now)

    setattr(relay, "on_chunk_verified", on_chunk_verified)  # noqa: B010
    setattr(relay, "on_child_ack", on_child_ack)  # noqa: B010


def read(path: str) -> list[tuple[float, str, int, int, str]]:
    """The events of a trace file; a torn last line (a process killed mid-write) is skipped."""
    out: list[tuple[float, str, int, int, str]] = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) != 5:
                    continue
                try:
                    out.append((float(parts[0]), parts[1], int(parts[2]), int(parts[3]), parts[4]))
                except ValueError:
                    continue
    except OSError:
        return []
    return out
