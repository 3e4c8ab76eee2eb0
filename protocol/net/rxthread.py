"""Receive and hash a large frame body on a worker thread.

Why: a relay (and the hub's probe service) receives chunks and sends chunks on the same trio
thread, and receiving plus verifying a chunk costs as much CPU as sending one: the recv copies
(~15 % of a loopback transfer here) and blake3 (~25 %) would otherwise share one core with the
sends. The socket calls and blake3 both release the GIL, so a worker thread that reads the body
and hashes each piece as it lands (still in the CPU cache) runs on another core, while the trio
thread goes on sending.

Safety: the worker reads from its own duplicate of the socket's file descriptor, so closing the
connection on the trio side can never make it read from a recycled descriptor; it waits with
``poll`` in short slices and gives up as soon as ``stop`` is set (cancellation, timeout, abort).
The trio side always waits (shielded, a few milliseconds at most) for the worker to finish, so
the worker never outlives the buffer or the connection. Exceptions reach the caller unwrapped
(no nursery: the worker comes from trio's thread cache, ``trio.lowlevel.start_thread_soon``,
the primitive under ``trio.to_thread``).
"""

from __future__ import annotations

import os
import select
import socket
import threading

import outcome
import trio

from ..hashing import Hasher, new_hasher
from .sockopts import set_rcvlowat

#: How often a waiting worker looks at its stop flag (it also wakes as soon as data arrives).
POLL_SLICE_MS = 20

#: Bodies at least this big are received on a worker thread; smaller ones in the trio thread
#: (a thread hand-off costs tens of microseconds; a 64 KiB body takes 8 ms to arrive at 8 MB/s).
#: Was 1 MiB, which left the 512 KiB chunks of a 32 MB version to the trio thread: there each
#: chunk took ~44 wake-ups (one per ~12 KB that had landed, each a trip through trio's loop),
#: about a third of a relay's CPU (cProfile of 8 relays on tbf-shaped namespaces, 8 MB/s).
THREAD_MIN_BYTES = 64 * 1024

#: While a body arrives, the worker asks the kernel (``SO_RCVLOWAT``) to wake it only once this
#: much of it has landed (or the rest of the body, if less; EOF and errors wake it at once). At
#: 8 MB/s that is one wake-up per 32 ms instead of one per TCP segment or two. Linux raises the
#: socket's receive buffer to twice the mark when it is smaller, so the sender is never starved.
RCVLOWAT_BYTES = 256 * 1024


#: At most this many bodies are received on worker threads at once in a process; past it, a
#: body is received in the trio thread as before. Threads come from trio's cache, which has no
#: cap of its own, and a server may hold hundreds of connections.
MAX_WORKERS = 16

_active = 0
_active_lock = threading.Lock()  # trio runs in several threads of one process are allowed


def supported() -> bool:
    """The worker needs ``poll`` and descriptors that ``os.dup`` can copy (POSIX)."""
    return os.name == "posix" and hasattr(select, "poll")


def try_take_worker() -> bool:
    """Reserve a worker slot; ``False`` when all are busy. Pair with :func:`release_worker`."""
    global _active
    with _active_lock:
        if _active >= MAX_WORKERS:
            return False
        _active += 1
        return True


def release_worker() -> None:
    global _active
    with _active_lock:
        assert _active > 0, "release_worker() without try_take_worker()"
        _active -= 1


class PeerClosed(Exception):
    """EOF before the body was complete."""


class Stopped(Exception):
    """The trio side asked the worker to give up."""


class ThreadedReceive:
    """Fill ``view`` from the socket ``fd`` and blake3 it, on a worker thread.

    ``start()`` then ``await wait()`` returns the digest of everything fed to ``hasher`` (a fresh one by
    default; pass one to hash a body received in several buffers); it raises ``PeerClosed``, ``Stopped`` or the
    ``OSError`` the read raised. ``received`` is how many bytes landed (also on error), for
    accounting.
    """

    def __init__(self, fd: int, view: memoryview, max_read: int, hasher: Hasher | None = None) -> None:
        # Our own descriptor, taken here in the trio thread while ``fd`` is surely still the
        # connection's: the trio side may close its socket while the worker still runs, and the
        # number could then be recycled for another connection. Raises ``OSError`` (EMFILE...):
        # nothing was read yet, so the caller can fall back to receiving in the trio thread.
        dup = os.dup(fd)
        try:
            self._sock = socket.socket(fileno=dup)
        except BaseException:
            os.close(dup)
            raise
        # Never block in the kernel (``socket.setdefaulttimeout`` would make it do so); the
        # descriptor is non-blocking already (trio's), so this changes no shared flag.
        self._sock.setblocking(False)
        self._hasher = hasher if hasher is not None else new_hasher()
        self._view = view
        self._max_read = max_read
        self.received = 0
        self.stop = threading.Event()
        self._done = trio.Event()
        self._result: outcome.Outcome[bytes] | None = None
        self._started = False

    def _work(self) -> bytes:
        view, total, max_read, hasher = self._view, len(self._view), self._max_read, self._hasher
        sock = self._sock
        lowat = 1  # the socket's (shared with the trio side's descriptor) while we set it
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            got = 0
            while got < total:
                if self.stop.is_set():
                    raise Stopped()
                want = min(total - got, RCVLOWAT_BYTES)
                if want != lowat:
                    lowat = set_rcvlowat(sock, want)
                try:
                    n = sock.recv_into(view[got : got + max_read])
                except (BlockingIOError, InterruptedError):
                    poller.poll(POLL_SLICE_MS)
                    continue
                if n == 0:
                    raise PeerClosed()
                hasher.update(view[got : got + n])
                got += n
                self.received = got
            return hasher.digest()
        finally:
            if lowat != 1:
                set_rcvlowat(sock, 1)  # the next frame may be a small one: wake the trio side for any byte
            sock.close()  # closes the duplicate only; the connection's own descriptor stays

    def start(self) -> None:
        """Hand the receive to a worker thread. Raises ``RuntimeError`` when none can be
        started (the descriptor is then released and nothing was read)."""
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[bytes]) -> None:
            self._result = result
            token.run_sync_soon(self._done.set)

        try:
            trio.lowlevel.start_thread_soon(self._work, deliver, name="echo2 chunk receiver")
        except BaseException:
            self._sock.close()
            raise
        self._started = True

    async def wait(self) -> bytes:
        """The digest once the body is in; on cancellation, stop the worker and wait for it
        (shielded, at most one poll slice plus one read) before re-raising."""
        assert self._started, "start() first"
        try:
            await self._done.wait()
        except BaseException:
            self.stop.set()
            with trio.CancelScope(shield=True):
                await self._done.wait()
            raise
        assert self._result is not None
        return self._result.unwrap()


__all__ = [
    "MAX_WORKERS",
    "POLL_SLICE_MS",
    "RCVLOWAT_BYTES",
    "THREAD_MIN_BYTES",
    "PeerClosed",
    "Stopped",
    "ThreadedReceive",
    "release_worker",
    "supported",
    "try_take_worker",
]
