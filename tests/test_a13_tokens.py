"""A13 (tokens): a join token is used by at most --max-uses distinct nodes and can be revoked with
`echo2 hub token revoke ID`; both are kept in the hub's SQLite store, so they hold across restarts
(the real hub's admission path, the real CLI, the real store)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import hubkit
import pytest
import trio

from echo2.learner_hub import cli as hub_cli
from echo2.learner_hub.admission import make_join_token, token_id, verify_join_token
from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.store import HubStore
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest, Announce


def announce(peer: str) -> Announce:
    return hubkit.announce(peer, rollouts_per_s=0.0, price_usd_per_hour=0.0)


def request(hub: Hub, ident: Identity, token: str) -> AdmissionDecision:
    req = AdmissionRequest(peer_id=ident.peer_id, join_token=token, announce=announce(ident.peer_id))
    reply = trio.run(hub.on_admission, ident.peer_id, envelope.seal(ident, req))
    return envelope.open_envelope(reply, AdmissionDecision, replay=envelope.ReplayGuard()).message


def hub_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    hub_cli.register(p)
    args = p.parse_args(argv)
    return int(args.func(args))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    return Hub(HubConfig(dir=str(tmp_path_factory.mktemp("hub")), admission="token"))


def test_a13_tokens_max_uses_counts_distinct_nodes(hub: Hub, capsys: pytest.CaptureFixture[str]) -> None:
    assert hub_cmd(["token", "--dir", str(hub.dir), "--max-uses", "2", "--expires", "1h"]) == 0
    out = capsys.readouterr()
    token = out.out.strip()
    tid = out.err.split()[2]
    assert tid == token_id(verify_join_token(token, hub.identity.peer_id, time.time())["nonce"])
    a, b, c = (Identity.generate() for _ in range(3))
    assert request(hub, a, token).admitted and request(hub, b, token).admitted
    third = request(hub, c, token)
    assert not third.admitted and "used by as many nodes as it allows" in third.reason
    assert request(hub, a, token).admitted  # a node coming back with its token uses no second use
    (rec,) = [t for t in hub.store.tokens() if t.token_id == tid]
    assert rec.uses == 2 and rec.max_uses == 2
    # the count is in the store: a fresh store on the same file refuses the third node too
    with HubStore.in_dir(hub.dir) as st:
        assert st.use_token(tid, c.peer_id, 2, 0.0) == "token_used_up"


def test_a13_tokens_revoke(hub: Hub, capsys: pytest.CaptureFixture[str]) -> None:
    token = make_join_token(hub.identity, ttl_s=3600, now=time.time())
    tid = token_id(verify_join_token(token, hub.identity.peer_id, time.time())["nonce"])
    a, b = Identity.generate(), Identity.generate()
    assert request(hub, a, token).admitted
    # revoked while the hub runs (the CLI writes the same database)
    assert hub_cmd(["token", "revoke", tid, "--dir", str(hub.dir)]) == 0
    assert "revoked join token" in capsys.readouterr().out
    for ident in (a, b):  # neither a new node nor the one that used it may join with it again
        d = request(hub, ident, token)
        assert not d.admitted and "revoked" in d.reason
    assert hub_cmd(["token", "list", "--dir", str(hub.dir)]) == 0
    assert f"{tid}  revoked" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        hub_cmd(["token", "revoke", "not-an-id", "--dir", str(hub.dir)])


def test_a13_tokens_max_uses_is_signed() -> None:
    ident = Identity.generate()
    tok = make_join_token(ident, ttl_s=60, now=0.0, max_uses=3)
    assert verify_join_token(tok, ident.peer_id, 1.0)["max_uses"] == 3
    with pytest.raises(ValueError):
        make_join_token(ident, ttl_s=60, now=0.0, max_uses=0)


def test_a13_tokens_store_survives_reopen(tmp_path: Path) -> None:
    with HubStore.in_dir(tmp_path) as st:
        st.record_token("00112233aabbccdd", 0.0, 100.0, 1, None)
        assert st.use_token("00112233aabbccdd", "p1", 1, 1.0) is None
    with HubStore.in_dir(tmp_path) as st:
        assert st.use_token("00112233aabbccdd", "p2", 1, 2.0) == "token_used_up"
        assert st.revoke_token("00112233aabbccdd", 3.0)
        assert not st.revoke_token("ffffffffffffffff", 3.0)  # unknown ids are revoked all the same
    with HubStore.in_dir(tmp_path) as st:
        assert st.use_token("ffffffffffffffff", "p1", None, 4.0) == "token_revoked"
        assert st.use_token("00112233aabbccdd", "p1", 1, 4.0) == "token_revoked"
