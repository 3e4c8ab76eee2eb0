"""Demotion on evidence only (A9): an accused relay is asked to serve the hub a chunk.

A node's report that its parent relayed a corrupt chunk is an accusation: the relayed bytes carry
no signature of the relay, so any admitted node could name an honest parent. The hub therefore
does not distrust on the report; it makes the accused a *suspect* and asks it, on the hub's own
data link, for a chunk it advertised (the one reported when it still can, else one drawn with
the hub's secret RNG). What comes back is evidence the hub saw itself: bytes that do not match
the hub-signed manifest are proof that the accused serves corrupt chunks, and only then is it
distrusted; an intact chunk clears the accusation. A suspect that never answers stays a suspect
(asked again later), never distrusted on silence. (A relay corrupting only what it sends to other
nodes escapes demotion; its children verify every chunk and route around it all the same.)
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from echo2.protocol import packing
from echo2.protocol.errors import ChunkMismatch, ManifestError
from echo2.protocol.messages import ManifestChunk
from echo2.protocol.wire import ENC_MANIFEST

log = logging.getLogger(__name__)

MAX_SUSPECTS = 4096  # accusations come only about admitted nodes; this bounds the map regardless
CHALLENGE_TIMEOUT_S = 10.0


@dataclass
class Challenge:
    version: int
    index: int
    sent_at: float


class Challenges:
    """Suspects and the challenge in flight to each (pure bookkeeping; the sender does the I/O)."""

    def __init__(self, *, timeout_s: float = CHALLENGE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.suspects: dict[str, tuple[str, int | None]] = {}  # peer -> (why, reported index)
        self.pending: dict[str, Challenge] = {}
        self._rng = random.SystemRandom()  # the accused must not predict which chunk is asked

    def accuse(self, peer: str, why: str, index: int | None = None) -> bool:
        """Record an accusation; False when the map is full (the accusation is dropped)."""
        if peer not in self.suspects and len(self.suspects) >= MAX_SUSPECTS:
            log.warning("too many suspects: accusation of %s dropped", peer)
            return False
        self.suspects[peer] = (why, index)
        return True

    def next(self, peer: str, version: int, advertised: set[int], now: float) -> Challenge | None:
        """The challenge to send ``peer`` now, if it is a suspect with none in flight (or one
        that timed out) and it advertised a chunk of ``version``."""
        if peer not in self.suspects or not advertised:
            return None
        ch = self.pending.get(peer)
        if ch is not None and now - ch.sent_at < self.timeout_s:
            return None
        _, reported = self.suspects[peer]
        index = reported if reported is not None and reported in advertised else self._rng.choice(sorted(advertised))
        ch = self.pending[peer] = Challenge(version, index, now)
        return ch

    def answer(self, peer: str, version: int, index: int) -> Challenge | None:
        """The challenge a chunk frame from ``peer`` answers (taken out of flight), or None."""
        ch = self.pending.get(peer)
        if ch is None or (ch.version, ch.index) != (version, index):
            return None
        del self.pending[peer]
        return ch

    def clear(self, peer: str) -> None:
        self.suspects.pop(peer, None)
        self.pending.pop(peer, None)


def intact(entry: ManifestChunk, flag: int, data: bytes, *, bf16_split: bool) -> bool:
    """Do ``data`` (as served, with its encoding flag) match the manifest's chunk? (A full
    encoding is decoded and its raw hash checked: call it off the event loop.)"""
    try:
        if flag == ENC_MANIFEST:
            packing.verify_encoded(entry, data)
        else:
            packing.decode_full_fallback(entry, data, bf16_split=bf16_split)
    except (ChunkMismatch, ManifestError):
        return False
    return True
