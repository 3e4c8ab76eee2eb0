"""The hub database's ledger table: each account's figures, saved when they change, and the
hub's alive mark that closes the open intervals of billed accounts after a restart (issue 20:
rewriting every billed account every 10 s was ~1,000 rows a second at 10,000 nodes). Mixed into
:class:`~echo2.learner_hub.store.HubStore`, whose transaction plumbing it uses.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from .ledger import AccountRow, close_open

#: meta key: the last moment (ms) the hub saved its ledger, alive; a restart bills open intervals up to it
LEDGER_ALIVE_KEY = "ledger_alive_ms"


class LedgerRows:
    def _tx(self, *, durable: bool = False) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def get_meta(self, key: str, default: Any = None) -> Any:
        raise NotImplementedError

    def save_ledger(self, rows: Iterable[AccountRow], now: float) -> None:
        """Persist rows of :meth:`Ledger.view` at ``now`` (upsert per node): billed time, cost,
        price and refusals up to ``now``, and for an active account ``now`` as the start of its
        open interval; and mark the hub alive at ``now`` (:data:`LEDGER_ALIVE_KEY`), which is
        where a restart closes every open interval (:meth:`settle_ledger`). The accepted counts of
        a node already in the table are left alone: each :meth:`record_accepted` adds its own in
        its transaction, and a snapshot taken on the loop before results that were committed
        ahead of it must not move them backwards."""
        now_ms = int(round(now * 1000.0))
        with self._tx() as db:
            db.executemany(
                "INSERT INTO ledger (peer_id, price, active_s, cost_usd, accepted_results,"
                " accepted_rollouts, accepted_tokens, refused_by_reason, saved_at, price_micro, active_ms,"
                " cost_micro, cost_rem, active_since_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET price = excluded.price, active_s = excluded.active_s,"
                " cost_usd = excluded.cost_usd, refused_by_reason = excluded.refused_by_reason,"
                " saved_at = excluded.saved_at, price_micro = excluded.price_micro, active_ms = excluded.active_ms,"
                " cost_micro = excluded.cost_micro, cost_rem = excluded.cost_rem,"
                " active_since_ms = excluded.active_since_ms",
                [
                    (r.peer_id, r.price_usd_per_hour, r.active_s, r.cost_usd, r.accepted_results,
                     r.accepted_rollouts, r.accepted_tokens, json.dumps(r.refused_by_reason, sort_keys=True), now,
                     r.price_micro, r.active_ms, r.cost_micro, r.cost_rem, now_ms if r.active else None)
                    for r in rows
                ],
            )
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (LEDGER_ALIVE_KEY, json.dumps(now_ms)))

    def load_ledger(self) -> list[AccountRow]:
        """The persisted accounts, all inactive, an open interval billed up to the hub's last
        alive mark (:meth:`save_ledger`): feed to :meth:`Ledger.restore`."""
        return [r for r, _ in self._ledger_rows()]

    def settle_ledger(self) -> list[AccountRow]:
        """:meth:`load_ledger`, with the open intervals it closed written back closed: what a
        hub starting up restores (run before it saves anything: a later alive mark must not
        bill the downtime)."""
        rows = self._ledger_rows()
        with self._tx() as db:
            db.executemany(
                "UPDATE ledger SET active_s = ?, cost_usd = ?, active_ms = ?, cost_micro = ?, cost_rem = ?,"
                " active_since_ms = NULL WHERE peer_id = ?",
                [(r.active_s, r.cost_usd, r.active_ms, r.cost_micro, r.cost_rem, r.peer_id) for r, was_open in rows
                 if was_open],
            )
        return [r for r, _ in rows]

    def _ledger_rows(self) -> list[tuple[AccountRow, bool]]:
        rows = self._read(
            "SELECT peer_id, price_micro, active_ms, cost_micro, accepted_results, accepted_rollouts, accepted_tokens,"
            " refused_by_reason, cost_rem, active_since_ms FROM ledger ORDER BY peer_id"
        )
        alive = self.get_meta(LEDGER_ALIVE_KEY)
        out = []
        for p, price, act, cost, res, ro, tok, ref, rem, since in rows:
            by_reason = {str(k): int(v) for k, v in json.loads(ref).items()}
            row = AccountRow(p, int(price), False, int(act), int(cost), int(res), int(ro), int(tok),
                             sum(by_reason.values()), by_reason, int(rem))
            if since is not None:
                row = close_open(row, int(since), int(alive) if alive is not None else int(since))
            out.append((row, since is not None))
        return out
