"""The hub's durable state: one SQLite file, its accepted payloads' segment files (payloadlog.py)
and checkpoint files in the hub directory.

Why SQLite: the hub restarts (crash, upgrade, `echo2 hub run` again) and must keep the fleet's
history - admissions and bans, the ledger, policy versions - and every accepted result that the
learner has not trained on yet, so no paid-for rollout is lost. The database is opened in WAL mode
(readers such as `echo2 hub nodes` never block the running hub) and migrated on open from the
ordered :data:`MIGRATIONS` list; ``schema_version`` records how far a file has been migrated.

Every public method is one short transaction and returns plain values; callers never write SQL.
The calls block (fsync), so the running hub makes every one of them from the single thread of its
:class:`~echo2.learner_hub.storeworker.StoreWorker`; the lock keeps other users (the CLI, tests)
safe when they share a store between threads.

Exactly-once training across restarts: an accepted result's payload is kept until a checkpoint
covers the step that trained it. ``mark_trained(task_ids, step)`` records the step;
``pending_results(after_step)`` returns results never trained *or* trained by a step later than
the checkpoint the hub resumed from (that step's weights were lost with the crash).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from echo2.fsutil import fsync_dir

from .checkpointstore import CheckpointFiles
from .joinstore import JoinTokens
from .ledger import NodeRow, hardware_summary, ledger_csv, render_ledger, render_nodes, totals_of
from .ledgerstore import LedgerRows
from .payloadlog import PayloadLog
from .schema import (
    MIGRATIONS,
    NODE_COLS,
    AdmissionRecord,
    NodeRecord,
    PendingResult,
    StoreError,
    TaskRecord,
    VersionRecord,
    migrate,
    node_record,
)

log = logging.getLogger(__name__)

DB_NAME = "hub.sqlite"
CHECKPOINT_DIR = "checkpoints"
#: the accepted payloads' segment files: a folder beside the database file (payloadlog.py)
PAYLOADS_SUFFIX = "-payloads"


class Accepted(NamedTuple):
    """One accepted result as :meth:`HubStore.record_accepted_many` records it."""

    task_id: str
    node: str
    version: int
    tokens: int
    rollouts: int
    received_at: float
    payload: bytes | memoryview  # a view of an intake worker's reply (intake_check.CompactSample)
    price_micro: int

class HubStore(JoinTokens, CheckpointFiles, LedgerRows):
    """SQLite-backed hub state. ``path`` is the database file (conventionally DIR/hub.sqlite);
    checkpoints go to ``checkpoint_dir`` (default: a ``checkpoints`` folder beside it)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_checkpoints: int = 3,
        check_same_thread: bool = False,
    ) -> None:
        if keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else self.path.parent / CHECKPOINT_DIR
        self.keep_checkpoints = keep_checkpoints
        self._lock = threading.Lock()
        self._after_commit: list[Callable[[], object]] = []  # files to remove once the rows that needed them are gone
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so each method is one transaction.
        # check_same_thread: the hub's store worker opens the store in its own thread and passes
        # True, so a stray call from any other thread fails loudly instead of blocking the loop.
        self._db = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=check_same_thread, timeout=10.0
        )
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(f"cannot open hub database {self.path}: {exc}") from exc
        # The database and its WAL may have just been created, and the hub directory too (next to
        # the key): their directory entries must survive a crash like the data they hold.
        fsync_dir(self.path.parent)
        fsync_dir(self.path.parent.parent)
        # accepted results' payloads (payloadlog.py): beside the file, as its -wal is
        self._payloads = PayloadLog(Path(str(self.path) + PAYLOADS_SUFFIX))

    @classmethod
    def in_dir(cls, hub_dir: str | os.PathLike[str], **kw: Any) -> HubStore:
        return cls(Path(hub_dir) / DB_NAME, **kw)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._payloads.close()

    def __enter__(self) -> HubStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------------------
    @contextmanager
    def _tx(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction. ``durable``: its COMMIT syncs the WAL (synchronous=FULL), so what it
        wrote survives a power cut, not only a killed process; the other transactions keep
        NORMAL (they are made durable by the next durable one, or a checkpoint)."""
        with self._lock:
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._after_commit.clear()
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                for job in self._after_commit:  # still under the lock: no other transaction between
                    job()
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    def synchronous(self) -> int:
        """The connection's current ``PRAGMA synchronous`` (1 NORMAL, 2 FULL); for tests."""
        return int(self._db.execute("PRAGMA synchronous").fetchone()[0])

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def _migrate(self) -> None:
        with self._tx() as db:
            migrate(db, self.path)

    def schema_version(self) -> int:
        row = self._read("SELECT MAX(version) FROM schema_version")
        return int(row[0][0] or 0)

    # --- nodes -----------------------------------------------------------------------------------
    def upsert_node(
        self,
        peer_id: str,
        now: float,
        *,
        announce: dict[str, Any] | None = None,
        price: float | None = None,
        state: str | None = None,
    ) -> None:
        """Record that ``peer_id`` was seen (creating it if new); given fields are updated."""
        ann = json.dumps(announce, sort_keys=True) if announce is not None else None
        with self._tx() as db:
            db.execute(
                "INSERT INTO nodes (peer_id, first_seen, last_seen, announce, price, state)"
                " VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET last_seen = excluded.last_seen",
                (peer_id, now, now, ann, price or 0.0, state or "new"),
            )
            if ann is not None:
                db.execute("UPDATE nodes SET announce = ? WHERE peer_id = ?", (ann, peer_id))
            if price is not None:
                db.execute("UPDATE nodes SET price = ? WHERE peer_id = ?", (float(price), peer_id))
            if state is not None:
                db.execute("UPDATE nodes SET state = ? WHERE peer_id = ?", (state, peer_id))

    def set_node_state(self, peer_id: str, state: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE nodes SET state = ? WHERE peer_id = ?", (state, peer_id))

    def set_measured_rate(self, peer_id: str, rate: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE nodes SET measured_rate = ? WHERE peer_id = ?", (float(rate), peer_id))

    def set_reputation(self, peer_id: str, score: float, rep_state: dict[str, Any] | None = None) -> None:
        st = json.dumps(rep_state if rep_state is not None else {}, sort_keys=True)
        with self._tx() as db:
            db.execute(
                "UPDATE nodes SET reputation = ?, rep_state = ? WHERE peer_id = ?", (float(score), st, peer_id)
            )

    def get_node(self, peer_id: str) -> NodeRecord | None:
        rows = self._read(f"SELECT {NODE_COLS} FROM nodes WHERE peer_id = ?", (peer_id,))
        return node_record(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRecord]:
        return [node_record(r) for r in self._read(f"SELECT {NODE_COLS} FROM nodes ORDER BY first_seen, peer_id")]

    # --- bans ------------------------------------------------------------------------------------
    def ban(self, peer_id: str, reason: str, now: float) -> None:
        """Ban ``peer_id`` (also one never seen); enforced at connect time via :meth:`ban_reason`."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO nodes (peer_id, first_seen, last_seen, state, banned, ban_reason)"
                " VALUES (?, ?, ?, 'banned', 1, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET banned = 1, ban_reason = excluded.ban_reason, state = 'banned'",
                (peer_id, now, now, reason),
            )
            db.execute("DELETE FROM allowlist WHERE peer_id = ?", (peer_id,))

    def unban(self, peer_id: str) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE nodes SET banned = 0, ban_reason = '', state = 'left' WHERE peer_id = ? AND banned = 1",
                (peer_id,),
            )
            return cur.rowcount > 0

    def record_relay_report(self, accused: str, reporter: str, version: int, index: int, now: float) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO relay_reports (accused, reporter, version, chunk_index, at)"
                " VALUES (?, ?, ?, ?, ?)",
                (accused, reporter, int(version), int(index), now),
            )

    def relay_reports(self, accused: str | None = None) -> list[tuple[str, str, int, int, float]]:
        """(accused, reporter, version, chunk index, time) rows, oldest first."""
        sql = "SELECT accused, reporter, version, chunk_index, at FROM relay_reports"
        args: tuple[Any, ...] = ()
        if accused is not None:
            sql += " WHERE accused = ?"
            args = (accused,)
        return [(str(a), str(r), int(v), int(i), float(t)) for a, r, v, i, t in self._read(sql + " ORDER BY at", args)]

    def ban_reason(self, peer_id: str) -> str | None:
        """The ban reason if ``peer_id`` is banned, else None (the admission callback)."""
        rows = self._read("SELECT ban_reason FROM nodes WHERE peer_id = ? AND banned = 1", (peer_id,))
        return (rows[0][0] or "banned") if rows else None

    def banned(self) -> dict[str, str]:
        return {p: r for p, r in self._read("SELECT peer_id, ban_reason FROM nodes WHERE banned = 1")}

    # --- allowlist and admissions ----------------------------------------------------------------
    def allow(self, peer_id: str, now: float, note: str = "") -> None:
        """`echo2 hub admit PEER_ID`: add to the allowlist (works while the hub runs)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO allowlist (peer_id, added_at, note) VALUES (?, ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET note = excluded.note",
                (peer_id, now, note),
            )

    def disallow(self, peer_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM allowlist WHERE peer_id = ?", (peer_id,)).rowcount > 0

    def is_allowed(self, peer_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM allowlist WHERE peer_id = ?", (peer_id,)))

    def allowlist(self) -> set[str]:
        return {r[0] for r in self._read("SELECT peer_id FROM allowlist")}

    def log_admission(self, peer_id: str, now: float, admitted: bool, code: str, reason: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO admissions (peer_id, at, admitted, code, reason) VALUES (?, ?, ?, ?, ?)",
                (peer_id, now, int(admitted), code, reason),
            )

    def admissions(self, peer_id: str | None = None, limit: int = 100) -> list[AdmissionRecord]:
        """The most recent admission decisions, newest first."""
        if peer_id is None:
            rows = self._read("SELECT peer_id, at, admitted, code, reason FROM admissions ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._read(
                "SELECT peer_id, at, admitted, code, reason FROM admissions WHERE peer_id = ? ORDER BY id DESC LIMIT ?",
                (peer_id, limit),
            )
        return [AdmissionRecord(p, at, bool(a), c, r) for p, at, a, c, r in rows]

    # --- tasks -----------------------------------------------------------------------------------
    def record_task(self, task_id: str, node: str, issued_at: float, deadline: float, n_rollouts: int) -> None:
        self.record_tasks([(task_id, node, issued_at, deadline, n_rollouts)])

    def record_tasks(self, tasks: Sequence[tuple[str, str, float, float, int]]) -> None:
        """Tasks issued together (task id, node, issued at, deadline, rollouts), in one
        transaction: a batch's acceptance issues its node's next tasks at once."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO tasks (task_id, node, issued_at, deadline, n_rollouts, status, closed_at)"
                " VALUES (?, ?, ?, ?, ?, 'issued', NULL)", tasks)

    def close_task(self, task_id: str, status: str, now: float) -> None:
        """``status``: e.g. done | declined | expired | node_left | stale."""
        with self._tx() as db:
            db.execute("UPDATE tasks SET status = ?, closed_at = ? WHERE task_id = ?", (status, now, task_id))

    def get_task(self, task_id: str) -> TaskRecord | None:
        rows = self._read(
            "SELECT task_id, node, issued_at, deadline, n_rollouts, status, closed_at FROM tasks WHERE task_id = ?",
            (task_id,),
        )
        return TaskRecord(*rows[0]) if rows else None

    def task_counts(self) -> dict[str, int]:
        return {s: n for s, n in self._read("SELECT status, COUNT(*) FROM tasks GROUP BY status")}

    # --- results ---------------------------------------------------------------------------------
    def record_result(
        self,
        task_id: str,
        node: str,
        version: int,
        *,
        accepted: bool,
        reason: str,
        tokens: int,
        rollouts: int,
        received_at: float,
        payload: bytes | None = None,
    ) -> int:
        """Log a result. For an accepted one, ``payload`` is whatever the hub needs to rebuild its
        training groups after a restart; it is kept until a checkpoint covers its training step."""
        if accepted and payload is None:
            raise ValueError("an accepted result needs its payload (it is kept until trained)")
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO results (task_id, node, version, accepted, reason, tokens, rollouts, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (task_id, node, version, int(accepted), reason, tokens, rollouts, received_at),
            )
            rid = int(cur.lastrowid or 0)
            if accepted:
                assert payload is not None
                (ref,) = self._payloads.append([payload], sync=True)  # durable before its row refers to it
                db.execute("INSERT INTO payload_refs (result_id, segment, offset, length) VALUES (?, ?, ?, ?)", (rid, *ref))
            return rid

    def record_accepted(
        self,
        task_id: str,
        node: str,
        version: int,
        *,
        tokens: int,
        rollouts: int,
        received_at: float,
        payload: bytes,
        price_micro: int,
    ) -> None:
        """An accepted result, its ledger entry and its task's closing, in ONE durable transaction:
        the hub answers "accepted" only after this returns, so a crash at any moment either loses
        the result and its entry together (the node was not told, and sends it again) or neither.
        ``price_micro`` is the price in force when the task was issued (micro-USD per hour)."""
        self.record_accepted_many([Accepted(task_id, node, version, tokens, rollouts, received_at, payload, price_micro)])

    def record_accepted_many(self, items: Sequence[Accepted]) -> None:
        """Several accepted results (one node's ResultBatch), each as :meth:`record_accepted`
        records it, in ONE durable transaction: one WAL sync per batch instead of one per result."""
        if any(min(a.tokens, a.rollouts, a.price_micro) < 0 for a in items):
            raise ValueError("tokens, rollouts and price must be >= 0")
        # per node: (results, rollouts, tokens) of its new ledger entries, and the first one's
        # price and time (what a node's first row is created with): one ledger upsert per node
        # and batch, not per result (with the payload apart, ~0.01 ms of the store thread's CPU
        # per small result: HubStore directly, 4,000 results in batches of 8)
        counted: dict[str, list[Any]] = {}
        with self._tx(durable=True) as db:
            # the payloads durable in their segment before the rows that refer to them commit
            refs = self._payloads.append([a.payload for a in items], sync=True)
            for a, ref in zip(items, refs, strict=True):
                rid = db.execute(
                    "INSERT INTO results (task_id, node, version, accepted, reason, tokens, rollouts, received_at)"
                    " VALUES (?, ?, ?, 1, 'accepted', ?, ?, ?)",
                    (a.task_id, a.node, a.version, a.tokens, a.rollouts, a.received_at),
                ).lastrowid
                db.execute("INSERT INTO payload_refs (result_id, segment, offset, length) VALUES (?, ?, ?, ?)",
                           (rid, *ref))
                new = db.execute(
                    "INSERT OR IGNORE INTO ledger_entries (task_id, peer_id, rollouts, tokens, price_micro, at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (a.task_id, a.node, a.rollouts, a.tokens, int(a.price_micro), a.received_at),
                ).rowcount
                if new:
                    c = counted.setdefault(a.node, [0, 0, 0, a.price_micro, a.received_at])
                    c[0], c[1], c[2] = c[0] + 1, c[1] + a.rollouts, c[2] + a.tokens
            db.executemany("UPDATE tasks SET status = 'done', closed_at = ? WHERE task_id = ?",
                           [(a.received_at, a.task_id) for a in items])
            db.executemany(
                "INSERT INTO ledger (peer_id, price, active_s, cost_usd, accepted_results, accepted_rollouts,"
                " accepted_tokens, refused_by_reason, saved_at, price_micro) VALUES (?, ?, 0, 0, ?, ?, ?, '{}', ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET accepted_results = accepted_results + excluded.accepted_results,"
                " accepted_rollouts = accepted_rollouts + excluded.accepted_rollouts,"
                " accepted_tokens = accepted_tokens + excluded.accepted_tokens",
                [(node, price / 1e6, n, rollouts, tokens, at, int(price))
                 for node, (n, rollouts, tokens, price, at) in counted.items()],
            )

    def ledger_entries(self, peer_id: str | None = None) -> list[tuple[str, str, int, int, int, float]]:
        """(task id, peer, rollouts, tokens, price micro-USD/h at issue, time) per accepted result."""
        sql = "SELECT task_id, peer_id, rollouts, tokens, price_micro, at FROM ledger_entries"
        args: tuple[Any, ...] = ()
        if peer_id is not None:
            sql += " WHERE peer_id = ?"
            args = (peer_id,)
        return [(str(t), str(p), int(r), int(k), int(m), float(a)) for t, p, r, k, m, a in self._read(sql + " ORDER BY at", args)]

    def accepted_task_ids(self) -> set[str]:
        """Every task whose result was accepted (the crash bench counts them)."""
        return {str(r[0]) for r in self._read("SELECT task_id FROM results WHERE accepted = 1")}

    def pending_results(self, after_step: int | None = None) -> list[PendingResult]:
        """Accepted results to put back into the buffer on resume: never trained, or trained by a
        step after ``after_step`` (the resumed checkpoint's step), in arrival order."""
        cond = "trained_step IS NULL" if after_step is None else "(trained_step IS NULL OR trained_step > ?)"
        args: tuple[Any, ...] = () if after_step is None else (after_step,)
        # payloads in the log (payload_refs) or, written before it, in result_payloads
        rows = self._read(
            "SELECT results.id, task_id, node, version, tokens, rollouts, received_at, p.payload, NULL, NULL, NULL"
            " FROM results JOIN result_payloads AS p ON p.result_id = results.id"
            f" WHERE accepted = 1 AND {cond}"
            " UNION ALL SELECT results.id, task_id, node, version, tokens, rollouts, received_at, NULL, r.segment,"
            " r.offset, r.length FROM results JOIN payload_refs AS r ON r.result_id = results.id"
            f" WHERE accepted = 1 AND {cond} ORDER BY 1",
            args + args,
        )
        with self._lock:
            logged = iter(self._payloads.read([(int(r[8]), int(r[9]), int(r[10])) for r in rows if r[7] is None]))
        return [PendingResult(t, n, v, tok, ro, at, bytes(p) if p is not None else next(logged))
                for _, t, n, v, tok, ro, at, p, *_ref in rows]

    def mark_trained(self, task_ids: Iterable[str], step: int) -> int:
        """Record that the learner step ``step`` consumed these results; returns rows updated."""
        ids = list(dict.fromkeys(task_ids))
        n = 0
        with self._tx() as db:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                q = ",".join("?" * len(part))
                n += db.execute(
                    f"UPDATE results SET trained_step = ? WHERE accepted = 1 AND task_id IN ({q})", (step, *part)
                ).rowcount
        return n

    def drop_pending(self, task_ids: Iterable[str], reason: str) -> int:
        """Results that will never be trained (e.g. stale after a resume): free their payload."""
        ids = list(dict.fromkeys(task_ids))
        n = 0
        with self._tx() as db:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                q = ",".join("?" * len(part))
                cond = f"accepted = 1 AND trained_step IS NULL AND task_id IN ({q})"
                for table in ("result_payloads", "payload_refs"):
                    db.execute(f"DELETE FROM {table} WHERE result_id IN (SELECT id FROM results WHERE {cond})", part)
                n += db.execute(f"UPDATE results SET reason = ? WHERE {cond}", (reason, *part)).rowcount
            self._free_segments(db)
        return n

    def _free_segments(self, db: sqlite3.Connection) -> None:
        """Delete the payload segments no row refers to any more once this transaction commits
        (a rollback keeps every segment its rows need; appends go only to the segment being
        written, which is kept)."""
        live = [int(r[0]) for r in db.execute("SELECT DISTINCT segment FROM payload_refs")]
        self._after_commit.append(lambda: self._payloads.keep_only(live))

    def prune_payloads(self, upto_step: int) -> int:
        """Free payloads of results trained at or before a checkpointed step."""
        with self._tx() as db:
            n = 0
            for table in ("result_payloads", "payload_refs"):
                n += db.execute(
                    f"DELETE FROM {table} WHERE result_id IN"
                    " (SELECT id FROM results WHERE trained_step IS NOT NULL AND trained_step <= ?)",
                    (upto_step,),
                ).rowcount
            self._free_segments(db)
            return n

    def result_counts(self) -> dict[str, int]:
        """Results by outcome: ``accepted`` and one key per refusal reason."""
        out: dict[str, int] = {}
        for acc, reason, n in self._read("SELECT accepted, reason, COUNT(*) FROM results GROUP BY accepted, reason"):
            key = "accepted" if acc else reason
            out[key] = out.get(key, 0) + int(n)
        return out

    # --- policy versions ---------------------------------------------------------------------------
    def record_version(self, version: int, published_at: float, total_bytes: int, encoded_bytes: int) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO versions (version, published_at, total_bytes, encoded_bytes)"
                " VALUES (?, ?, ?, ?)",
                (version, published_at, total_bytes, encoded_bytes),
            )

    def set_version_times(
        self, version: int, first_s: float | None, median_s: float | None, last_s: float | None, nodes: int
    ) -> None:
        """Broadcast times (seconds from publication to the first/median/last node holding it)."""
        with self._tx() as db:
            db.execute(
                "UPDATE versions SET first_s = ?, median_s = ?, last_s = ?, nodes = ? WHERE version = ?",
                (first_s, median_s, last_s, nodes, version),
            )

    def versions(self, limit: int = 100) -> list[VersionRecord]:
        """The newest ``limit`` versions, oldest first."""
        rows = self._read(
            "SELECT version, published_at, total_bytes, encoded_bytes, first_s, median_s, last_s, nodes"
            " FROM versions ORDER BY version DESC LIMIT ?",
            (limit,),
        )
        return [VersionRecord(*r) for r in reversed(rows)]

    # --- evaluations -------------------------------------------------------------------------------
    def record_eval(self, rec: dict[str, Any], now: float) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO evaluations (step, wall_s, mean_reward, accuracy, n, excluded, at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (int(rec["step"]), float(rec["wall_s"]), rec["mean_reward"], rec["accuracy"], int(rec["n"]),
                 int(rec.get("excluded", 0)), now),
            )

    def evaluations(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT step, wall_s, mean_reward, accuracy, n, excluded FROM evaluations ORDER BY step")
        keys = ("step", "wall_s", "mean_reward", "accuracy", "n", "excluded")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    # --- per-step figures (trainmetrics.py) -------------------------------------------------------------
    def record_train_metrics(self, step: int, wall_s: float, metrics: dict[str, float]) -> None:
        """One learner step's figures; a step trained again after a restart replaces its row."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO train_metrics (step, wall_s, metrics) VALUES (?, ?, ?)",
                       (int(step), float(wall_s), json.dumps(metrics)))

    def train_metrics(self, last: int | None = None) -> list[dict[str, Any]]:
        """``{"step", "wall_s", **metrics}`` per step, in step order (only the ``last`` N when given)."""
        sql = "SELECT step, wall_s, metrics FROM train_metrics ORDER BY step"
        rows = self._read(sql) if last is None else self._read(
            f"SELECT * FROM ({sql} DESC LIMIT ?) ORDER BY step", (int(last),))
        return [{"step": int(s), "wall_s": float(w), **json.loads(m)} for s, w, m in rows]

    # --- meta --------------------------------------------------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    # --- operator reports (`echo2 hub nodes`, `echo2 hub ledger`) -----------------------------------
    def node_rows(self) -> list[NodeRow]:
        cost = {r.peer_id: r.cost_usd for r in self.load_ledger()}
        return [
            NodeRow(
                peer_id=n.peer_id,
                hardware=hardware_summary(n.announce),
                price_usd_per_hour=n.price,
                measured_rate=n.measured_rate,
                reputation=n.reputation,
                state="banned" if n.banned else n.state,
                cost_usd=cost.get(n.peer_id, 0.0),
            )
            for n in self.list_nodes()
        ]

    def nodes_report(self) -> str:
        return render_nodes(self.node_rows())

    def ledger_report(self, *, as_csv: bool = False) -> str:
        rows = self.load_ledger()
        return ledger_csv(rows, totals_of(rows)) if as_csv else render_ledger(rows, totals_of(rows))


__all__ = [
    "MIGRATIONS", "AdmissionRecord", "HubStore", "NodeRecord", "PendingResult", "StoreError", "TaskRecord",
    "VersionRecord",
]
