"""The one logging configuration point for every echo2 process."""

from __future__ import annotations

import logging
import os
import sys
import warnings

_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def configure(level: str | int | None = None, *, json_mode: bool = False) -> None:
    """Configure the root logger once; later calls only change the level.

    py-libp2p emits warnings and chatty INFO logs around the host's configuration, so its
    loggers are capped at WARNING unless ECHO2_LIBP2P_DEBUG is set.
    """
    if level is None:
        level = os.environ.get("ECHO2_LOG", "INFO")
    root = logging.getLogger()
    if not getattr(configure, "_done", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.handlers[:] = [handler]
        logging.captureWarnings(True)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        configure._done = True  # type: ignore[attr-defined]
    root.setLevel(level if isinstance(level, int) else level.upper())
    if not os.environ.get("ECHO2_LIBP2P_DEBUG"):
        for name in ("libp2p", "multiaddr", "trio", "asyncio", "urllib3", "filelock", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if json_mode:
        # machine output goes to stdout; keep stderr for humans but quieter
        root.setLevel(max(root.level, logging.WARNING))
