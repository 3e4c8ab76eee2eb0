"""The hub database's join-token tables: tokens made, revoked and used (admission.py checks a
token's signature; this counts its uses, persistently, so a revoked or used-up token stays so
across restarts). Mixed into :class:`~echo2.learner_hub.store.HubStore`, whose transaction
plumbing it uses.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import Any

from .schema import TokenRecord


class JoinTokens:
    def _tx(self, *, durable: bool = False) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def record_token(self, token_id: str, created: float, expires: float, max_uses: int | None, peer: str | None) -> None:
        """`echo2 hub token`: remember a token made, so it can be listed and revoked."""
        with self._tx(durable=True) as db:
            db.execute(
                "INSERT OR IGNORE INTO join_tokens (token_id, created, expires, max_uses, peer) VALUES (?, ?, ?, ?, ?)",
                (token_id, created, expires, max_uses, peer),
            )

    def revoke_token(self, token_id: str, now: float) -> bool:
        """Refuse every later admission with this token (also one this store never recorded: a
        token is known by its id alone). True if the token was recorded here."""
        with self._tx(durable=True) as db:
            known = db.execute("SELECT 1 FROM join_tokens WHERE token_id = ?", (token_id,)).fetchone() is not None
            db.execute(
                "INSERT INTO join_tokens (token_id, created, expires, revoked_at) VALUES (?, ?, 0, ?)"
                " ON CONFLICT(token_id) DO UPDATE SET revoked_at = COALESCE(revoked_at, excluded.revoked_at)",
                (token_id, now, now),
            )
            return known

    def use_token(self, token_id: str, peer_id: str, max_uses: int | None, now: float) -> str | None:
        """Count ``peer_id``'s use of a valid token, atomically; the refusal code, or None when
        admitted. A node coming back with the token it joined with uses no second use."""
        with self._tx(durable=True) as db:
            row = db.execute("SELECT revoked_at FROM join_tokens WHERE token_id = ?", (token_id,)).fetchone()
            if row is not None and row[0] is not None:
                return "token_revoked"
            if db.execute("SELECT 1 FROM token_uses WHERE token_id = ? AND peer_id = ?", (token_id, peer_id)).fetchone():
                return None
            used = int(db.execute("SELECT COUNT(*) FROM token_uses WHERE token_id = ?", (token_id,)).fetchone()[0])
            if max_uses is not None and used >= max_uses:
                return "token_used_up"
            db.execute("INSERT INTO token_uses (token_id, peer_id, at) VALUES (?, ?, ?)", (token_id, peer_id, now))
            return None

    def tokens(self) -> list[TokenRecord]:
        rows = self._read(
            "SELECT t.token_id, t.created, t.expires, t.max_uses, t.peer, t.revoked_at,"
            " (SELECT COUNT(*) FROM token_uses u WHERE u.token_id = t.token_id) FROM join_tokens t ORDER BY t.created"
        )
        return [TokenRecord(str(i), float(c), float(e), m, p, r, int(n)) for i, c, e, m, p, r, n in rows]

