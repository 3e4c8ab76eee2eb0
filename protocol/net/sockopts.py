"""Socket options the data plane tunes, best effort: a platform without one keeps its default."""

from __future__ import annotations

import socket
from typing import Protocol


class _Sock(Protocol):  # a stdlib socket or trio's
    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def set_rcvlowat(sock: _Sock, n: int) -> int:
    """Set ``SO_RCVLOWAT``; returns what is in force (1, the default, where it cannot be set)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
    except OSError:
        return 1
    return n


def set_notsent_lowat(sock: _Sock, n: int) -> None:
    """Keep at most about ``n`` bytes written but not yet sent in the kernel (TCP_NOTSENT_LOWAT:
    the socket is writable again only below it), so that a send that returned is mostly on the wire."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25), n)
    except (OSError, AttributeError):
        pass
