"""Computing preferences (issue 19), BOINC's set: when and how much of this machine the node may use.

Pure: the preferences, a snapshot of readings (:mod:`.sysread` takes them) and the local time
go in; run or pause, with a reason a person can read, comes out. The node samples, this decides.

A volunteer sets them in ``DATA_DIR/node.toml`` under ``[prefs]`` (re-read while the node runs)
and as ``echo2 node run`` flags, which override the file; ``echo2 node prefs`` prints the
effective set. ``0`` (or an empty string) means "no limit" for every cap.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "DAYS", "Decision", "Prefs", "PrefsError", "Readings", "PrefsPolicy", "TransferMeter",
    "load_prefs", "memory_cap_MiB", "merge_prefs", "parse_days", "parse_hours", "threads_for",
]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
#: readings under the CPU ceiling before a node paused by it resumes
CPU_SETTLE_SAMPLES = 3
PREFS_TABLE = "prefs"


class PrefsError(ValueError):
    """A preference that cannot be understood (the message names it)."""


@dataclass(frozen=True)
class Prefs:
    # run only after no keyboard/mouse input for this long (where input can be read, else: after
    # other programs' CPU load stayed under idle_load_percent for this long); 0 = also while in use
    idle_minutes: float = 0.0
    idle_load_percent: float = 10.0
    # local hours, "START-END" (24 h clock, may wrap midnight: "22-7", "9:30-17"); "" = any time
    hours: str = ""
    # local days, "mon-fri", "sat,sun"; "" = every day
    days: str = ""
    # share of this machine's CPUs the node computes with (torch threads)
    max_cpu_percent: float = 100.0
    # pause while the other programs' CPU load is above this share of all CPUs (0 = never)
    cpu_ceiling_percent: float = 0.0
    # share of GPU memory the engine may take (vLLM's gpu_memory_utilization; 0 = engine default)
    gpu_memory_fraction: float = 0.0
    # memory the model and its tasks may use (MiB; 0 = 80% of RAM or of GPU memory)
    max_memory_MiB: int = 0
    # disk the chunk store may fill (MiB; 0 = all but the disk reserve)
    max_disk_MiB: int = 0
    # what the node sends and receives, per local day and per calendar month (MB; 0 = no cap)
    max_daily_transfer_MB: float = 0.0
    max_monthly_transfer_MB: float = 0.0
    # pause while the machine runs on battery (where the OS says so)
    pause_on_battery: bool = True
    # keep relaying policy versions to peers while computing is paused (a transfer cap stops both)
    relay_while_paused: bool = True
    # how often the readings are taken (s)
    check_every_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("idle_minutes", "max_memory_MiB", "max_disk_MiB", "max_daily_transfer_MB", "max_monthly_transfer_MB"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise PrefsError(f"{name} must be a number >= 0, got {v!r}")
        for name in ("idle_load_percent", "cpu_ceiling_percent"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 100):
                raise PrefsError(f"{name} must be within 0-100, got {v!r}")
        if not (isinstance(self.max_cpu_percent, (int, float)) and 0 < self.max_cpu_percent <= 100):
            raise PrefsError(f"max_cpu_percent must be within (0, 100], got {self.max_cpu_percent!r}")
        if not (isinstance(self.gpu_memory_fraction, (int, float)) and 0 <= self.gpu_memory_fraction < 1):
            raise PrefsError(f"gpu_memory_fraction must be within [0, 1), got {self.gpu_memory_fraction!r}")
        if not (isinstance(self.check_every_s, (int, float)) and 0.05 <= self.check_every_s <= 600):
            raise PrefsError(f"check_every_s must be within 0.05-600, got {self.check_every_s!r}")
        parse_hours(self.hours)
        parse_days(self.days)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_hours(spec: str) -> tuple[int, int] | None:
    """``"22-7"`` -> (1320, 420): minutes after midnight of start and end; None = any time."""
    if not isinstance(spec, str):
        raise PrefsError(f"hours must be a string like '22-7' or '9:30-17', got {spec!r}")
    s = spec.strip()
    if not s:
        return None

    def minute(part: str) -> int:
        h, _, m = part.strip().partition(":")
        try:
            hh, mm = int(h), int(m or 0)
        except ValueError:
            raise PrefsError(f"hours {spec!r}: {part!r} is not an hour (H or H:MM)") from None
        if not (0 <= hh <= 24 and 0 <= mm < 60) or hh * 60 + mm > 24 * 60:
            raise PrefsError(f"hours {spec!r}: {part!r} is not within 0:00-24:00")
        return hh * 60 + mm

    a, sep, b = s.partition("-")
    if not sep:
        raise PrefsError(f"hours {spec!r} must be START-END, e.g. '22-7'")
    start, end = minute(a), minute(b)
    if start % 1440 == end % 1440:
        return None  # a whole day
    return start % 1440, end % 1440


def parse_days(spec: str) -> frozenset[int] | None:
    """``"mon-fri,sun"`` -> weekday numbers (Monday = 0); None = every day."""
    if not isinstance(spec, str):
        raise PrefsError(f"days must be a string like 'mon-fri' or 'sat,sun', got {spec!r}")
    s = spec.strip().lower()
    if not s:
        return None
    out: set[int] = set()

    def day(name: str) -> int:
        n = name.strip()[:3]
        if n not in DAYS:
            raise PrefsError(f"days {spec!r}: {name.strip()!r} is not a day (mon, tue, ... sun)")
        return DAYS.index(n)

    for part in s.split(","):
        a, sep, b = part.partition("-")
        if sep:
            i, j = day(a), day(b)
            out.update((i + k) % 7 for k in range((j - i) % 7 + 1))
        else:
            out.add(day(a))
    return frozenset(out)


def _in_window(minute: int, window: tuple[int, int]) -> bool:
    start, end = window
    return start <= minute < end if start < end else (minute >= start or minute < end)


def _next_window_start(now: datetime, window: tuple[int, int] | None, days: frozenset[int] | None) -> datetime | None:
    """The next local time at which both the hours and the days allow running (minute steps of
    the boundaries, at most 8 days ahead)."""
    t = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    for _ in range(8 * 24 * 60):
        if (days is None or t.weekday() in days) and (window is None or _in_window(t.hour * 60 + t.minute, window)):
            return t
        t += timedelta(minutes=1)
    return None


@dataclass(frozen=True)
class Readings:
    """What the machine says now; None where it cannot be read (then the preference reading it
    is not applied, except idle: see :class:`PrefsPolicy`)."""

    input_idle_s: float | None = None  # since the last keyboard/mouse input
    other_cpu_load: float | None = None  # other programs' share of all CPUs since the last reading, 0..1
    on_battery: bool | None = None
    transfer_day_bytes: int = 0
    transfer_month_bytes: int = 0


@dataclass(frozen=True)
class Decision:
    run: bool
    code: str = ""  # "" when running; else hours, days, in_use, cpu_busy, on_battery, transfer_day, transfer_month
    reason: str = ""
    relay: bool = True  # may the node keep relaying (a transfer cap stops it too)
    resume_at: float = 0.0  # unix seconds when known (time windows, transfer periods), else 0

    @property
    def pause_key(self) -> tuple[bool, str]:
        return self.run, self.code


RUN = Decision(True)


@dataclass
class PrefsPolicy:
    """Run or pause, from the preferences and the readings (pure; the caller passes the time).

    Idle without input readings: the other programs' CPU load must have stayed below
    ``idle_load_percent`` for ``idle_minutes``; the policy remembers when it last saw it above."""

    prefs: Prefs
    _busy_seen_at: float | None = field(default=None, init=False)
    _first_seen_at: float | None = field(default=None, init=False)
    _over_ceiling: tuple[float, float] | None = field(default=None, init=False)  # (when, load) last seen over

    def observe(self, readings: Readings, now: float) -> None:
        if self._first_seen_at is None:
            self._first_seen_at = now
        load = readings.other_cpu_load
        if load is not None and load * 100 >= self.prefs.idle_load_percent:
            self._busy_seen_at = now
        if load is not None and self.prefs.cpu_ceiling_percent and load * 100 > self.prefs.cpu_ceiling_percent:
            self._over_ceiling = (now, load)

    def decide(self, readings: Readings, now: datetime) -> Decision:
        """``now``: local, timezone-aware time (days and hours are the volunteer's local ones)."""
        p, ts = self.prefs, now.timestamp()
        day_cap, month_cap = p.max_daily_transfer_MB * 1e6, p.max_monthly_transfer_MB * 1e6
        if month_cap and readings.transfer_month_bytes >= month_cap:
            nxt = (now.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            return Decision(False, "transfer_month", f"monthly transfer cap reached: {readings.transfer_month_bytes / 1e6:.4g} MB "
                            f"of {p.max_monthly_transfer_MB:g} MB", relay=False, resume_at=nxt.timestamp())
        if day_cap and readings.transfer_day_bytes >= day_cap:
            nxt = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
            return Decision(False, "transfer_day", f"daily transfer cap reached: {readings.transfer_day_bytes / 1e6:.4g} MB "
                            f"of {p.max_daily_transfer_MB:g} MB", relay=False, resume_at=nxt.timestamp())
        relay = p.relay_while_paused
        days, window = parse_days(p.days), parse_hours(p.hours)
        if days is not None and now.weekday() not in days:
            start = _next_window_start(now, window, days)
            return Decision(False, "days", f"not an allowed day ({DAYS[now.weekday()]}; allowed: {p.days})", relay,
                            start.timestamp() if start else 0.0)
        if window is not None and not _in_window(now.hour * 60 + now.minute, window):
            start = _next_window_start(now, window, days)
            return Decision(False, "hours", f"outside the allowed hours ({now:%H:%M}; allowed: {p.hours})", relay,
                            start.timestamp() if start else 0.0)
        if p.pause_on_battery and readings.on_battery:
            return Decision(False, "on_battery", "running on battery", relay)
        over = self._over_ceiling
        if p.cpu_ceiling_percent and readings.other_cpu_load is not None and readings.other_cpu_load * 100 > p.cpu_ceiling_percent:
            over = (ts, readings.other_cpu_load)
        # resumed only after the load stayed under the ceiling for CPU_SETTLE_SAMPLES readings: a load
        # hovering at the ceiling would otherwise interrupt a task at every other reading
        if p.cpu_ceiling_percent and over is not None and ts - over[0] < CPU_SETTLE_SAMPLES * p.check_every_s:
            return Decision(False, "cpu_busy", f"other programs use {over[1] * 100:.0f}% of the CPUs "
                            f"(ceiling {p.cpu_ceiling_percent:g}%)", relay)
        if p.idle_minutes:
            need = p.idle_minutes * 60
            if readings.input_idle_s is not None:
                if readings.input_idle_s < need:
                    return Decision(False, "in_use", f"in use: last input {readings.input_idle_s:.0f} s ago "
                                    f"(runs after {p.idle_minutes:g} min idle)", relay, ts + need - readings.input_idle_s)
            else:
                since = self._busy_seen_at if self._busy_seen_at is not None else self._first_seen_at
                quiet = ts - since if since is not None else 0.0
                if quiet < need:
                    return Decision(False, "in_use", f"in use: other programs' CPU load was at or above "
                                    f"{p.idle_load_percent:g}% {quiet:.0f} s ago (runs after {p.idle_minutes:g} min under it; "
                                    "no keyboard/mouse reading here)", relay)
        return RUN


def threads_for(prefs: Prefs, cores: int, explicit: int = 0) -> int:
    """Torch threads: the explicit count if given, else max_cpu_percent of the cores (at least 1);
    0 = the library default (all cores, when no CPU share is set)."""
    share = 0 if prefs.max_cpu_percent >= 100 else max(1, int(cores * prefs.max_cpu_percent / 100))
    if explicit and share:
        return min(explicit, share)
    return explicit or share


def memory_cap_MiB(prefs: Prefs, configured_MiB: int = 0, accelerator_bytes: int = 0) -> int:
    """The tightest memory cap in MiB (0 = none): --memory-budget-MiB, max_memory_MiB, and on an
    accelerator the share of its memory gpu_memory_fraction gives the engine."""
    caps = [c for c in (configured_MiB, prefs.max_memory_MiB) if c > 0]
    if accelerator_bytes and prefs.gpu_memory_fraction:
        caps.append(int(accelerator_bytes * prefs.gpu_memory_fraction) // 1024**2)
    return min(caps, default=0)


# --- the file and the flags ------------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(Prefs)}


def _coerce(name: str, value: Any) -> Any:
    default = _FIELDS[name].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise PrefsError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PrefsError(f"{name} must be a number, got {value!r}")
        return int(value) if isinstance(default, int) and float(value).is_integer() else value
    if not isinstance(value, str):
        raise PrefsError(f"{name} must be a string, got {value!r}")
    return value


def merge_prefs(base: Prefs, overrides: dict[str, Any]) -> Prefs:
    """``base`` with ``overrides`` (None values are left out: a flag not given)."""
    changes = {}
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in _FIELDS:
            raise PrefsError(f"unknown preference {k!r} (known: {', '.join(_FIELDS)})")
        changes[k] = _coerce(k, v)
    return dataclasses.replace(base, **changes)


def load_prefs(path: Path) -> Prefs:
    """The ``[prefs]`` table of ``path`` (defaults when the file or the table is absent)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return Prefs()
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PrefsError(f"{path}: {exc}") from exc
    table = data.get(PREFS_TABLE, {})
    if not isinstance(table, dict):
        raise PrefsError(f"{path}: [{PREFS_TABLE}] must be a table")
    try:
        return merge_prefs(Prefs(), table)
    except PrefsError as exc:
        raise PrefsError(f"{path}: {exc}") from exc


class TransferMeter:
    """Bytes sent and received per local day and calendar month (pure: the caller passes the
    local date; persisted as a small dict so a restart does not reset the caps)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        s = state or {}
        self.day = str(s.get("day", ""))
        self.month = str(s.get("month", ""))
        self.day_bytes = int(s.get("day_bytes", 0))
        self.month_bytes = int(s.get("month_bytes", 0))

    def _roll(self, now: datetime) -> None:
        day, month = now.strftime("%Y-%m-%d"), now.strftime("%Y-%m")
        if day != self.day:
            self.day, self.day_bytes = day, 0
        if month != self.month:
            self.month, self.month_bytes = month, 0

    def add(self, n: int, now: datetime) -> None:
        self._roll(now)
        self.day_bytes += max(0, int(n))
        self.month_bytes += max(0, int(n))

    def totals(self, now: datetime) -> tuple[int, int]:
        self._roll(now)
        return self.day_bytes, self.month_bytes

    def state(self) -> dict[str, Any]:
        return {"day": self.day, "month": self.month, "day_bytes": self.day_bytes, "month_bytes": self.month_bytes}
