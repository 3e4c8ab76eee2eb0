"""``echo2 demo`` (filled by the loop work)."""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    pass
