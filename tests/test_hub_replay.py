"""Issue 15, A3: admission requests from throw-away keys must not fill replay state that admitted
peers depend on (real hub, real signatures, no network: the handlers are called directly)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import announce

from echo2.learner_hub.admission import make_join_token
from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error, Replay
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest, TaskDecline

CAP = 64  # every replay pool the hub builds is shrunk to this, so a flood of 100 keys stands for 1M




@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Hub:
    real = envelope.ReplayGuard

    def capped(*args: Any, **kw: Any) -> envelope.ReplayGuard:
        kw["max_entries"] = min(int(kw.get("max_entries", CAP)), CAP)
        return real(*args, **kw)

    monkeypatch.setattr(envelope, "ReplayGuard", capped)
    cfg = HubConfig(dir=str(tmp_path), steps=10, prompts_per_step=2, group_size=4, max_new_tokens=4, admission="token")
    return Hub(cfg)


def request_admission(hub: Hub, node: Identity, token: str) -> AdmissionDecision:
    req = AdmissionRequest(peer_id=node.peer_id, join_token=token, announce=announce(node.peer_id))
    reply = trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    return envelope.open_envelope(reply, AdmissionDecision, replay=None).message


def test_a3_admission_flood_from_fresh_keys_refuses_no_honest_message(hub: Hub) -> None:
    token = make_join_token(hub.identity, ttl_s=3600, now=time.time())
    honest = Identity.generate()
    assert request_admission(hub, honest, token).admitted

    async def flood() -> None:
        for _ in range(100):
            key = Identity.generate()
            req = AdmissionRequest(peer_id=key.peer_id, join_token="", announce=announce(key.peer_id))
            try:  # refused by the admission policy (no token) or the admission bucket: either way
                await hub.on_admission(key.peer_id, envelope.seal(key, req))
            except Echo2Error as exc:
                assert not isinstance(exc, Replay), exc  # the flood must not lock the flooders out either

    trio.run(flood)
    for i in range(3):  # the admitted peer's own messages go through
        decline = TaskDecline(task_id=f"t{i}", task_hash=bytes(32), node_id=honest.peer_id, reason_code="busy", reason="")
        trio.run(hub.on_decline, honest.peer_id, envelope.seal(honest, decline))
    # and a newcomer with a token is not refused as a replay (at worst by the admission bucket)
    late = Identity.generate()
    try:
        request_admission(hub, late, token)
    except Echo2Error as exc:
        assert not isinstance(exc, Replay), exc
