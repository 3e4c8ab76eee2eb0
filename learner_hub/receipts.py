"""Receipts: the hub's signed answer to an accepted result (issue 19, proof of contribution).

The node keeps each one as received and can check it offline years later, so a receipt states
the hub's own figures (its token count, the price the task was issued at) and the node's account
right after the batch, from the ledger. Pure: the hub passes the clock and the ledger row.
"""

from __future__ import annotations

from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Receipt

from .ledger import AccountRow

#: Lifetime of the receipt's envelope: only for the node's online check of the reply (its replay
#: guard and expiry); offline verification ignores it. Results are retried for minutes (A1), but
#: each reply is read as soon as it arrives.
RECEIPT_TTL_S = 300.0


def make_receipt(
    hub_id: str, node_id: str, task_id: str, *, rollouts: int, tokens: int, price_micro: int,
    accepted_at: float, account: AccountRow,
) -> Receipt:
    """The receipt for one accepted result; ``account`` is the node's ledger row with it counted."""
    return Receipt(
        hub_id=hub_id, node_id=node_id, task_ids=[task_id], results=1, rollouts=rollouts, tokens=tokens,
        price_micro=price_micro, accepted_at=accepted_at, account_results=account.accepted_results,
        account_rollouts=account.accepted_rollouts, account_tokens=account.accepted_tokens,
        account_cost_micro=account.cost_micro,
    )


def make_batch_receipt(
    hub_id: str, node_id: str, task_ids: list[str], *, rollouts: int, tokens: int, price_micro: int,
    accepted_at: float, account: AccountRow,
) -> Receipt:
    """One receipt for several accepted results of a node's ResultBatch (all issued at
    ``price_micro``; at most MAX_RECEIPT_TASKS): one signature instead of one per result (sealing
    was ~0.2-0.3 ms of the hub's CPU per small result). ``account`` counts all of them."""
    return Receipt(
        hub_id=hub_id, node_id=node_id, task_ids=list(task_ids), results=len(task_ids), rollouts=rollouts,
        tokens=tokens, price_micro=price_micro, accepted_at=accepted_at, account_results=account.accepted_results,
        account_rollouts=account.accepted_rollouts, account_tokens=account.accepted_tokens,
        account_cost_micro=account.cost_micro,
    )


def make_statement(hub_id: str, node_id: str, *, price_micro: int, at: float, account: AccountRow) -> Receipt:
    """A receipt of no results: the node's account when the hub stops billing it (it paused or
    left). Time billed after a node's last accepted result is stated only here."""
    return Receipt(
        hub_id=hub_id, node_id=node_id, task_ids=[], results=0, rollouts=0, tokens=0, price_micro=price_micro,
        accepted_at=at, account_results=account.accepted_results, account_rollouts=account.accepted_rollouts,
        account_tokens=account.accepted_tokens, account_cost_micro=account.cost_micro,
    )


def seal_receipt(identity: Identity, receipt: Receipt) -> bytes:
    return envelope.seal(identity, receipt, ttl_s=RECEIPT_TTL_S)
