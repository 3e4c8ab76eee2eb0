"""Readings for the computing preferences (issue 19): thin readers of what Linux exposes.

Each returns None where the machine does not say (no ``/proc``, no keyboard interrupt line, no
power supply): the policy in :mod:`.prefs` then does not apply that preference (idle falls back
to the CPU load). Nothing here decides anything; :class:`SystemReader` keeps the few counters a
reading needs between two samples (CPU jiffies, input interrupt counts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .prefs import Readings

T = TypeVar("T")

# /proc/interrupts lines of human input: the PS/2 controller (laptops' built-in keyboard and
# touchpad), and devices whose driver names them; USB HID shares its controller's line with
# disks and network adapters, so a line naming only xhci/ehci does not count as input.
_INPUT_WORDS = ("i8042", "keyboard", "mouse", "touchpad", "hid")


def input_interrupts(text: str) -> int | None:
    """Sum of the interrupt counts of human-input lines in ``/proc/interrupts`` text (None: none)."""
    total, found = 0, False
    for line in text.splitlines()[1:]:
        low = line.lower()
        if not any(w in low for w in _INPUT_WORDS):
            continue
        parts = line.split()
        for p in parts[1:]:
            if not p.isdigit():
                break
            total += int(p)
        found = True
    return total if found else None


def cpu_jiffies(stat_text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat`` text."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            vals = [int(x) for x in line.split()[1:]]
            idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
            total = sum(vals[:8])  # guest time is already counted in user
            return total - idle, total
    return None


def own_jiffies(self_stat_text: str) -> int | None:
    """This process's user + system jiffies (every thread) from ``/proc/self/stat`` text."""
    try:
        rest = self_stat_text.rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # fields 14 and 15 (utime, stime); rest[0] is field 3
    except (IndexError, ValueError):
        return None


def on_battery(root: Path = Path("/sys/class/power_supply")) -> bool | None:
    """True when a battery discharges and no mains supply is online; None without power supplies."""
    try:
        supplies = list(root.iterdir())
    except OSError:
        return None
    mains_online, discharging, seen = False, False, False
    for s in supplies:
        try:
            kind = (s / "type").read_text().strip()
        except OSError:
            continue
        if kind == "Mains":
            seen = True
            try:
                mains_online = mains_online or (s / "online").read_text().strip() == "1"
            except OSError:
                pass
        elif kind == "Battery":
            seen = True
            try:
                discharging = discharging or (s / "status").read_text().strip() == "Discharging"
            except OSError:
                pass
    if not seen:
        return None
    return discharging and not mains_online


def _or_none(read: Callable[[], T]) -> T | None:
    """A reading, or None when the file says something unexpected (a kernel we do not know)."""
    try:
        return read()
    except (ValueError, IndexError, OSError):
        return None


class SystemReader:
    """Takes :class:`Readings` (blocking file reads: call it from a worker thread)."""

    def __init__(self, proc: Path = Path("/proc"), power: Path = Path("/sys/class/power_supply")) -> None:
        self.proc, self.power = proc, power
        self._cpu: tuple[int, int, int] | None = None  # busy, total, own at the last reading
        self._irq: int | None = None
        self._last_input = time.monotonic()

    def _read(self, name: str) -> str | None:
        try:
            return (self.proc / name).read_text()
        except OSError:
            return None

    def input_idle_s(self) -> float | None:
        text = self._read("interrupts")
        n = input_interrupts(text) if text is not None else None
        now = time.monotonic()
        if n is None:
            return None
        if self._irq is not None and n != self._irq:
            self._last_input = now
        self._irq = n
        return now - self._last_input

    def other_cpu_load(self) -> float | None:
        stat, me = self._read("stat"), self._read(f"{os.getpid()}/stat")
        if stat is None or me is None:
            return None
        cj, own = cpu_jiffies(stat), own_jiffies(me)
        if cj is None or own is None:
            return None
        busy, total = cj
        prev, self._cpu = self._cpu, (busy, total, own)
        if prev is None or total <= prev[1]:
            return None  # the first reading: a share needs two
        other = (busy - prev[0]) - (own - prev[2])
        return min(1.0, max(0.0, other / (total - prev[1])))

    def read(self, transfer_day_bytes: int = 0, transfer_month_bytes: int = 0) -> Readings:
        return Readings(
            input_idle_s=_or_none(self.input_idle_s),
            other_cpu_load=_or_none(self.other_cpu_load),
            on_battery=_or_none(lambda: on_battery(self.power)),
            transfer_day_bytes=transfer_day_bytes,
            transfer_month_bytes=transfer_month_bytes,
        )
