"""Chunk size of a version, chosen from its size and the fleet (pure).

The pipelined broadcast takes about ``M/b · (1 + S·D/k)`` for ``k`` chunks, ``S`` stripes and a
plan ``D`` hops deep: ``S·D`` chunk times fill the pipeline before the last node's stream runs at
full rate (the simulator matches this within 1%: N = 1000, 32 MB, 128 chunks, S = 2, D = 10:
predicted 1.156, simulated 1.154). So the fill is a fraction ``S·D/k`` of ``M/b`` whatever ``b``
is, and the rule aims at a number of chunks, ``k ≥ S·D / fill``, not at a size.

Three limits keep chunks from getting too small or too many:

- in flight: a parent keeps at most ``window`` chunks outstanding per child (the relay's flow
  control), so a child's stream is capped at ``window · c / rtt``; with the defaults (a 10 MB/s
  link shared by ``S = 2`` children, 50 ms round trip, window 2) ``c`` must be at least 125 kB;
- per-chunk work: each chunk costs a manifest entry (~150 bytes), a file in the node's chunk
  store, a hash and an acknowledgement; :data:`MIN_CHUNK_SIZE` bounds it from below and
  :data:`MAX_CHUNKS_PER_VERSION` bounds the manifest (65536 entries: ~10 MB, a sixth of
  ``Manifest.MAX_SIZE``, and far below the protocol's ``MAX_CHUNKS`` and ChunkHave bitmap);
- memory: a chunk is decoded whole (``packing.MAX_CHUNK_SIZE`` = 64 MiB bounds one decode), and
  a node holds ``window`` chunks per child in flight; :data:`MAX_CHUNK_SIZE` = 16 MiB keeps that
  small and leaves ≥ 1000 chunks even at 16 GB.

Sizes are powers of two, so that a fleet that grows or shrinks a little keeps its chunk size: a
delta version is packed against its parent only if both have the same chunk size
(``packing.pack``), so :func:`stable_chunk_size` also keeps the previous size while the rule's
choice stays within a factor of two of it.

The rule looks at raw bytes. A delta version's encoded chunks are much smaller (1.6% of raw for a
SmolLM2 step, ``packing``), but compression is about uniform over chunks, so the fill fraction
``S·D/k`` is the same on the wire.
"""

from __future__ import annotations

import math

KiB = 1024
MiB = 1024 * KiB

#: fill of the pipeline against ``M/b`` the rule aims at (``S·D/k``)
DEFAULT_FILL = 0.05
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


def choose_chunk_size(
    total_bytes: int,
    n_nodes: int,
    *,
    depth: int | None = None,
    stripes: int = DEFAULT_STRIPES,
    fill: float = DEFAULT_FILL,
    min_chunk: int | None = None,
) -> int:
    """Chunk size (bytes, a power of two) for a version of ``total_bytes`` raw bytes broadcast to
    ``n_nodes`` nodes over a plan ``depth`` hops deep (default :func:`estimated_depth`).

    Aims at ``k ≥ stripes · depth / fill`` chunks, within ``[min_chunk, MAX_CHUNK_SIZE]``
    (``min_chunk`` default: the larger of :data:`MIN_CHUNK_SIZE` and :func:`in_flight_min`) and
    at most :data:`MAX_CHUNKS_PER_VERSION` chunks."""
    if total_bytes <= 0:
        raise ValueError("total_bytes must be positive")
    if not 0 < fill < 1:
        raise ValueError("fill must be in (0, 1)")
    d = estimated_depth(n_nodes, stripes) if depth is None else max(1, depth)
    s = max(1, stripes)
    k_target = math.ceil(s * d / fill)
    lo = max(MIN_CHUNK_SIZE, in_flight_min(stripes=s)) if min_chunk is None else max(1, min_chunk)
    c = _pow2_floor(total_bytes / k_target)
    c = min(max(c, lo), MAX_CHUNK_SIZE)
    while -(-total_bytes // c) > MAX_CHUNKS_PER_VERSION and c < MAX_CHUNK_SIZE:
        c *= 2
    return c


def stable_chunk_size(previous: int | None, chosen: int) -> int:
    """Keep ``previous`` (so the next version can still be a delta of it) unless ``chosen`` is
    more than a factor two away from it."""
    if previous and previous > 0 and chosen / 2 <= previous <= chosen * 2:
        return previous
    return chosen
