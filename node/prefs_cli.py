"""``echo2 node run``'s computing-preference flags and ``echo2 node prefs`` (issue 19)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .prefs import Prefs, PrefsError

# flag -> (Prefs field, type, help); every flag defaults to None: "not given, node.toml decides"
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--idle-minutes", "idle_minutes", float, "compute only after N minutes without keyboard/mouse input "
     "(where readable; else other programs' CPU load under --idle-load-percent for that long)"),
    ("--idle-load-percent", "idle_load_percent", float, "the CPU load of other programs under which the machine counts as idle"),
    ("--hours", "hours", str, "local hours to compute in, START-END (e.g. 22-7, 9:30-17)"),
    ("--days", "days", str, "days to compute on (e.g. mon-fri, sat,sun)"),
    ("--max-cpu-percent", "max_cpu_percent", float, "share of the CPUs to compute with"),
    ("--cpu-ceiling-percent", "cpu_ceiling_percent", float, "pause while other programs use more than this share of the CPUs"),
    ("--gpu-memory-fraction", "gpu_memory_fraction", float, "share of GPU memory vLLM may take (gpu_memory_utilization)"),
    ("--max-memory-MiB", "max_memory_MiB", int, "memory the model and its tasks may use"),
    ("--max-disk-MiB", "max_disk_MiB", int, "disk the chunk store may fill"),
    ("--max-daily-transfer-MB", "max_daily_transfer_MB", float, "traffic per local day, then pause until midnight"),
    ("--max-monthly-transfer-MB", "max_monthly_transfer_MB", float, "traffic per calendar month"),
    ("--prefs-check-every-s", "check_every_s", float, argparse.SUPPRESS),
]
_SWITCHES = [("pause-on-battery", "pause_on_battery", "pause while on battery"),
             ("relay-while-paused", "relay_while_paused", "keep relaying policy versions while computing is paused")]


def add_pref_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("computing preferences", "override DATA_DIR/node.toml's [prefs] (see `echo2 node prefs`)")
    for flag, dest, typ, text in _FLAGS:
        g.add_argument(flag, dest=f"pref_{dest}", type=typ, default=None, help=text, metavar=typ.__name__.upper())
    for name, dest, text in _SWITCHES:
        g.add_argument(f"--{name}", dest=f"pref_{dest}", action=argparse.BooleanOptionalAction,
                       default=None, help=text)


def pref_overrides(args: argparse.Namespace, data_dir: Path | None = None) -> dict[str, Any]:
    """The preferences given as flags (field -> value), checked with ``data_dir``'s node.toml when
    given: a bad value, in either, stops the start with its name."""
    out = {k.removeprefix("pref_"): v for k, v in vars(args).items() if k.startswith("pref_") and v is not None}
    try:
        Prefs(**out)
        if data_dir is not None:
            from .pausing import effective_prefs

            effective_prefs(data_dir, out)
    except PrefsError as exc:
        raise SystemExit(f"bad preference: {exc}") from None
    return out


def register_prefs(sub: Any, default_dir: Path) -> None:
    p = sub.add_parser("prefs", help="the computing preferences a node would run with",
                       description="print the effective computing preferences: DATA_DIR/node.toml's [prefs], "
                                   "overridden by the flags given here as to `echo2 node run`")
    p.add_argument("--data-dir", type=Path, default=default_dir)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_pref_flags(p)
    p.set_defaults(func=_prefs)


def _prefs(args: argparse.Namespace) -> int:
    from .pausing import PREFS_FILE, effective_prefs

    try:
        prefs = effective_prefs(args.data_dir, pref_overrides(args))
    except PrefsError as exc:
        print(f"error: {exc}")
        return 1
    given = pref_overrides(args)
    d = prefs.to_dict()
    now = _decide_now(prefs, args.data_dir)
    if args.json:
        print(json.dumps(d | {"now": now}, indent=1))
        return 0
    print(f"# {args.data_dir / PREFS_FILE} [prefs], flags overriding (0 or empty: no limit)")
    for k, v in d.items():
        print(f"{k:24} {json.dumps(v)}{'   (flag)' if k in given else ''}")
    print(f"# now: {'would compute' if now['run'] else 'would pause: ' + now['reason']} "
          f"(readings: {', '.join(f'{k} {v}' for k, v in now['readings'].items())})")
    return 0


def _decide_now(prefs: Prefs, data_dir: Path) -> dict[str, Any]:
    """What the policy says on this machine now (two readings a second apart: a CPU share needs two)."""
    import dataclasses
    import time

    from .pausing import TRANSFER_FILE, local_now
    from .prefs import PrefsPolicy, TransferMeter
    from .sysread import SystemReader

    try:
        meter = TransferMeter(json.loads((data_dir / TRANSFER_FILE).read_text()))
    except (OSError, ValueError, AttributeError):
        meter = TransferMeter()
    reader, policy = SystemReader(), PrefsPolicy(prefs)
    reader.read()
    time.sleep(1.0)
    t = local_now()
    readings = reader.read(*meter.totals(t))
    policy.observe(readings, t.timestamp())
    d = policy.decide(readings, t)
    return {"run": d.run, "code": d.code, "reason": d.reason, "readings": dataclasses.asdict(readings)}
