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

#: How often a waiting worker looks at its stop flag (it also wakes as soon as data arrives).
POLL_SLICE_MS = 20

#: Bodies at least this big are received on a worker thread; smaller ones in the trio thread
#: (a thread hand-off costs tens of microseconds, a 4 MiB chunk about two milliseconds).
THREAD_MIN_BYTES = 1024 * 1024


#: At most this many bodies are received on worker threads at once in a process; past it, a
#: body is received in the trio thread as before. Threads come from trio's cache, which has no
#: cap of its own, and a server may hold hundreds of connections.
MAX_WORKERS = 16

_active = 0


def try_take_worker() -> bool:
    """Reserve a worker slot; ``False`` when all are busy. Pair with :func:`release_worker`."""
    global _active
    if _active >= MAX_WORKERS:
        return False
    _active += 1
    return True


def release_worker() -> None:
    global _active
    _active = max(0, _active - 1)


class PeerClosed(Exception):
    """EOF before the body was complete."""


class Stopped(Exception):
    """The trio side asked the worker to give up."""


class ThreadedReceive:
    """Fill ``view`` from the socket ``fd`` and blake3 it, on a worker thread.

    ``await run()`` returns the digest of everything fed to ``hasher`` (a fresh one by
    default; pass one to hash a body received in several buffers); it raises ``PeerClosed``, ``Stopped`` or the
    ``OSError`` the read raised. ``received`` is how many bytes landed (also on error), for
    accounting.
    """

    def __init__(self, fd: int, view: memoryview, max_read: int, hasher: Hasher | None = None) -> None:
        self._fd = fd
        self._hasher = hasher if hasher is not None else new_hasher()
        self._view = view
        self._max_read = max_read
        self.received = 0
        self.stop = threading.Event()
        self._done = trio.Event()
        self._result: outcome.Outcome[bytes] | None = None

    def _work(self) -> bytes:
        view, total, max_read, hasher = self._view, len(self._view), self._max_read, self._hasher
        # Our own descriptor: the trio side may close its socket while we are still here.
        sock = socket.socket(fileno=os.dup(self._fd))
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            got = 0
            while got < total:
                if self.stop.is_set():
                    raise Stopped()
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
            # The socket object must not close what the kernel shares with the trio side's
            # descriptor beyond our duplicate: close() on a dup closes only the dup.
            sock.close()

    async def run(self) -> bytes:
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[bytes]) -> None:
            self._result = result
            token.run_sync_soon(self._done.set)

        trio.lowlevel.start_thread_soon(self._work, deliver, name="echo2 chunk receiver")
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
    "THREAD_MIN_BYTES",
    "PeerClosed",
    "Stopped",
    "ThreadedReceive",
    "release_worker",
    "try_take_worker",
]
