"""Placeholder (being written)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not yet implemented")
