"""Chunk size of a version, chosen from its size and the fleet (pure).

Two costs pull the chunk size ``c`` apart, both as fractions of the floor ``M/b``:

- the pipeline's fill: ``S·D`` chunk times (``S`` stripes, a plan ``D`` hops deep) pass before the
  last node's stream runs at full rate, ``S·D·c/M`` (the simulator matches ``1 + S·D/k``: N = 1000,
  32 MB, 128 chunks, S = 2, D = 10: predicted 1.156, simulated 1.154);
- per-chunk work: each chunk costs every node a frame, a hash, a file in its chunk store, an
  acknowledgement and the relay's bookkeeping, about ``h`` seconds that the link idles or the
  CPU is taken, ``h·b/c``. Measured on network namespaces with tbf at 8 MB/s (N = 8, 32 MB, the
  2-core machine shared with other jobs, load 14-19): 128 KiB chunks 2.34-3.21 x M/b, 256 KiB
  1.89, 512 KiB 1.60, 1 MiB 1.60-1.82, 2 MiB 2.13; a relay window in bytes instead of 2 chunks
  did not help 128 KiB (2.79, 3.21), so it is CPU per chunk, not data in flight. Measured again
  after the data plane's CPU per chunk came down (ready frames forwarded as received, 64 KiB
  unsent per relay link, tbf burst 128 KB; issue 18, 2026-12-04, same N, M and links, load 7-10,
  runs of two sizes interleaved, load 3-17): N = 8: 512 KiB 1.218-1.290 (9 runs, 12-15 CPU-s
  per relayed GB), 256 KiB 1.125-1.208 (13 runs, 16-21 CPU-s/GB), 384 KiB 1.175, 1.193 (15-16
  CPU-s/GB), 128 KiB 1.115 and 1.291 (29 CPU-s/GB: the two shared cores run out). N = 16 (17
  processes on the 2 cores): 512 KiB 1.253-1.370 (10 runs), 384 KiB 1.355, 1.445, 256 KiB
  1.230 and 1.273 at load 7-10 but 1.467-1.859 (6 runs) at load 9-17: there the per-chunk CPU
  decides. The fill costs more than ``S·D·c/M`` says (a hop also waits behind the relay's
  backlog on its link, ``bench broadcast --trace``), so at N = 8 a half-size chunk gained 0.09 x
  M/b where the model says 0.065.

The rule picks the size that minimises ``S·D·c/M + H/c`` (``H = h·b``, default
:data:`DEFAULT_PER_CHUNK_BYTES`, fitted to the runs above: ``c* = sqrt(H·M/(S·D))`` = 400 kB at
N = 8 and 358 kB at N = 16 for 32 MB: 384 KiB for both; 64 kB, the first fit, chose 512 KiB)
among powers of two and 1.5 times them (:func:`candidates`: the cost is flat near its optimum,
but a factor two apart its sides differ, 256 and 512 KiB above), within limits:

- in flight: a parent keeps at most ``window`` chunks outstanding per child, so a child's stream
  is capped at ``window · c / rtt``; a 10 MB/s link shared by ``S = 2`` children over a 50 ms
  round trip with window 2 needs ``c`` >= 125 kB (:func:`in_flight_min`);
- :data:`MIN_CHUNK_SIZE` bounds the per-chunk work from below, :data:`MAX_CHUNKS_PER_VERSION`
  the manifest (65536 entries: ~10 MB, a sixth of ``Manifest.MAX_SIZE``, far below the
  protocol's ``MAX_CHUNKS`` and the ChunkHave bitmap);
- memory: a chunk is decoded whole (``packing.MAX_CHUNK_SIZE`` = 64 MiB bounds one decode) and a
  node holds ``window`` chunks per child in flight; :data:`MAX_CHUNK_SIZE` = 16 MiB keeps that
  small; an encoded chunk also fits the data plane's default 32 MiB CHUNK frame (star path).

Resulting sizes: N = 8 or 16: 8 MB 192 KiB, 32 MB 384 KiB, 256 MB 1 MiB, 1 GB 2 MiB (k = 477),
16 GB 8 MiB; N = 1000: 8 MB 128 KiB (fill 0.35: small versions on deep plans stay costly),
32 MB 256 KiB, 256 MB 768 KiB, 1 GB 1.5 MiB, 16 GB 6 MiB.

A fleet that grows or shrinks a little keeps its chunk size: a delta version is packed against its
parent only if both have the same chunk size (``packing.pack_buffer``), so
:func:`stable_chunk_size` keeps the previous size while the rule's choice stays within a factor of
two of it.

The rule looks at raw bytes. A delta version's encoded chunks are much smaller (1.6% of raw for a
SmolLM2 step, ``packing``), but compression is about uniform over chunks, so the fill fraction
``S·D/k`` is the same on the wire.
"""

from __future__ import annotations

import math

KiB = 1024
MiB = 1024 * KiB

#: per-chunk cost as bytes of link time (h·b, 5 ms of an 8 MB/s link), see the module doc
DEFAULT_PER_CHUNK_BYTES = 40_000
MIN_CHUNK_SIZE = 64 * KiB
MAX_CHUNK_SIZE = 16 * MiB
MAX_CHUNKS_PER_VERSION = 65536
DEFAULT_STRIPES = 2  # the planner's default (learner_hub.planner.DEFAULT_STRIPES)
DEFAULT_WINDOW = 2  # the relay's default per-child window (protocol.relay)
DEFAULT_RTT_S = 0.05
DEFAULT_LINK_Bps = 10e6


def estimated_depth(n_nodes: int, stripes: int = DEFAULT_STRIPES) -> int:
    """Hops from the hub to the deepest node of a plan over ``n_nodes`` equal nodes: every
    interior node feeds about ``stripes`` children in its stripe, so ``1 + ceil(log_S N)``; an
    upper bound of the planner's depth for uniform fleets (N = 8: 4, N = 1000: 10 planned)."""
    if n_nodes <= 1:
        return 1
    s = max(2, stripes)
    return 1 + math.ceil(math.log(n_nodes, s) - 1e-9)


def candidates(lo: int, hi: int = MAX_CHUNK_SIZE) -> list[int]:
    """The sizes the rule weighs, ascending: powers of two from ``lo`` (one itself) to ``hi`` and
    1.5 times each (``3 · 2^(e-1)``, a whole number of 32 KiB for ``lo`` >= 64 KiB)."""
    out: list[int] = []
    c = lo
    while c <= hi:
        out.append(c)
        if c + c // 2 <= hi:
            out.append(c + c // 2)
        c *= 2
    return out


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, int(math.ceil(math.log2(max(x, 1.0)))))


def in_flight_min(
    *, link_Bps: float = DEFAULT_LINK_Bps, stripes: int = DEFAULT_STRIPES, rtt_s: float = DEFAULT_RTT_S,
    window: int = DEFAULT_WINDOW,
) -> int:
    """The smallest chunk that keeps a child's stream (``link/stripes``) busy over ``rtt_s``
    with ``window`` chunks outstanding, rounded up to a power of two."""
    return _pow2_ceil(link_Bps / max(1, stripes) * rtt_s / max(1, window))


def overhead(chunk_size: int, total_bytes: int, n_nodes: int, *, depth: int | None = None,
             stripes: int = DEFAULT_STRIPES, per_chunk_bytes: float = DEFAULT_PER_CHUNK_BYTES) -> float:
    """Predicted cost over ``M/b`` of ``chunk_size``: fill ``S·D·c/M`` plus per-chunk ``H/c``."""
    d = estimated_depth(n_nodes, stripes) if depth is None else max(1, depth)
    c = min(chunk_size, total_bytes)
    return max(1, stripes) * d * c / total_bytes + per_chunk_bytes / c


def choose_chunk_size(
    total_bytes: int,
    n_nodes: int,
    *,
    depth: int | None = None,
    stripes: int = DEFAULT_STRIPES,
    per_chunk_bytes: float = DEFAULT_PER_CHUNK_BYTES,
    min_chunk: int | None = None,
) -> int:
    """Chunk size (bytes, a power of two or 1.5 times one) for a version of ``total_bytes`` raw bytes broadcast to
    ``n_nodes`` nodes over a plan ``depth`` hops deep (default :func:`estimated_depth`): the one
    of least :func:`overhead` within ``[min_chunk, MAX_CHUNK_SIZE]`` (``min_chunk`` default: the
    larger of :data:`MIN_CHUNK_SIZE` and :func:`in_flight_min`) and at most
    :data:`MAX_CHUNKS_PER_VERSION` chunks."""
    if total_bytes <= 0:
        raise ValueError("total_bytes must be positive")
    if per_chunk_bytes < 0:
        raise ValueError("per_chunk_bytes must be >= 0")
    lo = max(MIN_CHUNK_SIZE, in_flight_min(stripes=stripes)) if min_chunk is None else max(1, min_chunk)
    lo = _pow2_ceil(lo)
    while -(-total_bytes // lo) > MAX_CHUNKS_PER_VERSION and lo < MAX_CHUNK_SIZE:
        lo *= 2
    best, best_cost = lo, math.inf
    for c in candidates(lo):
        cost = overhead(c, total_bytes, n_nodes, depth=depth, stripes=stripes, per_chunk_bytes=per_chunk_bytes)
        if cost < best_cost - 1e-12:
            best, best_cost = c, cost
        if c >= total_bytes:
            break  # one chunk already: bigger sizes change nothing
    return best


def stable_chunk_size(previous: int | None, chosen: int) -> int:
    """Keep ``previous`` (so the next version can still be a delta of it) unless ``chosen`` is
    more than a factor two away from it."""
    if previous and previous > 0 and chosen / 2 <= previous <= chosen * 2:
        return previous
    return chosen
