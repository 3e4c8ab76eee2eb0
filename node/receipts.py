"""The node's proof of contribution (issue 19): the hub's signed receipts, kept and summed.

For every accepted result the hub answers with a :class:`~echo2.protocol.messages.Receipt` in a
signed envelope. The node checks it like any hub message (size, signature over the bytes as
received, signer = the hub it works for, then the schema), and appends the envelope, byte for
byte, to ``DATA_DIR/receipts.bin`` (records of a 4-byte big-endian length and the envelope; one
writer, the node, through a worker thread). Results the hub refused go to
``DATA_DIR/rejections.jsonl`` with the hub's reason: the hub does not sign a refusal, so those lines
are the node's own record.

Offline (``echo2 node receipts --verify``) every kept envelope is checked again: its signature, made
by the key embedded in the receipt's ``hub_id``, over the bytes as kept; its expiry is irrelevant
then, so it is checked as of the time it was signed. A single changed byte anywhere in a record
makes it fail (the length prefix included: the records after it can no longer be found, and say so).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error, MeaningError
from echo2.protocol.messages import ErrorReply, Receipt
from echo2.protocol.replay import ReplayCheck

log = logging.getLogger(__name__)

RECEIPTS_FILE = "receipts.bin"
REJECTIONS_FILE = "rejections.jsonl"
_LEN = struct.Struct(">I")
MICRO = 1_000_000
#: batch receipts remembered to recognise their repeats (a batch is at most 32 items, 2 receipts)
RECENT_RECEIPTS = 64


class ReceiptError(MeaningError):
    """The hub's receipt does not say what it must (another hub, another node, another task)."""

    code = "bad_receipt"


def check_receipt(data: bytes, *, hub_peer: str, me: str, task_id: str, replay: ReplayCheck | None,
                  now: float | None = None) -> Receipt | None:
    """The receipt in the hub's reply to our result for ``task_id``; None if the hub sent a plain
    "accepted" (a hub from before receipts). Raises Echo2Error for anything else."""
    v = envelope.open_envelope(data, (Receipt, ErrorReply), replay=replay, now=now,
                               allowed=lambda signer, _t: signer == hub_peer, max_size=Receipt.MAX_SIZE)
    msg = v.message
    if isinstance(msg, ErrorReply):
        if msg.code != "ok":
            raise ReceiptError(f"hub replied {msg.code!r} to an accepted result: {msg.message[:200]}")
        return None
    assert isinstance(msg, Receipt)
    _check_names(msg, v.signer)
    if msg.node_id != me:
        raise ReceiptError(f"receipt names another node ({msg.node_id})")
    if task_id not in msg.task_ids:
        raise ReceiptError(f"receipt does not name task {task_id}")
    return msg


def check_statement(data: bytes, *, hub_peer: str, me: str, replay: ReplayCheck | None,
                    now: float | None = None) -> Receipt | None:
    """The statement in the hub's reply to our pause message; None for a plain "noted"."""
    v = envelope.open_envelope(data, (Receipt, ErrorReply), replay=replay, now=now,
                               allowed=lambda signer, _t: signer == hub_peer, max_size=Receipt.MAX_SIZE)
    msg = v.message
    if isinstance(msg, ErrorReply):
        return None
    assert isinstance(msg, Receipt)
    _check_names(msg, v.signer)
    if msg.node_id != me:
        raise ReceiptError(f"statement names another node ({msg.node_id})")
    if not msg.is_statement:
        raise ReceiptError("the hub answered a pause with a receipt for results")
    return msg


def _check_names(r: Receipt, signer: str) -> None:
    if r.hub_id != signer:
        raise ReceiptError(f"receipt names hub {r.hub_id} but was signed by {signer}")


def verify_offline(data: bytes) -> tuple[Receipt, float]:
    """A kept receipt envelope, verified with the key in its own ``hub_id``: (receipt, signed at).
    Raises Echo2Error if any byte of it is not what the hub signed."""
    if len(data) > Receipt.MAX_SIZE:
        raise MeaningError(f"record of {len(data)} bytes exceeds a receipt's {Receipt.MAX_SIZE}")
    at = envelope.signed_at(data)
    v = envelope.open_envelope(data, Receipt, now=at, replay=None)
    _check_names(v.message, v.signer)
    return v.message, at


# --- the files -----------------------------------------------------------------------------------


def _append(path: Path, record: bytes) -> None:
    # a receipt is the volunteer's proof of payment: on disk before we say it was kept
    with open(path, "ab") as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())


class ReceiptBook:
    """Where a running node keeps its receipts and refusals (appends in a worker thread)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / RECEIPTS_FILE
        self.rejections = data_dir / REJECTIONS_FILE
        self._lock = trio.Lock()  # records stay whole: one append at a time
        self.kept = 0
        self._last_statement: tuple[str, int, int] | None = None
        # receipts already checked: a batch's items share one receipt naming all their tasks (the
        # hub signs once per batch), so the same envelope comes once per item, kept once
        self._recent: collections.OrderedDict[bytes, Receipt] = collections.OrderedDict()

    async def accepted(self, reply: bytes, *, hub_peer: str, me: str, task_id: str, replay: ReplayCheck | None) -> None:
        """The hub's reply to an accepted result: keep its receipt (a bad one is logged, not kept)."""
        seen = self._recent.get(reply)
        if seen is not None and task_id in seen.task_ids:
            return  # this task's receipt is one already kept (its batch's)
        try:
            receipt = check_receipt(reply, hub_peer=hub_peer, me=me, task_id=task_id, replay=replay)
        except Echo2Error as exc:
            log.warning("receipt for task %s refused: %s", task_id, exc)
            return
        if receipt is not None and len(receipt.task_ids) > 1:
            self._recent[reply] = receipt
            while len(self._recent) > RECENT_RECEIPTS:
                self._recent.popitem(last=False)
        if receipt is None:
            log.info("hub sent no receipt for task %s (a hub from before receipts)", task_id)
            return
        if not await self._write(self.path, _LEN.pack(len(reply)) + reply):
            return
        self.kept += 1
        log.info("receipt for task %s: %d tokens, credit at hub %s now $%.6f", task_id, receipt.tokens,
                 hub_peer[-8:], receipt.account_cost_micro / MICRO)

    async def statement(self, reply: bytes, *, hub_peer: str, me: str, replay: ReplayCheck | None) -> None:
        """The hub's reply to our pause or goodbye: a statement of our account when it stopped
        billing us, kept like a receipt (a plain "noted" is not kept). A paused node repeats its
        pause as a keepalive, so an account already stated is not kept twice."""
        try:
            r = check_statement(reply, hub_peer=hub_peer, me=me, replay=replay)
        except Echo2Error as exc:
            log.warning("statement from the hub refused: %s", exc)
            return
        key = (hub_peer, r.account_results, r.account_cost_micro) if r is not None else None
        if r is None or key == self._last_statement:
            return
        if await self._write(self.path, _LEN.pack(len(reply)) + reply):
            self._last_statement = key
            log.info("statement from hub %s: %d results, credit $%.6f", hub_peer[-8:], r.account_results,
                     r.account_cost_micro / MICRO)

    async def refused(self, *, hub_peer: str, task_id: str, code: str, reason: str) -> None:
        line = json.dumps({"hub": hub_peer, "task_id": task_id, "code": code, "reason": reason[:1024], "at": time.time()})
        await self._write(self.rejections, (line + "\n").encode())

    async def _write(self, path: Path, record: bytes) -> bool:
        async with self._lock:
            try:
                await trio.to_thread.run_sync(_append, path, record)
            except OSError as exc:  # a full disk loses the record, not the node
                log.error("could not write %s: %s", path, exc)
                return False
        return True


@dataclass
class Record:
    offset: int
    raw: bytes
    receipt: Receipt | None = None
    signed_at: float = 0.0
    error: str = ""


def read_records(path: Path) -> tuple[list[Record], str]:
    """The records of a receipts file, each verified; and what is wrong with the file's tail
    ("" if nothing: a length that cannot be a receipt's, or a record cut short)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], ""
    out: list[Record] = []
    at = 0
    while at < len(data):
        if at + _LEN.size > len(data):
            return out, f"{len(data) - at} stray bytes at offset {at}"
        (n,) = _LEN.unpack_from(data, at)
        if n == 0 or n > Receipt.MAX_SIZE or at + _LEN.size + n > len(data):
            return out, f"record at offset {at} is corrupt or cut short (length {n}); the rest of the file is unreadable"
        rec = Record(at, data[at + _LEN.size : at + _LEN.size + n])
        try:
            rec.receipt, rec.signed_at = verify_offline(rec.raw)
        except Echo2Error as exc:
            rec.error = str(exc)
        out.append(rec)
        at += _LEN.size + n
    return out, ""


def read_rejections(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(d, dict):
            out.append(d)
    return out


# --- sums ------------------------------------------------------------------------------------------


@dataclass
class HubCredit:
    """What one hub's valid receipts add up to (each task counted once)."""

    hub: str
    receipts: int = 0
    statements: int = 0  # receipts of no results: the account when the hub stopped billing
    results: int = 0
    rollouts: int = 0
    tokens: int = 0
    credit_micro: int = 0  # the latest receipt's account figure: what the hub owes so far
    account_results: int = 0
    account_tokens: int = 0
    days: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hub": self.hub, "receipts": self.receipts, "statements": self.statements, "results": self.results, "rollouts": self.rollouts,
            "tokens": self.tokens, "credit_micro_usd": self.credit_micro, "credit_usd": self.credit_micro / MICRO,
            "account_results": self.account_results, "account_tokens": self.account_tokens,
            "complete": self.results == self.account_results and self.tokens == self.account_tokens,
            "days": self.days,
        }


def credit(receipts: Iterable[Receipt]) -> dict[str, HubCredit]:
    """Per hub: the sums of its receipts and, per UTC day, results, tokens and the credit earned
    (the rise of the hub's account figure over the day)."""
    by_hub: dict[str, list[Receipt]] = {}
    for r in receipts:
        by_hub.setdefault(r.hub_id, []).append(r)
    out: dict[str, HubCredit] = {}
    for hub, rs in by_hub.items():
        c = out[hub] = HubCredit(hub)
        seen: set[str] = set()
        prev_cost = 0
        for r in sorted(rs, key=lambda r: (r.account_results, r.accepted_at)):
            if r.is_statement:
                c.statements += 1
            elif any(t in seen for t in r.task_ids):
                continue  # the same task's receipt kept twice is counted once
            else:
                c.receipts += 1
            seen.update(r.task_ids)
            c.results, c.rollouts, c.tokens = c.results + r.results, c.rollouts + r.rollouts, c.tokens + r.tokens
            day = time.strftime("%Y-%m-%d", time.gmtime(r.accepted_at))
            d = c.days.setdefault(day, {"results": 0, "tokens": 0, "earned_micro_usd": 0})
            d["results"] += r.results
            d["tokens"] += r.tokens
            d["earned_micro_usd"] += max(0, r.account_cost_micro - prev_cost)
            prev_cost = max(prev_cost, r.account_cost_micro)
            c.credit_micro = prev_cost
            c.account_results = max(c.account_results, r.account_results)
            c.account_tokens = max(c.account_tokens, r.account_tokens)
    return out


def summary(data_dir: Path) -> dict[str, Any]:
    """Receipts (verified) and refusals kept in ``data_dir``: what `node status` and
    `node receipts` show."""
    records, tail = read_records(data_dir / RECEIPTS_FILE)
    good = [r.receipt for r in records if r.receipt is not None]
    bad = [{"offset": r.offset, "error": r.error} for r in records if r.receipt is None]
    if tail:
        bad.append({"offset": -1, "error": tail})
    rejections = read_rejections(data_dir / REJECTIONS_FILE)
    reasons: dict[str, int] = {}
    for rej in rejections:
        key = str(rej.get("reason") or rej.get("code") or "?")
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "receipts": len(records),
        "verified": len(good),
        "refused": bad,
        "hubs": {h: c.as_dict() for h, c in sorted(credit(good).items())},
        "rejected_results": len(rejections),
        "rejected_by_reason": reasons,
    }


def render(s: dict[str, Any]) -> str:
    lines = [f"receipts      {s['verified']} verified of {s['receipts']} kept"]
    for hub, c in s["hubs"].items():
        note = "" if c["complete"] else (
            f" (the hub counts {c['account_results']} results, {c['account_tokens']} tokens: some receipts are not here)")
        lines.append(f"hub {hub}: credit ${c['credit_usd']:.6f}, {c['results']} results, {c['rollouts']} rollouts, "
                     f"{c['tokens']} tokens, {c['statements']} statements{note}")
        for day, d in sorted(c["days"].items()):
            lines.append(f"  {day}  {d['results']:6d} results  {d['tokens']:9d} tokens  "
                         f"earned ${d['earned_micro_usd'] / MICRO:.6f}")
    lines.append(f"rejected      {s['rejected_results']} results")
    for reason, n in sorted(s["rejected_by_reason"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:6d}  {reason}")
    for b in s["refused"]:
        where = "file" if b["offset"] < 0 else f"record at offset {b['offset']}"
        lines.append(f"REFUSED {where}: {b['error']}")
    return "\n".join(lines)
