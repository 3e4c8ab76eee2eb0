"""Computing preferences (issue 19): the pure policy, the file and flags, and the OS readers."""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from echo2.node.pausing import effective_prefs
from echo2.node.prefs import (
    Decision,
    Prefs,
    PrefsError,
    PrefsPolicy,
    Readings,
    TransferMeter,
    load_prefs,
    parse_days,
    parse_hours,
    threads_for,
)
from echo2.node.prefs_cli import add_pref_flags, pref_overrides
from echo2.node.sysread import SystemReader, cpu_jiffies, input_interrupts, on_battery, own_jiffies

TZ = timezone(timedelta(hours=2))
WED_10 = datetime(2026, 12, 2, 10, 30, tzinfo=TZ)  # a Wednesday


def decide(prefs: Prefs, now: datetime = WED_10, **readings: Any) -> Decision:
    return PrefsPolicy(prefs).decide(Readings(**readings), now)


def test_hours_and_days_parse_and_wrap() -> None:
    assert parse_hours("") is None and parse_hours("0-24") is None
    assert parse_hours("22-7") == (22 * 60, 7 * 60) and parse_hours("9:30-17") == (570, 1020)
    assert parse_days("mon-fri") == frozenset(range(5)) and parse_days("fri-mon") == frozenset({4, 5, 6, 0})
    assert parse_days("sat, Sunday") == frozenset({5, 6})
    for bad in ("22", "25-3", "9:75-10", "a-b"):
        with pytest.raises(PrefsError, match="hours"):
            parse_hours(bad)
    with pytest.raises(PrefsError, match="not a day"):
        parse_days("mon-xyz")


def test_time_windows_pause_with_reason_and_resume_time() -> None:
    assert decide(Prefs(hours="9-17")).run
    d = decide(Prefs(hours="22-7"))
    assert not d.run and d.code == "hours" and "10:30" in d.reason and "22-7" in d.reason
    assert datetime.fromtimestamp(d.resume_at, TZ) == WED_10.replace(hour=22, minute=0)
    assert decide(Prefs(hours="22-7"), WED_10.replace(hour=23)).run
    assert decide(Prefs(hours="22-7"), WED_10.replace(hour=6, minute=59)).run
    d = decide(Prefs(days="sat,sun", hours="8-12"))
    assert d.code == "days"
    assert datetime.fromtimestamp(d.resume_at, TZ) == datetime(2026, 12, 5, 8, 0, tzinfo=TZ)


def test_load_battery_and_transfer() -> None:
    p = Prefs(cpu_ceiling_percent=50)
    assert decide(p, other_cpu_load=0.4).run
    d = decide(p, other_cpu_load=0.8)
    assert d.code == "cpu_busy" and "80%" in d.reason and d.relay
    assert decide(p, other_cpu_load=None).run  # unreadable: not applied
    assert decide(Prefs(), on_battery=True).code == "on_battery"
    assert decide(Prefs(pause_on_battery=False), on_battery=True).run
    d = decide(Prefs(max_daily_transfer_MB=100, relay_while_paused=True), transfer_day_bytes=150_000_000)
    assert d.code == "transfer_day" and "150 MB of 100 MB" in d.reason and not d.relay
    assert datetime.fromtimestamp(d.resume_at, TZ) == datetime(2026, 12, 3, tzinfo=TZ)
    d = decide(Prefs(max_monthly_transfer_MB=1000), transfer_month_bytes=10**9)
    assert d.code == "transfer_month"
    assert datetime.fromtimestamp(d.resume_at, TZ) == datetime(2027, 1, 1, tzinfo=TZ)
    assert not decide(Prefs(hours="22-7", relay_while_paused=False)).relay


def test_idle_by_input_or_by_other_programs_load() -> None:
    p = Prefs(idle_minutes=5, idle_load_percent=10)
    assert decide(p, input_idle_s=301).run
    d = decide(p, input_idle_s=30)
    assert d.code == "in_use" and d.resume_at == pytest.approx(WED_10.timestamp() + 270)
    # no input reading: the other programs' load must stay under 10% for 5 minutes
    pol, t0 = PrefsPolicy(p), WED_10.timestamp()
    for dt, load in ((0, 0.02), (120, 0.5), (300, 0.02), (419, 0.03)):
        pol.observe(Readings(other_cpu_load=load), t0 + dt)
    assert pol.decide(Readings(other_cpu_load=0.03), WED_10 + timedelta(seconds=419)).code == "in_use"
    pol.observe(Readings(other_cpu_load=0.01), t0 + 421)
    assert pol.decide(Readings(other_cpu_load=0.01), WED_10 + timedelta(seconds=421)).run


def test_transfer_meter_rolls_over_days_and_months() -> None:
    m = TransferMeter()
    m.add(10, WED_10)
    m.add(5, WED_10 + timedelta(hours=1))
    assert m.totals(WED_10) == (15, 15)
    assert m.totals(WED_10 + timedelta(days=1)) == (0, 15)
    m2 = TransferMeter(m.state())  # persisted across a restart
    m2.add(1, datetime(2027, 1, 1, tzinfo=TZ))
    assert (m2.day_bytes, m2.month_bytes) == (1, 1)


def test_file_then_flags_and_bad_values(tmp_path: Path) -> None:
    (tmp_path / "node.toml").write_text('[prefs]\nhours = "22-7"\nmax_cpu_percent = 50\ncpu_ceiling_percent = 70\n')
    parser = argparse.ArgumentParser()
    add_pref_flags(parser)
    args = parser.parse_args(["--max-cpu-percent", "25", "--no-pause-on-battery"])
    p = effective_prefs(tmp_path, pref_overrides(args))
    assert (p.hours, p.max_cpu_percent, p.cpu_ceiling_percent, p.pause_on_battery) == ("22-7", 25, 70, False)
    assert load_prefs(tmp_path / "absent.toml") == Prefs()
    (tmp_path / "node.toml").write_text("[prefs]\nmax_cpu_prcent = 50\n")
    with pytest.raises(PrefsError, match="unknown preference 'max_cpu_prcent'"):
        load_prefs(tmp_path / "node.toml")
    (tmp_path / "node.toml").write_text("[prefs]\nmax_cpu_percent = 150\n")
    with pytest.raises(PrefsError, match="max_cpu_percent"):
        load_prefs(tmp_path / "node.toml")
    with pytest.raises(SystemExit, match="gpu_memory_fraction"):
        pref_overrides(parser.parse_args(["--gpu-memory-fraction", "1.5"]))
    assert threads_for(Prefs(max_cpu_percent=50), 16) == 8 and threads_for(Prefs(), 16) == 0
    assert threads_for(Prefs(max_cpu_percent=10), 4) == 1 and threads_for(Prefs(max_cpu_percent=50), 16, 4) == 4


INTERRUPTS = """           CPU0       CPU1
   1:         10          2   IO-APIC    1-edge      i8042
  12:        100         20   IO-APIC   12-edge      i8042
  16:       5000       6000   IO-APIC   16-fasteoi   ehci_hcd:usb1
"""


def test_readers_parse_what_linux_writes(tmp_path: Path) -> None:
    assert input_interrupts(INTERRUPTS) == 132
    assert input_interrupts(INTERRUPTS.replace("i8042", "ahci")) is None  # a server: no input line
    assert cpu_jiffies("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n") == (150, 1000)
    assert own_jiffies("42 (python (x) y) S 1 2 3 4 5 6 7 8 9 10 30 12 0 0 20") == 42
    power = tmp_path / "power"
    assert on_battery(power) is None
    (power / "AC").mkdir(parents=True)
    (power / "AC" / "type").write_text("Mains\n")
    (power / "AC" / "online").write_text("0\n")
    (power / "BAT0").mkdir()
    (power / "BAT0" / "type").write_text("Battery\n")
    (power / "BAT0" / "status").write_text("Discharging\n")
    assert on_battery(power) is True
    (power / "AC" / "online").write_text("1\n")
    assert on_battery(power) is False


def test_system_reader_counts_other_programs_load_not_its_own(tmp_path: Path) -> None:
    import os

    proc = tmp_path / "proc"
    (proc / str(os.getpid())).mkdir(parents=True)

    def write(busy: int, idle: int, own: int, irq: int) -> None:
        (proc / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\n")
        (proc / str(os.getpid()) / "stat").write_text(f"1 (node) R 0 0 0 0 0 0 0 0 0 0 {own} 0 0 0\n")
        (proc / "interrupts").write_text(INTERRUPTS.replace("100", str(irq)))

    r = SystemReader(proc=proc, power=tmp_path / "none")
    write(1000, 1000, 500, 100)
    first = r.read()
    assert first.other_cpu_load is None and first.on_battery is None and first.input_idle_s is not None
    write(1600, 1400, 900, 100)  # 600 busy of 1000 jiffies, 400 of them ours
    assert r.read().other_cpu_load == pytest.approx(0.2)
    write(1700, 2300, 920, 140)  # input arrived: idle time starts again
    rd = r.read()
    assert rd.other_cpu_load == pytest.approx(0.08) and rd.input_idle_s is not None and rd.input_idle_s < 0.5


def test_cpu_ceiling_resumes_only_after_the_load_settles() -> None:
    pol, t0 = PrefsPolicy(Prefs(cpu_ceiling_percent=50, check_every_s=2)), WED_10.timestamp()
    pol.observe(Readings(other_cpu_load=0.9), t0)
    calm = Readings(other_cpu_load=0.1)
    for dt in (2, 4):
        pol.observe(calm, t0 + dt)
        d = pol.decide(calm, WED_10 + timedelta(seconds=dt))
        assert d.code == "cpu_busy" and "90%" in d.reason, dt
    pol.observe(calm, t0 + 6)
    assert pol.decide(calm, WED_10 + timedelta(seconds=6)).run


def test_disk_cap_refuses_a_version_that_would_not_fit() -> None:
    from echo2.models import spec as ms
    from echo2.models import statedict
    from echo2.node.relay_state import RelayConfig, budget_refusal

    cj, arts = ms.artifacts_for(ms.tiny_config(hidden=32, layers=1, heads=2), ms.tokenizer_json())
    m = statedict.pack_version(ms.model_from_config(cj).state_dict(), version=1, parent=None, model_config=cj,
                               artifacts=arts).manifest
    free = 1 << 40
    assert budget_refusal(m, RelayConfig(), missing_bytes=m.total_bytes, free_disk=free, stored_bytes=10**9) is None
    cap = RelayConfig(max_disk_bytes=m.total_bytes + 1000)
    assert budget_refusal(m, cap, missing_bytes=m.total_bytes, free_disk=free, stored_bytes=0) is None
    why = budget_refusal(m, cap, missing_bytes=m.total_bytes, free_disk=free, stored_bytes=2000)
    assert why is not None and "disk cap" in why and str(m.total_bytes + 1000) in why
