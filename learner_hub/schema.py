"""The hub database's schema: the ordered migrations, the records its queries return, and the
migration runner (``schema_version`` records how far a file has been migrated).

Append only: a released migration is never edited; a schema change is a new entry.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE nodes (
        peer_id TEXT PRIMARY KEY,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        announce TEXT,
        price REAL NOT NULL DEFAULT 0,
        measured_rate REAL,
        reputation REAL NOT NULL DEFAULT 0.5,
        state TEXT NOT NULL DEFAULT 'new',
        banned INTEGER NOT NULL DEFAULT 0,
        ban_reason TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE admissions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        peer_id TEXT NOT NULL,
        at REAL NOT NULL,
        admitted INTEGER NOT NULL,
        code TEXT NOT NULL,
        reason TEXT NOT NULL
    );
    CREATE INDEX admissions_peer ON admissions(peer_id);
    CREATE TABLE allowlist (
        peer_id TEXT PRIMARY KEY,
        added_at REAL NOT NULL,
        note TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE tasks (
        task_id TEXT PRIMARY KEY,
        node TEXT NOT NULL,
        issued_at REAL NOT NULL,
        deadline REAL NOT NULL,
        n_rollouts INTEGER NOT NULL,
        status TEXT NOT NULL DEFAULT 'issued',
        closed_at REAL
    );
    CREATE INDEX tasks_status ON tasks(status);
    CREATE TABLE results (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id TEXT NOT NULL,
        node TEXT NOT NULL,
        version INTEGER NOT NULL,
        accepted INTEGER NOT NULL,
        reason TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        rollouts INTEGER NOT NULL,
        received_at REAL NOT NULL,
        payload BLOB,
        trained_step INTEGER
    );
    CREATE INDEX results_task ON results(task_id);
    CREATE INDEX results_pending ON results(accepted, trained_step);
    CREATE TABLE versions (
        version INTEGER PRIMARY KEY,
        published_at REAL NOT NULL,
        total_bytes INTEGER NOT NULL,
        encoded_bytes INTEGER NOT NULL,
        first_s REAL,
        median_s REAL,
        last_s REAL,
        nodes INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE ledger (
        peer_id TEXT PRIMARY KEY,
        price REAL NOT NULL,
        active_s REAL NOT NULL,
        cost_usd REAL NOT NULL,
        accepted_results INTEGER NOT NULL,
        accepted_rollouts INTEGER NOT NULL,
        accepted_tokens INTEGER NOT NULL,
        refused_by_reason TEXT NOT NULL,
        saved_at REAL NOT NULL
    );
    CREATE TABLE checkpoints (
        step INTEGER PRIMARY KEY,
        path TEXT NOT NULL,
        created REAL NOT NULL,
        bytes INTEGER NOT NULL
    );
    """,
    # 2: reputation state (window of recent checks) survives restarts; small key-value table
    """
    ALTER TABLE nodes ADD COLUMN rep_state TEXT NOT NULL DEFAULT '{}';
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    # 3: peers' reports of corrupt relayed chunks (one row per reporter, accused and chunk)
    """
    CREATE TABLE relay_reports (
        accused TEXT NOT NULL,
        reporter TEXT NOT NULL,
        version INTEGER NOT NULL,
        chunk_index INTEGER NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (accused, reporter, version, chunk_index)
    );
    """,
    # 4: the ledger in integer micro-USD and milliseconds (the REAL columns stay, as display
    # copies); one ledger entry per accepted result, written in the result's own transaction;
    # join tokens that can be revoked and used a bounded number of times
    """
    ALTER TABLE ledger ADD COLUMN price_micro INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ledger ADD COLUMN active_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ledger ADD COLUMN cost_micro INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ledger ADD COLUMN cost_rem INTEGER NOT NULL DEFAULT 0;
    UPDATE ledger SET price_micro = CAST(ROUND(price * 1000000) AS INTEGER),
        active_ms = CAST(ROUND(active_s * 1000) AS INTEGER), cost_micro = CAST(ROUND(cost_usd * 1000000) AS INTEGER);
    CREATE TABLE ledger_entries (
        task_id TEXT PRIMARY KEY,
        peer_id TEXT NOT NULL,
        rollouts INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        price_micro INTEGER NOT NULL,
        at REAL NOT NULL
    );
    CREATE INDEX ledger_entries_peer ON ledger_entries(peer_id);
    CREATE TABLE join_tokens (
        token_id TEXT PRIMARY KEY,
        created REAL NOT NULL,
        expires REAL NOT NULL,
        max_uses INTEGER,
        peer TEXT,
        revoked_at REAL
    );
    CREATE TABLE token_uses (
        token_id TEXT NOT NULL,
        peer_id TEXT NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (token_id, peer_id)
    );
    """,
    # evaluations through the swarm (issue 16): one row per evaluated learner step
    """
    CREATE TABLE evaluations (
        step INTEGER PRIMARY KEY,
        wall_s REAL NOT NULL,
        mean_reward REAL,
        accuracy REAL,
        n INTEGER NOT NULL,
        excluded INTEGER NOT NULL,
        at REAL NOT NULL
    );
    """,
    # every learner step's figures under TRL's names and echo2/ (issue 21; trainmetrics.py), as JSON:
    # `echo2 hub report` draws the run's curves from them
    """
    CREATE TABLE train_metrics (
        step INTEGER PRIMARY KEY,
        wall_s REAL NOT NULL,
        metrics TEXT NOT NULL
    );
    """,
    # issue 20: a saved active account's open interval starts at active_since_ms (NULL: inactive);
    # the hub marks itself alive at each save (meta ledger_alive_ms), and a restart bills the open
    # interval up to that mark, so billed accounts are no longer rewritten every 10 s. The banned
    # nodes, read each second (CLI bans reach the running hub), by a partial index: the query
    # scanned every node row, 10,000 a second (py-spy of a 10,000-node hub at rest)
    """
    ALTER TABLE ledger ADD COLUMN active_since_ms INTEGER;
    CREATE INDEX nodes_banned ON nodes(peer_id) WHERE banned = 1;
    """,
    # issue 20: an accepted result's payload in a table of its own (results.payload stays NULL).
    # SQLite rewrites a whole row on UPDATE, and marking a result trained (once per result) copied
    # its ~6 KB payload's overflow pages each time: 0.050 ms of the store thread's CPU per small
    # result, now 0.010, at 0.014 more to insert it apart (raw sqlite3, 4,000 results in batches
    # of 8, 200 marked per step); freeing it after a checkpoint is a DELETE, not another rewrite
    """
    CREATE TABLE result_payloads (
        result_id INTEGER PRIMARY KEY,
        payload BLOB NOT NULL
    );
    INSERT INTO result_payloads (result_id, payload) SELECT id, payload FROM results WHERE payload IS NOT NULL;
    UPDATE results SET payload = NULL WHERE payload IS NOT NULL;
    """,
    # issue 20: new payloads in append-only segment files (payloadlog.py says why: a blob's bytes
    # went through the WAL, the checkpoint and the freelist, 0.057 of the store thread's 0.135 ms
    # per small result); each one's place here. Older rows of result_payloads stay readable.
    """
    CREATE TABLE payload_refs (
        result_id INTEGER PRIMARY KEY,
        segment INTEGER NOT NULL,
        offset INTEGER NOT NULL,
        length INTEGER NOT NULL
    );
    CREATE INDEX payload_refs_segment ON payload_refs(segment);
    """,
]


class StoreError(RuntimeError):
    """The hub database cannot be used (newer schema, corrupt file)."""


@dataclass(frozen=True)
class NodeRecord:
    peer_id: str
    first_seen: float
    last_seen: float
    announce: dict[str, Any] | None
    price: float
    measured_rate: float | None
    reputation: float
    state: str
    banned: bool
    ban_reason: str
    rep_state: dict[str, Any]


@dataclass(frozen=True)
class AdmissionRecord:
    peer_id: str
    at: float
    admitted: bool
    code: str
    reason: str


@dataclass(frozen=True)
class TaskRecord:
    task_id: str
    node: str
    issued_at: float
    deadline: float
    n_rollouts: int
    status: str
    closed_at: float | None


@dataclass(frozen=True)
class PendingResult:
    """An accepted result whose rollouts are not yet covered by a checkpoint."""

    task_id: str
    node: str
    version: int
    tokens: int
    rollouts: int
    received_at: float
    payload: bytes


@dataclass(frozen=True)
class TokenRecord:
    token_id: str
    created: float
    expires: float
    max_uses: int | None
    peer: str | None
    revoked_at: float | None
    uses: int


@dataclass(frozen=True)
class VersionRecord:
    version: int
    published_at: float
    total_bytes: int
    encoded_bytes: int
    first_s: float | None
    median_s: float | None
    last_s: float | None
    nodes: int


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring ``db`` to the newest schema inside the caller's transaction."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    current = int(row[0]) if row and row[0] is not None else 0
    if current > len(MIGRATIONS):
        raise StoreError(f"{path} has schema version {current}, newer than this echo2 ({len(MIGRATIONS)}); upgrade echo2")
    for i in range(current, len(MIGRATIONS)):
        # executescript would COMMIT the caller's transaction; run the statements one by one.
        for stmt in _statements(MIGRATIONS[i]):
            db.execute(stmt)
        db.execute("INSERT INTO schema_version (version) VALUES (?)", (i + 1,))
        log.info("hub database %s migrated to schema version %d", path, i + 1)


NODE_COLS = (
    "peer_id, first_seen, last_seen, announce, price, measured_rate, reputation, state, banned, ban_reason, rep_state"
)


def node_record(r: tuple[Any, ...]) -> NodeRecord:
    return NodeRecord(
        peer_id=r[0],
        first_seen=r[1],
        last_seen=r[2],
        announce=json.loads(r[3]) if r[3] else None,
        price=r[4],
        measured_rate=r[5],
        reputation=r[6],
        state=r[7],
        banned=bool(r[8]),
        ban_reason=r[9],
        rep_state=json.loads(r[10]) if r[10] else {},
    )


def _statements(script: str) -> list[str]:
    # Migrations hold no string literals containing ';', so a plain split is exact.
    return [s.strip() for s in script.split(";") if s.strip()]
