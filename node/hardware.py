"""What this machine has: a cheap probe for the Announce (issue 7 deepens it)."""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    accelerator: str
    accelerator_count: int
    accelerator_memory_bytes: int
    cpu_model: str
    cpu_cores: int
    ram_bytes: int
    free_disk_bytes: int


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()[:120]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "unknown")[:120]


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def probe(data_dir: Path) -> Hardware:
    accel, count, mem = "", 0, 0
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            accel, mem = str(props.name)[:120], int(props.total_memory)
    except Exception:  # a broken CUDA install must not stop a CPU node
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    return Hardware(
        accelerator=accel,
        accelerator_count=count,
        accelerator_memory_bytes=mem,
        cpu_model=_cpu_model(),
        cpu_cores=max(1, os.cpu_count() or 1),
        ram_bytes=_ram_bytes(),
        free_disk_bytes=int(shutil.disk_usage(data_dir).free),
    )
