"""Command-line entry (filled by later work)."""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_subparsers(dest="sub", metavar="{}")
