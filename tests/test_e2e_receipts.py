"""Issue 19 must-show: a real swarm (hub and node processes on 127.0.0.1, the tiny model; the node
joins with a join string naming the hub as /dns4/localhost): the node's receipts verify offline, one with a byte changed is refused, and the credit they sum equals the hub's
ledger for that node: results, rollouts, tokens and money (the statement the hub signs when the
node says goodbye covers the time billed after its last result)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig

TASKS = 5


def receipts_cli(data_dir: Path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "echo2", "node", "receipts", "--verify", "--json", "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, json.loads(p.stdout)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_swarm_receipts_verify_and_sum_to_the_hub_ledger(tmp_path: Path) -> None:
    # the hub runs on (many steps); the node stops by itself after TASKS accepted results, one at a
    # time, so no result of it is in flight when the ledger is read
    # token admission, and the node joins with the string `echo2 hub join-string --host localhost` prints:
    # a /dns4 name (item 5) and the token in one
    cfg = HubConfig(task="copy", steps=10_000, staleness=1, seed=0, admission="token")
    with LocalSwarm(tmp_path, cfg, n_nodes=0) as swarm:
        swarm.start()
        join = subprocess.run([sys.executable, "-m", "echo2", "hub", "join-string", "--dir", str(tmp_path / "hub"),
                               "--host", "localhost", "--expires", "1h"], capture_output=True, text=True, timeout=60, check=True)
        assert join.stdout.startswith("/dns4/localhost/tcp/") and "/join/e2jt1." in join.stdout
        (tmp_path / "node0").mkdir()
        with open(tmp_path / "node0" / "node.log", "ab") as log:
            node = subprocess.Popen(
                [sys.executable, "-m", "echo2", "node", "run", "--join", join.stdout.strip(), "--data-dir",
                 str(tmp_path / "node0"), "--threads", "1", "--price", "3.6", "--max-tasks", str(TASKS)],
                stdout=log, stderr=subprocess.STDOUT)
        swarm.nodes.append(node)
        try:
            node.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("node did not finish its tasks:\n" + (tmp_path / "node0" / "node.log").read_text()[-3000:])
        time.sleep(3.0)  # the hub saves the accounts that changed once a second (Fleet.tick)
    node_dir = tmp_path / "node0"
    peer = json.loads((node_dir / "node.state.json").read_text())["peer_id"]
    with sqlite3.connect(tmp_path / "hub" / "hub.sqlite") as db:
        results, rollouts, tokens, cost = db.execute(
            "SELECT accepted_results, accepted_rollouts, accepted_tokens, cost_micro FROM ledger WHERE peer_id = ?", (peer,)
        ).fetchone()
        entries = {t: (ro, to, p) for t, ro, to, p in db.execute(
            "SELECT task_id, rollouts, tokens, price_micro FROM ledger_entries WHERE peer_id = ?", (peer,))}
        hub_id = (tmp_path / "hub" / "hub.addrs").read_text().split()[0].rsplit("/", 1)[1]

    rc, s = receipts_cli(node_dir)
    c = s["hubs"][hub_id]
    # the stopping node's goodbye stopped its billing, and the hub's answer states its account
    assert rc == 0 and s["verified"] == s["receipts"] == TASKS + 1 and not s["refused"], s
    assert (c["receipts"], c["statements"]) == (TASKS, 1)
    # the credit the receipts sum is the hub's ledger for this node
    assert (c["results"], c["rollouts"], c["tokens"]) == (results, rollouts, tokens) == (TASKS, rollouts, tokens)
    assert c["complete"] and len(entries) == TASKS
    assert 0 < c["credit_micro_usd"] == cost  # billed at 3.6 $/h while active, to the goodbye
    assert all(p == 1_000_000 * 3.6 for _, _, p in entries.values())
    print(f"receipts: {c['results']} results, {c['rollouts']} rollouts, {c['tokens']} tokens, credit {c['credit_micro_usd']}"
          f" micro-USD; hub ledger: {results} results, {rollouts} rollouts, {tokens} tokens, cost {cost} micro-USD")

    # one byte changed in the kept file: that receipt is refused, the command fails
    f = node_dir / "receipts.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    rc, s = receipts_cli(node_dir)
    assert rc == 1 and s["verified"] < TASKS + 1 and s["refused"], s
