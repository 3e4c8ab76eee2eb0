"""Admission policy and join tokens: pure functions, no network, no clock of their own.

Modes (``HubConfig.admission``):

* ``open``: every node that is not banned is admitted.
* ``allowlist``: only peer IDs in the config's list or added with `echo2 hub admit PEER_ID`.
* ``token``: a node presents a join token printed by `echo2 hub token --expires 7d`
  (``--join-token`` on the node); allowlisted peers are admitted without one.

A ban always wins, in every mode, and the node is told the ban's reason.

Join token format (``e2jt1.<claims>.<signature>``, both base64url without padding): the claims
are the canonical msgpack of ``{"hub", "exp", "iat", "nonce", "scope": "join"}`` plus an
optional ``"peer"`` binding the token to one node; the signature is the hub's Ed25519 signature
over a domain prefix plus the claims bytes, so a token signed for another purpose or by another
hub never verifies here. A token may be used by many nodes until it expires (a fleet invite);
bind it with ``peer`` for a single node, or cap it with ``max_uses`` (a signed claim: that many
distinct nodes). A token's id (:func:`token_id`, from its nonce) names it to
`echo2 hub token revoke ID`; the hub's store counts each token's uses and keeps revocations, so
both hold across restarts (``HubStore.use_token``).
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from echo2.protocol import canonical
from echo2.protocol.errors import Echo2Error, IdentityError
from echo2.protocol.identity import Identity, public_key_from_peer_id, verify_signature

log = logging.getLogger(__name__)

TOKEN_PREFIX = "e2jt1."
_SIGNING_DOMAIN = b"echo2-join-token\x00v1\x00"
MAX_TOKEN_CHARS = 1024
_MAX_CLAIMS_BYTES = 512
MODES = ("open", "allowlist", "token")


class JoinTokenError(Echo2Error):
    """The join token is not valid."""

    code = "bad_join_token"


class Decision(NamedTuple):
    admitted: bool
    reason: str  # human readable: sent to the node and logged
    code: str  # stable: counted in metrics and stored with the admission log
    token_id: str = ""  # admitted on a join token: its id, whose use the caller must count
    max_uses: int | None = None  # that token's signed cap on distinct nodes


MAX_TOKEN_USES = 1_000_000
_TOKEN_REFUSALS = {
    "token_revoked": "this join token was revoked by the hub's operator; ask for a new one",
    "token_used_up": "this join token has been used by as many nodes as it allows; ask for a new one",
}


def token_id(nonce: bytes) -> str:
    """The short public name of a token (its nonce's first 8 bytes, hex): what revoke takes."""
    return nonce[:8].hex()


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"`` or combinations (``"1d12h"``) in
    seconds; a bare number is seconds. ValueError on anything else or a non-positive result."""
    s = text.strip().lower()
    units = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    if re.fullmatch(r"\d+(\.\d+)?", s):
        total = float(s)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([wdhms])", s)
        if not parts or "".join(n + u for n, u in parts) != s:
            raise ValueError(f"cannot parse duration {text!r} (use e.g. 7d, 12h, 30m, 1d12h)")
        total = sum(float(n) * units[u] for n, u in parts)
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"duration must be positive: {text!r}")
    return total


def _b64e(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode("ascii")


def _b64d(s: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", s):
        raise JoinTokenError("join token is not base64url")
    try:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    except (binascii.Error, ValueError) as exc:
        raise JoinTokenError("join token is not base64url") from exc


def make_join_token(
    identity: Identity,
    *,
    ttl_s: float,
    now: float,
    peer_id: str | None = None,
    nonce: bytes | None = None,
    max_uses: int | None = None,
) -> str:
    """A join token signed by the hub ``identity``, valid for ``ttl_s`` seconds from ``now``,
    for at most ``max_uses`` distinct nodes (None: no cap)."""
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError("ttl_s must be > 0")
    if max_uses is not None and not 1 <= max_uses <= MAX_TOKEN_USES:
        raise ValueError(f"max_uses must be in [1, {MAX_TOKEN_USES}]")
    claims: dict[str, Any] = {
        "hub": identity.peer_id,
        "exp": float(now + ttl_s),
        "iat": float(now),
        "nonce": nonce if nonce is not None else secrets.token_bytes(16),
        "scope": "join",
    }
    if peer_id is not None:
        claims["peer"] = peer_id
    if max_uses is not None:
        claims["max_uses"] = int(max_uses)
    raw = canonical.encode(claims)
    sig = identity.sign(_SIGNING_DOMAIN + raw)
    return f"{TOKEN_PREFIX}{_b64e(raw)}.{_b64e(sig)}"


def verify_join_token(token: str, hub_peer_id: str, now: float, peer_id: str | None = None) -> dict[str, Any]:
    """Check a token's form, hub, signature, expiry and (if bound) peer; return its claims.
    Raises :class:`JoinTokenError` with a message fit to send back to the node."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise JoinTokenError("join token is too long")
    if not token.startswith(TOKEN_PREFIX):
        raise JoinTokenError(f"not an echo2 join token (expected the prefix {TOKEN_PREFIX!r})")
    parts = token[len(TOKEN_PREFIX) :].split(".")
    if len(parts) != 2:
        raise JoinTokenError("join token is malformed (expected e2jt1.<claims>.<signature>)")
    raw, sig = _b64d(parts[0]), _b64d(parts[1])
    try:
        claims = canonical.decode(raw, max_size=_MAX_CLAIMS_BYTES)
    except Echo2Error as exc:
        raise JoinTokenError(f"join token claims do not decode: {exc.message}") from exc
    required = {"hub": str, "exp": float, "iat": float, "nonce": bytes, "scope": str}
    if not isinstance(claims, dict) or not set(required) <= set(claims) <= set(required) | {"peer", "max_uses"}:
        raise JoinTokenError("join token claims have the wrong fields")
    for k, t in required.items():
        if type(claims[k]) is not t:
            raise JoinTokenError(f"join token claim {k!r} has the wrong type")
    if "peer" in claims and type(claims["peer"]) is not str:
        raise JoinTokenError("join token claim 'peer' has the wrong type")
    if "max_uses" in claims and (type(claims["max_uses"]) is not int or not 1 <= claims["max_uses"] <= MAX_TOKEN_USES):
        raise JoinTokenError("join token claim 'max_uses' has the wrong type or range")
    if claims["scope"] != "join":
        raise JoinTokenError(f"join token scope is {claims['scope'][:32]!r}, not 'join'")
    if claims["hub"] != hub_peer_id:
        raise JoinTokenError(f"join token was issued by another hub ({claims['hub'][:64]}), not this one")
    try:
        verify_signature(public_key_from_peer_id(hub_peer_id), sig, _SIGNING_DOMAIN + raw)
    except (Echo2Error, IdentityError) as exc:
        raise JoinTokenError("join token signature does not verify (forged or altered)") from exc
    if not math.isfinite(claims["exp"]) or now >= claims["exp"]:
        raise JoinTokenError(f"join token expired {now - claims['exp']:.0f}s ago; ask the operator for a new one")
    if "peer" in claims and peer_id is not None and claims["peer"] != peer_id:
        raise JoinTokenError("join token was issued for another node")
    return dict(claims)


class AdmissionPolicy:
    """``decide(peer_id, join_token, now)`` for one hub. ``ban_reason(peer)`` returns the reason a
    peer is banned or None (e.g. ``HubStore.ban_reason``); ``is_allowed(peer)`` is an extra
    allowlist lookup (e.g. ``HubStore.is_allowed`` for `echo2 hub admit`)."""

    def __init__(
        self,
        mode: str,
        allowlist: Iterable[str] = (),
        *,
        hub_peer_id: str,
        ban_reason: Callable[[str], str | None] = lambda _p: None,
        is_allowed: Callable[[str], bool] = lambda _p: False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"admission mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.allowlist = set(allowlist)
        self.hub_peer_id = hub_peer_id
        self._ban_reason = ban_reason
        self._is_allowed = is_allowed

    @staticmethod
    def token_refusal(code: str) -> str:
        """The message for a store's refusal of a valid token (``HubStore.use_token``)."""
        return _TOKEN_REFUSALS.get(code, "this join token cannot be used")

    def allowed(self, peer_id: str) -> bool:
        return peer_id in self.allowlist or self._is_allowed(peer_id)

    def decide(
        self, peer_id: str, join_token: str, now: float, *, looked_up: tuple[str | None, bool] | None = None
    ) -> Decision:
        """``looked_up`` is (ban reason, on the stored allowlist) when the caller read them already
        (the hub reads its store off the event loop); otherwise the callbacks are asked."""
        ban, store_allowed = looked_up if looked_up is not None else (self._ban_reason(peer_id), None)
        if ban is not None:
            return Decision(False, f"this node is banned: {ban}", "banned")
        if self.mode == "open":
            return Decision(True, "admitted (open admission)", "open")
        if peer_id in self.allowlist or (store_allowed if store_allowed is not None else self._is_allowed(peer_id)):
            return Decision(True, "admitted (on the allowlist)", "allowlisted")
        if self.mode == "allowlist":
            return Decision(
                False,
                f"this hub admits only allowlisted nodes; ask the operator to run `echo2 hub admit {peer_id}`",
                "not_allowlisted",
            )
        if not join_token:
            return Decision(
                False,
                "this hub requires a join token: ask the operator for `echo2 hub token` and pass it with --join-token",
                "token_required",
            )
        try:
            claims = verify_join_token(join_token, self.hub_peer_id, now, peer_id)
        except JoinTokenError as exc:
            return Decision(False, exc.message, "bad_join_token")
        return Decision(True, "admitted (valid join token)", "token", token_id(claims["nonce"]), claims.get("max_uses"))
