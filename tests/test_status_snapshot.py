"""The hub's status over HTTP comes from the last status its writer produced (issue 20): a real
Hub writes status.json in chunks, a real StatusServer serves those bytes and pages rendered from
the same snapshot, and never builds the status on the loop for a request."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import trio
from hubkit import small_hub_cfg
from test_hub_results import admit

from echo2.learner_hub.hub import Hub
from echo2.learner_hub.status_http import StatusServer, hub_metrics, render_metrics, render_tables
from echo2.protocol.identity import Identity


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


def test_http_serves_the_written_snapshot(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path))
    nodes = [Identity.generate() for _ in range(3)]
    for n in nodes:
        assert admit(hub, n).admitted
    built = {"n": 0}

    def live_status() -> dict[str, Any]:  # what the server must not call once it has snapshots
        built["n"] += 1
        return hub.status()

    async def main() -> None:
        server = StatusServer(live_status, list, timeout_s=2.0, snapshot=lambda: hub.status_snapshot)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            base = f"http://127.0.0.1:{port}"
            code, headers, _ = await trio.to_thread.run_sync(fetch, base + "/status.json")
            assert code == 503 and headers.get("Retry-After") == "1"  # nothing written yet
            await hub.publish()
            await hub.write_status()
            written = (tmp_path / "status.json").read_bytes()
            code, headers, data = await trio.to_thread.run_sync(fetch, base + "/status.json")
            assert code == 200 and data == written  # the bytes written, not a status built anew
            assert int(headers["Age"]) >= 0
            got = json.loads(data)
            assert {n["peer_id"] for n in got["nodes"]} == {n.peer_id for n in nodes}
            assert got["written_at"] > 0 and set(got["curves"]) == {"train", "eval", "broadcast", "nodes"}
            code, _, page = await trio.to_thread.run_sync(fetch, base + "/")
            assert code == 200 and nodes[0].peer_id in page.decode() and 'id="curves-data"' in page.decode()
            code, _, tables = await trio.to_thread.run_sync(fetch, base + "/tables.html")
            assert code == 200 and "Fleet (3 nodes)" in tables.decode()
            code, _, metrics = await trio.to_thread.run_sync(fetch, base + "/metrics")
            assert code == 200 and "echo2_nodes_active 3" in metrics.decode()
            # a node joins: the next write shows it; the server answered nothing from the live state
            late = Identity.generate()
            await hub.on_admission(late.peer_id, _admission(late))
            await hub.write_status()
            code, _, data = await trio.to_thread.run_sync(fetch, base + "/status.json")
            assert late.peer_id in {n["peer_id"] for n in json.loads(data)["nodes"]}
            assert built["n"] == 0
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        hub.store.close()


def _admission(node: Identity) -> bytes:
    from hubkit import announce

    from echo2.protocol import envelope
    from echo2.protocol.messages import AdmissionRequest

    return envelope.seal(node, AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id)))


def test_page_and_metrics_of_a_snapshot_with_the_first_nodes_only() -> None:
    """A snapshot keeps the nodes the page shows and the count by state: the page and /metrics
    report the whole fleet from those."""
    shown = [{"peer_id": f"n{i}", "state": "active"} for i in range(200)]
    snap = {"nodes": shown, "node_count": 10_000, "node_states": {"active": 9_000, "standby": 1_000}}
    assert "Fleet (10000 nodes)" in render_tables(snap)
    text = render_metrics(hub_metrics(snap))
    assert "echo2_nodes_active 9000" in text and 'echo2_nodes{state="standby"} 1000' in text
