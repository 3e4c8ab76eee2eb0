"""Pure accounting: what each node was paid for and what it produced (BRIEF section 6).

Cost is Σ price × active hours, with the price piecewise constant: a price change closes the
running interval at the old price and opens a new one at the new price, so a node is never billed
a new price for time it served at the old one. The headline figure is $ per accepted token.
Money is counted in integer micro-USD and time in integer milliseconds (no float accumulation;
a price or a duration, however large, stays an exact integer): USD floats are only for display.

Nothing here knows about clocks, trio or the database: every call takes ``now`` (unix seconds).
:meth:`Ledger.snapshot` / :meth:`Ledger.restore` carry the accumulated figures across restarts
(the store persists them); a restored node starts inactive, because the time the hub was down is
not billable - the hub re-activates the node when it is admitted again.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SECONDS_PER_HOUR = 3600.0
MICRO = 1_000_000  # micro-USD per USD
_MS_PER_HOUR = 3_600_000


def to_micro(usd: float) -> int:
    """A dollar figure as integer micro-USD (prices: micro-USD per hour)."""
    return int(round(_check_price(usd) * MICRO))


def _ms(t: float) -> int:
    return int(round(t * 1000.0))


@dataclass
class AccountRow:
    """One node's account up to some time: also the persisted snapshot form.

    Money is integer micro-USD and time integer milliseconds, so that billing never accumulates
    float error (and a huge figure is an exact integer, not inf): cost is ``cost_micro`` plus
    ``cost_rem`` in micro-USD·ms/h (always below one micro-USD). The float views are for display."""

    peer_id: str
    price_micro: int = 0  # micro-USD per hour
    active: bool = False
    active_ms: int = 0
    cost_micro: int = 0
    accepted_results: int = 0
    accepted_rollouts: int = 0
    accepted_tokens: int = 0
    refused: int = 0
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    cost_rem: int = 0

    @property
    def price_usd_per_hour(self) -> float:
        return self.price_micro / MICRO

    @property
    def active_s(self) -> float:
        return self.active_ms / 1000.0

    @property
    def cost_usd(self) -> float:
        return self.cost_micro / MICRO

    @property
    def usd_per_token(self) -> float | None:
        return self.cost_usd / self.accepted_tokens if self.accepted_tokens else None


@dataclass(frozen=True)
class Totals:
    nodes: int
    active_nodes: int
    active_s: float
    cost_micro: int
    accepted_results: int
    accepted_rollouts: int
    accepted_tokens: int
    refused: int
    refused_by_reason: dict[str, int]

    @property
    def cost_usd(self) -> float:
        return self.cost_micro / MICRO

    @property
    def usd_per_token(self) -> float | None:
        return self.cost_usd / self.accepted_tokens if self.accepted_tokens else None

    @property
    def usd_per_million_tokens(self) -> float | None:
        u = self.usd_per_token
        return None if u is None else u * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "active_nodes": self.active_nodes,
            "active_s": self.active_s,
            "cost_usd": self.cost_usd,
            "cost_micro_usd": self.cost_micro,
            "accepted_results": self.accepted_results,
            "accepted_rollouts": self.accepted_rollouts,
            "accepted_tokens": self.accepted_tokens,
            "refused": self.refused,
            "refused_by_reason": dict(self.refused_by_reason),
            "usd_per_token": self.usd_per_token,
            "usd_per_million_tokens": self.usd_per_million_tokens,
        }


def _check_price(price: float) -> float:
    p = float(price)
    if not math.isfinite(p) or p < 0:
        raise ValueError(f"price must be a finite number >= 0, got {price!r}")
    return p


@dataclass
class _Account:
    peer_id: str
    price: int = 0  # micro-USD per hour
    closed_ms: int = 0
    closed_cost: int = 0  # micro-USD·ms/h: exact, divided by 3.6e6 only to report
    active_since: int | None = None  # ms
    accepted_results: int = 0
    accepted_rollouts: int = 0
    accepted_tokens: int = 0
    refused_by_reason: dict[str, int] = field(default_factory=dict)

    def _close(self, now_ms: int) -> None:
        if self.active_since is None:
            return
        # A clock stepping backwards must never produce negative time or cost.
        dt = max(0, now_ms - self.active_since)
        self.closed_ms += dt
        self.closed_cost += dt * self.price
        self.active_since = now_ms

    def row(self, now: float) -> AccountRow:
        now_ms = _ms(now)
        open_ms = max(0, now_ms - self.active_since) if self.active_since is not None else 0
        cost_micro, rem = divmod(self.closed_cost + open_ms * self.price, _MS_PER_HOUR)
        return AccountRow(
            peer_id=self.peer_id,
            price_micro=self.price,
            active=self.active_since is not None,
            active_ms=self.closed_ms + open_ms,
            cost_micro=cost_micro,
            cost_rem=rem,
            accepted_results=self.accepted_results,
            accepted_rollouts=self.accepted_rollouts,
            accepted_tokens=self.accepted_tokens,
            refused=sum(self.refused_by_reason.values()),
            refused_by_reason=dict(self.refused_by_reason),
        )


class Ledger:
    """Per-node active intervals, prices, accepted output and refusals.

    Fleet-wide figures are kept as running sums, changed with each account (issue 20): the
    status and each step's metrics read :meth:`totals` every second, and summing 10,000 rows
    took ~60 ms of the status writer's GIL time (`echo2 bench intake`). :meth:`totals` is then
    O(accounts billed at a price > 0 right now): their cost moves with time, each rounded down
    to a micro-USD on its own as :func:`totals_of` rounds it. ``changed`` names the accounts
    mutated since the owner last cleared it (the status's per-node cache and the ledger save)."""

    def __init__(self) -> None:
        self._acc: dict[str, _Account] = {}
        self.changed: set[str] = set()
        self.touched: set[str] = set()  # the same, for the status's per-node entries (their own reader)
        self._active: set[str] = set()
        self._since_sum = 0  # Σ active_since over active accounts, ms
        self._closed_ms = 0
        self._still_cost = 0  # Σ cost_micro of the accounts whose cost is not moving (inactive or free)
        self._moving: dict[str, _Account] = {}  # active at a price > 0: cost grows with time
        self._latest_since = 0  # the latest active_since: before it, a row clips its open interval at 0
        self._results = self._rollouts = self._tokens = 0
        self._refused: dict[str, int] = {}

    # every mutation goes through _out (its figures leave the sums) and _in (they come back)
    def _out(self, a: _Account) -> None:
        self.changed.add(a.peer_id)
        self.touched.add(a.peer_id)
        self._closed_ms -= a.closed_ms
        if a.active_since is not None:
            self._active.discard(a.peer_id)
            self._since_sum -= a.active_since
        if self._moving.pop(a.peer_id, None) is None:
            self._still_cost -= a.closed_cost // _MS_PER_HOUR
        self._results -= a.accepted_results
        self._rollouts -= a.accepted_rollouts
        self._tokens -= a.accepted_tokens
        for k, v in a.refused_by_reason.items():
            self._refused[k] -= v

    def _in(self, a: _Account) -> None:
        self._closed_ms += a.closed_ms
        if a.active_since is not None:
            self._active.add(a.peer_id)
            self._since_sum += a.active_since
            self._latest_since = max(self._latest_since, a.active_since)
        if a.active_since is not None and a.price > 0:
            self._moving[a.peer_id] = a
        else:
            self._still_cost += a.closed_cost // _MS_PER_HOUR
        self._results += a.accepted_results
        self._rollouts += a.accepted_rollouts
        self._tokens += a.accepted_tokens
        for k, v in a.refused_by_reason.items():
            self._refused[k] = self._refused.get(k, 0) + v

    def _get(self, peer_id: str) -> _Account:
        a = self._acc.get(peer_id)
        if a is None:
            a = self._acc[peer_id] = _Account(peer_id)
            self._in(a)
        return a

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._acc

    def is_active(self, peer_id: str) -> bool:
        a = self._acc.get(peer_id)
        return a is not None and a.active_since is not None

    def activate(self, peer_id: str, now: float, price: float | None = None) -> None:
        """Start billing ``peer_id`` (idempotent; a price given here applies from ``now``)."""
        a = self._get(peer_id)
        if price is not None:
            self.set_price(peer_id, price, now)
        if a.active_since is None:
            self._out(a)
            a.active_since = _ms(now)
            self._in(a)

    def deactivate(self, peer_id: str, now: float) -> None:
        a = self._acc.get(peer_id)
        if a is None or a.active_since is None:
            return
        self._out(a)
        a._close(_ms(now))
        a.active_since = None
        self._in(a)

    def set_price(self, peer_id: str, price: float, now: float) -> None:
        p = to_micro(price)
        a = self._get(peer_id)
        self._out(a)
        a._close(_ms(now))
        a.price = p
        self._in(a)

    def price_micro(self, peer_id: str) -> int:
        """The price ``peer_id`` is billed at now (micro-USD per hour; 0 if unknown)."""
        a = self._acc.get(peer_id)
        return a.price if a is not None else 0

    def accept(self, peer_id: str, rollouts: int, tokens: int) -> None:
        """An accepted result (rollouts = completions, tokens = generated tokens)."""
        if rollouts < 0 or tokens < 0:
            raise ValueError("rollouts and tokens must be >= 0")
        a = self._get(peer_id)
        self.changed.add(peer_id)
        self.touched.add(peer_id)
        a.accepted_results += 1
        a.accepted_rollouts += int(rollouts)
        a.accepted_tokens += int(tokens)
        self._results += 1
        self._rollouts += int(rollouts)
        self._tokens += int(tokens)

    def refuse(self, peer_id: str, reason: str) -> None:
        a = self._get(peer_id)
        self.changed.add(peer_id)
        self.touched.add(peer_id)
        # replaced, never changed in place: a frozen copy of the account shares the old dict
        a.refused_by_reason = {**a.refused_by_reason, reason: a.refused_by_reason.get(reason, 0) + 1}
        self._refused[reason] = self._refused.get(reason, 0) + 1

    def rows(self, now: float) -> list[AccountRow]:
        return [self._acc[p].row(now) for p in sorted(self._acc)]

    def row(self, peer_id: str, now: float) -> AccountRow | None:
        a = self._acc.get(peer_id)
        return a.row(now) if a is not None else None

    def totals(self, now: float) -> Totals:
        """As :func:`totals_of` over :meth:`rows` finds them, from the running sums."""
        now_ms = _ms(now)
        if now_ms < self._latest_since:  # the clock stepped back: each open interval clips at 0 on its own
            return totals_of(self.rows(now))
        cost = self._still_cost
        for a in self._moving.values():
            cost += (a.closed_cost + (now_ms - (a.active_since or 0)) * a.price) // _MS_PER_HOUR
        return Totals(
            nodes=len(self._acc), active_nodes=len(self._active),
            active_s=(self._closed_ms + len(self._active) * now_ms - self._since_sum) / 1000.0,
            cost_micro=cost, accepted_results=self._results, accepted_rollouts=self._rollouts,
            accepted_tokens=self._tokens, refused=sum(self._refused.values()),
            refused_by_reason={k: v for k, v in self._refused.items() if v},
        )

    def peers(self) -> list[str]:
        """Every account's peer, unordered (callers that read rows a chunk at a time)."""
        return list(self._acc)

    # --- persistence ---------------------------------------------------------------------------
    def snapshot(self, now: float) -> list[AccountRow]:
        """The accounts up to ``now`` (what the store persists)."""
        return self.rows(now)

    def view(self, now: float, peers: Iterable[str] | None = None) -> AccountsView:
        """The rows at ``now`` of ``peers``' accounts (None: all), read when
        :meth:`AccountsView.rows` runs: in the store's or the status writer's thread, not on the
        loop (copying 10,000 accounts on the loop held it ~10-40 ms every ledger save, py-spy of
        a 10,000-node hub at rest). Each account is read in one C call (no bytecode boundary,
        so the GIL is not handed over inside it): a row is never half of one change and half of
        the next; an account changed after ``now`` is read as changed."""
        return AccountsView(self._acc, list(self._acc) if peers is None else list(peers), now)

    def take_changed(self, limit: int | None = None) -> list[str]:
        """The accounts a save must write: those changed since they were last taken (at most
        ``limit`` of them, the rest left for the next save). Clears what it returns.

        Active accounts are not rewritten as their billed time grows: a saved row carries the
        moment it was taken as its open interval's start (``HubStore.save_ledger``), and each
        save marks the hub alive, so a restart bills an open interval up to that mark
        (:func:`close_open`). Rewriting every billed account every 10 s was ~1,000 rows a second
        at 10,000 nodes, the largest part of the hub's CPU at rest (py-spy of `echo2 bench
        intake` at rest: ``save_accounts`` 363 of 1,215 samples); a save is now O(changed)."""
        if limit is None or len(self.changed) <= limit:
            out, self.changed = list(self.changed), set()
            return out
        pop = self.changed.pop
        return [pop() for _ in range(max(0, limit))]

    @classmethod
    def restore(cls, rows: Iterable[AccountRow]) -> Ledger:
        """Rebuild from a snapshot; every node comes back inactive (downtime is not billed)."""
        led = cls()
        for r in rows:
            if min(r.price_micro, r.active_ms, r.cost_micro, r.cost_rem) < 0:
                raise ValueError(f"ledger row of {r.peer_id} has a negative figure")
            a = led._acc[r.peer_id] = _Account(
                peer_id=r.peer_id,
                price=int(r.price_micro),
                closed_ms=int(r.active_ms),
                closed_cost=int(r.cost_micro) * _MS_PER_HOUR + int(r.cost_rem),
                active_since=None,
                accepted_results=int(r.accepted_results),
                accepted_rollouts=int(r.accepted_rollouts),
                accepted_tokens=int(r.accepted_tokens),
                refused_by_reason=dict(r.refused_by_reason),
            )
            led._in(a)
        led.changed, led.touched = set(), set()
        return led


#: an account's fields in _Account's order, read in one C call (refused_by_reason is replaced on
#: change, never mutated, so the tuple may keep the dict it read)
_fields = operator.attrgetter("peer_id", "price", "closed_ms", "closed_cost", "active_since", "accepted_results",
                              "accepted_rollouts", "accepted_tokens", "refused_by_reason")


class AccountsView:
    """Some accounts' rows at ``now``, read from the live ledger when :meth:`rows` runs."""

    def __init__(self, accounts: dict[str, _Account], peers: list[str], now: float) -> None:
        self._accounts, self._peers, self.now = accounts, peers, now

    def __len__(self) -> int:
        return len(self._peers)

    def rows(self) -> list[AccountRow]:
        get = self._accounts.get
        read = [_fields(a) for p in sorted(self._peers) if (a := get(p)) is not None]
        return [_Account(*t).row(self.now) for t in read]


def totals_of(rows: Sequence[AccountRow]) -> Totals:
    refused: dict[str, int] = {}
    for r in rows:
        for k, v in r.refused_by_reason.items():
            refused[k] = refused.get(k, 0) + v
    return Totals(
        nodes=len(rows),
        active_nodes=sum(1 for r in rows if r.active),
        active_s=sum(r.active_ms for r in rows) / 1000.0,
        cost_micro=sum(r.cost_micro for r in rows),
        accepted_results=sum(r.accepted_results for r in rows),
        accepted_rollouts=sum(r.accepted_rollouts for r in rows),
        accepted_tokens=sum(r.accepted_tokens for r in rows),
        refused=sum(r.refused for r in rows),
        refused_by_reason=refused,
    )


def close_open(row: AccountRow, since_ms: int, until_ms: int) -> AccountRow:
    """``row`` (its figures up to ``since_ms``, billed from then on) closed at ``until_ms``: the
    open interval added at the row's price, the account inactive. A restart closes a saved
    active account at the last moment the hub was known alive (``HubStore.settle_ledger``)."""
    dt = max(0, until_ms - since_ms)
    cost_micro, rem = divmod(row.cost_micro * _MS_PER_HOUR + row.cost_rem + dt * row.price_micro, _MS_PER_HOUR)
    return dataclasses.replace(row, active=False, active_ms=row.active_ms + dt, cost_micro=cost_micro, cost_rem=rem)


# --- rendering ---------------------------------------------------------------------------------
def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Iterable[int] = ()) -> str:
    """A plain aligned text table (columns in ``right`` are right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    ra = set(right)

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in ra else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def _money(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _dur(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}"


LEDGER_COLUMNS = (
    "peer_id",
    "price_usd_per_hour",
    "active",
    "active_s",
    "cost_usd",
    "accepted_results",
    "accepted_rollouts",
    "accepted_tokens",
    "refused",
    "usd_per_token",
)


def render_ledger(rows: Sequence[AccountRow], totals: Totals | None = None) -> str:
    """The `echo2 hub ledger` table, with a totals line and the $ per accepted token."""
    t = totals if totals is not None else totals_of(rows)
    body = [
        [
            r.peer_id,
            f"{r.price_usd_per_hour:.3f}",
            "yes" if r.active else "no",
            _dur(r.active_s),
            _money(r.cost_usd),
            r.accepted_rollouts,
            r.accepted_tokens,
            r.refused,
            _money(None if r.usd_per_token is None else r.usd_per_token * 1e6, 2),
        ]
        for r in rows
    ]
    body.append(
        [
            f"TOTAL ({t.nodes} nodes)",
            "",
            str(t.active_nodes),
            _dur(t.active_s),
            _money(t.cost_usd),
            t.accepted_rollouts,
            t.accepted_tokens,
            t.refused,
            _money(t.usd_per_million_tokens, 2),
        ]
    )
    headers = ["peer ID", "$/h", "active", "active time", "cost $", "rollouts", "tokens", "refused", "$/Mtok"]
    out = render_table(headers, body, right=range(1, 9))
    per_tok = "-" if t.usd_per_token is None else f"{t.usd_per_token:.3e}"
    return f"{out}\n\n$ per accepted token: {per_tok}"


def ledger_csv(rows: Sequence[AccountRow], totals: Totals | None = None) -> str:
    """CSV with one line per node and a final TOTAL line (machine readable: full precision)."""
    t = totals if totals is not None else totals_of(rows)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(LEDGER_COLUMNS)
    for r in rows:
        w.writerow(
            [
                r.peer_id,
                repr(r.price_usd_per_hour),
                int(r.active),
                repr(r.active_s),
                repr(r.cost_usd),
                r.accepted_results,
                r.accepted_rollouts,
                r.accepted_tokens,
                r.refused,
                "" if r.usd_per_token is None else repr(r.usd_per_token),
            ]
        )
    w.writerow(
        [
            "TOTAL",
            "",
            t.active_nodes,
            repr(t.active_s),
            repr(t.cost_usd),
            t.accepted_results,
            t.accepted_rollouts,
            t.accepted_tokens,
            t.refused,
            "" if t.usd_per_token is None else repr(t.usd_per_token),
        ]
    )
    return buf.getvalue()


@dataclass(frozen=True)
class NodeRow:
    """One line of `echo2 hub nodes`."""

    peer_id: str
    hardware: str
    price_usd_per_hour: float
    measured_rate: float | None
    reputation: float
    state: str
    cost_usd: float


def hardware_summary(announce: dict[str, Any] | None) -> str:
    """A short hardware description from an Announce's wire dict (``"2x H200 141GiB"``)."""
    if not announce:
        return "?"
    acc = str(announce.get("accelerator") or "")
    if acc:
        n = announce.get("accelerator_count") or 1
        mem = announce.get("accelerator_memory_bytes") or 0
        mem_s = f" {int(mem) / 2**30:.0f}GiB" if isinstance(mem, (int, float)) and mem > 0 else ""
        return f"{n}x {acc}{mem_s}"[:40]
    cores = announce.get("cpu_cores") or "?"
    return f"cpu {cores}c {str(announce.get('cpu_model') or '')}".strip()[:40]


def render_nodes(rows: Sequence[NodeRow]) -> str:
    body = [
        [
            r.peer_id,
            r.hardware,
            f"{r.price_usd_per_hour:.3f}",
            "-" if r.measured_rate is None else f"{r.measured_rate:.2f}",
            f"{r.reputation:.2f}",
            r.state,
            _money(r.cost_usd),
        ]
        for r in rows
    ]
    headers = ["peer ID", "hardware", "$/h", "rollouts/s", "reputation", "state", "cost $"]
    return render_table(headers, body, right=(2, 3, 4, 6))
