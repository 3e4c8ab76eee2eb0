"""Join strings (issue 19 item 5): a hub's address and a join token in one string a volunteer
pastes whole: ``echo2 node run --join STRING``.

Form: ``MULTIADDR/join/TOKEN``, e.g. ``/dns4/hub.example.org/tcp/4001/p2p/12D3KooW.../join/e2jt1.xxx.yyy``,
or the bare multiaddr for a hub that admits anyone. Every character is one of ``[A-Za-z0-9/._-]``
(a multiaddr's and a token's, which is base64url and dots), so it needs no quoting in any shell,
survives a chat client's line wrapping as one word, and still reads as an address. The token's
signature is the hub's to check; here a token signed for another hub than the address names is
refused before any dial (its claims name the hub, see ``learner_hub/admission.py``).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from . import canonical
from .errors import Echo2Error

SEPARATOR = "/join/"
TOKEN_PREFIX = "e2jt1."  # learner_hub.admission.TOKEN_PREFIX: nodes cannot import the hub's package
MAX_JOIN_STRING = 2048


class JoinStringError(Echo2Error):
    """The join string is not one a hub printed."""

    code = "bad_join_string"


def make_join_string(addr: str, token: str = "") -> str:
    addr = addr.rstrip("/")
    parse_join_string(addr + (SEPARATOR + token if token else ""))  # only what a node would take
    return addr + (SEPARATOR + token if token else "")


def _peer_of(addr: str) -> str:
    parts = addr.split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts) or not parts[parts.index("p2p") + 1]:
        raise JoinStringError(f"the address in a join string ends with /p2p/PEER_ID: {addr[:200]!r}")
    return parts[parts.index("p2p") + 1]


def _token_hub(token: str) -> str | None:
    """The hub a token's claims name (None if they cannot be read: the hub will say why)."""
    try:
        claims_b64 = token[len(TOKEN_PREFIX) :].split(".")[0]
        claims: Any = canonical.decode(base64.urlsafe_b64decode(claims_b64 + "=" * (-len(claims_b64) % 4)), max_size=1024)
    except (Echo2Error, binascii.Error, ValueError):
        return None
    hub = claims.get("hub") if isinstance(claims, dict) else None
    return hub if isinstance(hub, str) else None


def parse_join_string(text: str) -> tuple[str, str]:
    """(hub multiaddr, join token; "" for none) of a join string."""
    s = text.strip()
    if len(s) > MAX_JOIN_STRING:
        raise JoinStringError(f"a join string is at most {MAX_JOIN_STRING} characters, got {len(s)}")
    if not s.startswith("/"):
        raise JoinStringError("a join string starts with the hub's address (/dns4/..., /ip4/...); "
                              "copy it whole from `echo2 hub join-string`")
    addr, sep, token = s.partition(SEPARATOR)
    addr = addr.rstrip("/")
    peer = _peer_of(addr)
    if sep and not token.startswith(TOKEN_PREFIX):
        raise JoinStringError(f"the part after {SEPARATOR!r} is not a join token (it starts with {TOKEN_PREFIX!r})")
    if token:
        hub = _token_hub(token)
        if hub is not None and hub != peer:
            raise JoinStringError(f"the join token was signed by hub {hub}, not by the hub at this address ({peer})")
    return addr, token
