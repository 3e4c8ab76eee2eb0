"""What one hostile frame costs its receiver: peak RSS growth and time of ``open_envelope`` on a
large envelope with a garbage signature (issue 15, finding A2).

The payload is the worst case for a decoder: a msgpack array of empty maps (one byte each on the
wire, a dict each in Python), under the Result domain, whose 64 MiB limit lets it through the size
check. Each size runs in a fresh interpreter so peak RSS is that frame's alone.

    python -m echo2.bench.envelope_open [--mib 1 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def hostile_frame(payload_bytes: int) -> bytes:
    """A canonical envelope whose payload is ``payload_bytes`` of empty maps, signature all zeros."""
    from echo2.protocol import canonical
    from echo2.protocol.messages import Result

    n = payload_bytes - 5
    payload = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # array32 of n empty maps
    now = time.time()
    body = {"d": Result.DOMAIN, "k": b"\x01" * 32, "n": b"\x02" * 16, "p": payload,
            "s": b"\x00" * 64, "t": now, "x": now + 60.0}  # fmt: skip
    return canonical.encode(body)


def measure_one(mib: float) -> dict[str, Any]:
    from echo2.protocol import envelope
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.messages import Result

    frame = hostile_frame(int(mib * 1024 * 1024))
    rss_before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    try:
        envelope.open_envelope(frame, Result, replay=envelope.ReplayGuard())
        refusal = "accepted"
    except Echo2Error as exc:
        refusal = exc.code
    seconds = time.perf_counter() - t0
    return {
        "frame_mib": round(len(frame) / 2**20, 2),
        "rss_growth_mib": round((_rss_kib("VmHWM") - rss_before) / 1024, 1),
        "seconds": round(seconds, 4),
        "refusal": refusal,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--json", default="")
    p.add_argument("--one", type=float, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.one)))
        return 0
    rows = []
    for mib in args.mib:
        out = subprocess.run([sys.executable, "-m", "echo2.bench.envelope_open", "--one", str(mib)],
                             check=True, capture_output=True, text=True, timeout=600, env=os.environ.copy())  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
