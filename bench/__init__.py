"""Benchmarks: every one prints a short human table and writes JSON with --json."""
