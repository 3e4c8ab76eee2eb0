"""How many admission requests the hub opens, per address and per key (sans-IO, no clock of its own).

Checked first in ``Hub.on_admission``, before the envelope is opened: a refused request costs no
signature check and leaves no nonce in any replay guard (A3/A11).

Session 9 had one bucket per IP for every admission request (5/s, burst 20). Under open
admission each throwaway key it let through was admitted, and an address with admitted peers
was then exempt from the stranger connection gate (protocol/net/conngate.py): the flood of bench
attack A3 had 164 keys admitted in 33 s, each costing the hub ~20-23 ms of CPU (Noise, identify,
gossip) and ~1 ms of admission, ~12 % of the victims' shared core. Two kinds of request are now
told apart by the requester's peer ID (authenticated by Noise, so known before any decoding):

* **a new identity** (no admission of it known to this hub): per address, ``new_burst`` at once
  then ``new_per_s``. This is the bound on keys minted from one address. Its cost for an honest
  fleet behind one NAT address joining for the first time: 100 fresh nodes get in within
  ``(100 - new_burst) / new_per_s`` = 136 s with the defaults (32 at once, then one each 2 s; a
  refused node retries on its backoff, on its open connection).
* **a known key** (admitted by this hub before: in this process, or in the store's nodes table
  when the hub started, so a hub restart does not make its fleet new): per key ``key_per_s``
  (burst ``key_burst``) and per address ``known_per_s`` (burst ``known_burst``). An honest node
  asks once at start, then once per hub restart or after it was dropped as silent, so 100 known
  nodes behind one address re-admit at once (burst 256); the address bound keeps a patient
  attacker's collection of old keys from becoming a rate of its own.

Bounded: at most ``max_known`` known keys (least recently admitted dropped first; a dropped key
is merely new again) and ``max_keys`` buckets per table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from echo2.protocol.errors import RateLimited
from echo2.protocol.peerlimit import KeyedRateLimiter

__all__ = ["AdmissionGate", "AdmissionLimits", "known_peers"]


def known_peers(store: Any, limit: int) -> list[str]:
    """The store's (a HubStore's) known peers, most recently seen first: what a restarted hub's
    gate starts from (banned ones stay out; a ban is decided after the gate anyway)."""
    rows = store._read("SELECT peer_id FROM nodes WHERE banned = 0 ORDER BY last_seen DESC LIMIT ?", (int(limit),))
    return [str(r[0]) for r in rows]


@dataclass(frozen=True)
class AdmissionLimits:
    new_per_s: float = 0.5
    new_burst: float = 32.0
    known_per_s: float = 10.0
    known_burst: float = 256.0
    key_per_s: float = 0.5
    key_burst: float = 4.0
    max_known: int = 100_000
    max_keys: int = 100_000


class AdmissionGate:
    """Counts admission requests by kind (new identity or known key) per address and per key."""

    def __init__(self, limits: AdmissionLimits | None = None, known: Iterable[str] = ()) -> None:
        self.limits = lim = limits or AdmissionLimits()
        self._new = KeyedRateLimiter(lim.new_per_s, lim.new_burst, max_keys=lim.max_keys)
        self._known_ip = KeyedRateLimiter(lim.known_per_s, lim.known_burst, max_keys=lim.max_keys)
        self._key = KeyedRateLimiter(lim.key_per_s, lim.key_burst, max_keys=lim.max_keys)
        self._known: OrderedDict[str, None] = OrderedDict()
        for peer in reversed(list(known)[: lim.max_known]):  # most recent last: dropped last
            self._known[peer] = None
        self.refused: dict[str, int] = {"new_identity": 0, "known_key": 0}

    def __len__(self) -> int:
        return len(self._known)

    def is_known(self, peer: str) -> bool:
        return peer in self._known

    def admitted(self, peer: str) -> None:
        """``peer`` was admitted: from now on its requests are a known key's."""
        self._known.pop(peer, None)
        self._known[peer] = None
        while len(self._known) > self.limits.max_known:
            self._known.popitem(last=False)

    def refusal(self, peer: str, ip_key: str, now: float) -> RateLimited | None:
        """Why a request from ``peer`` at address ``ip_key`` is refused now, or None (counted).

        The refusal says when the bucket that refused will have a token again: the transport
        reads nothing more from that connection until then (A3: 16 admitted throwaway keys that
        re-asked as fast as they were answered cost the hub ~38 streams/s, ~3 ms each, and the
        honest nodes 29 % of their rate; refused at once, the refusal was cheap, the stream not).
        """
        lim = self.limits
        if peer in self._known:
            if not self._key.allow(peer, now):
                self.refused["known_key"] += 1
                return RateLimited(f"too many admission requests right now (over {lim.key_per_s:g}/s from this node); "
                                   "retry later", self._key.wait_s(peer, now))
            if not self._known_ip.allow(ip_key, now):
                self.refused["known_key"] += 1
                return RateLimited("too many admission requests right now (from this address); retry later",
                                   self._known_ip.wait_s(ip_key, now))
            return None
        if not self._new.allow(ip_key, now):
            self.refused["new_identity"] += 1
            return RateLimited(f"too many admission requests right now (over {lim.new_per_s:g} new identities/s from "
                               "this address); retry later", self._new.wait_s(ip_key, now))
        return None
