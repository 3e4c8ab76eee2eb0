"""A5: a node's claim to hold a version earns work on it only with a proof (the hub's challenge
answered from the version's bytes). A real Hub; its handler called directly with signed messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hubkit import hold, small_hub_cfg
from test_hub_results import admit

from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope, holdsproof
from echo2.protocol.errors import MeaningError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, HoldsChallenge, HoldsProof, HoldsVersion


def report(hub: Hub, node: Identity, version: int = 0) -> HoldsChallenge:
    reply = trio.run(hub.on_holds, node.peer_id, envelope.seal(node, HoldsVersion(peer_id=node.peer_id, version=version,
                                                                                   seconds=0.1)))
    ch = envelope.open_envelope(reply, HoldsChallenge, replay=None).message
    assert isinstance(ch, HoldsChallenge)
    return ch


def prove(hub: Hub, node: Identity, ch: HoldsChallenge, digest: bytes) -> bytes:
    proof = HoldsProof(peer_id=node.peer_id, version=ch.version, nonce=ch.nonce, digest=digest)
    data: bytes = trio.run(hub.on_holds, node.peer_id, envelope.seal(node, proof))
    return data


def test_a_claim_alone_earns_no_work_a_proof_does(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path))
    trio.run(hub.publish)
    honest, liar = Identity.generate(), Identity.generate()
    assert admit(hub, honest).admitted and admit(hub, liar).admitted
    raw = hub.publisher.recent[0].packed.raw_chunks
    # the liar reports holding v0 and answers without the bytes: refused, no work, reputation lower
    ch = report(hub, liar)
    assert hub.nodes[liar.peer_id].held_version == -1
    assert 0 <= ch.index < len(raw) and ch.offset + ch.length <= len(raw[ch.index]) and ch.length <= holdsproof.CHALLENGE_BYTES
    rep0 = hub.reputation.score(liar.peer_id)
    with pytest.raises(MeaningError, match="wrong proof"):
        prove(hub, liar, ch, bytes(32))
    assert hub.nodes[liar.peer_id].held_version == -1 and hub.reputation.score(liar.peer_id) < rep0
    # the right bytes under another nonce (an answer seen elsewhere) are worth nothing
    ch2 = report(hub, liar)
    with pytest.raises(MeaningError, match="wrong proof"):
        prove(hub, liar, ch2, holdsproof.answer(bytes(16), raw[ch2.index], ch2.offset, ch2.length))
    assert hub.nodes[liar.peer_id].held_version == -1
    seen = holdsproof.answer(ch.nonce, raw[ch.index], ch.offset, ch.length)
    # the honest node answers from the bytes: a holder, given work on v0
    ok = envelope.open_envelope(trio.run(hold, hub, honest, 0), ErrorReply, replay=None).message
    assert ok.code == "ok" and hub.nodes[honest.peer_id].held_version == 0
    # the same proof again: its challenge is spent
    with pytest.raises(MeaningError, match="no open challenge"):
        prove(hub, honest, ch, seen)
    hub.store.close()


def test_challenge_ranges_stay_inside_the_version_and_a_node_checks_them(tmp_path: Path) -> None:
    import random

    hub = Hub(small_hub_cfg(tmp_path))
    trio.run(hub.publish)
    m = hub.publisher.recent[0].packed.manifest
    rng = random.Random(1)
    for _ in range(200):
        i, off, n = holdsproof.choose(m, rng)
        assert 0 < n <= holdsproof.CHALLENGE_BYTES and off + n <= m.chunks[i].raw_size
    node = Identity.generate()
    # a hostile hub's challenge outside the chunk is refused before anything is read
    for bad in (HoldsChallenge(node.peer_id, 0, bytes(16), len(m.chunks), 0, 1),
                HoldsChallenge(node.peer_id, 0, bytes(16), 0, m.chunks[0].raw_size, 1),
                HoldsChallenge(node.peer_id, 1, bytes(16), 0, 0, 1)):
        with pytest.raises(MeaningError):
            holdsproof.check(bad, m)
    hub.store.close()
