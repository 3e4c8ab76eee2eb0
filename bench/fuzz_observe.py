"""What ``echo2 bench fuzz`` reads from outside the swarm: process memory and listening ports
(/proc), the hub's JSON files, its /metrics and the refusals its log records."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

# --- process observation (/proc) ------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def listen_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


# --- the attack -----------------------------------------------------------------------------------


def scrape_metrics(port: int) -> dict[str, float]:
    """``echo2_results_refused_total{reason=...}`` from the hub's /metrics."""
    import socket

    out: dict[str, float] = {}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            buf = b""
            while True:
                data = s.recv(65536)
                if not data:
                    break
                buf += data
    except OSError:
        return out
    for m in re.finditer(rb'echo2_results_refused_total\{reason="([^"]+)"\} ([0-9.e+]+)', buf):
        out[m.group(1).decode()] = float(m.group(2))
    return out


_LOG_PATTERNS = [
    (re.compile(r"refused \S+ from \S+: \[([\w.]+)\]"), "{0}"),
    (re.compile(r"data plane full"), "dataplane.too_many_connections"),
    (re.compile(r"data-plane handshakes from \S+ above"), "dataplane.handshake.rate_limited"),
    (re.compile(r"more than \d+ data-plane connections from \d"), "dataplane.too_many_connections.ip"),
    (re.compile(r"data-plane handshake from \S+ timed out"), "dataplane.handshake.timeout"),
    (re.compile(r"data-plane handshake from \S+ refused"), "dataplane.handshake.refused"),
    (re.compile(r"refused frame from \S+: ([\w.]+)"), "dataplane.{0}"),
    (re.compile(r"lines suppressed"), "log_lines_suppressed"),
]


def hub_log_refusals(path: Path) -> dict[str, int]:
    """Refusals the hub logged (its log is thinned under a flood: a lower bound per reason)."""
    out: Counter[str] = Counter()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        for pat, fmt in _LOG_PATTERNS:
            m = pat.search(line)
            if m:
                out[fmt.format(*m.groups())] += 1
                break
    return dict(sorted(out.items()))
