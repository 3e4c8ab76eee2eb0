"""The status page's curves (curves.py) and ``echo2 hub report`` (report.py): bounded series,
per-node rates, and the report of a real short run read from its store while the hub holds it."""

from __future__ import annotations

import json
import sqlite3
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import trio
from hubkit import hold
from test_hub_results import admit

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.curves import NodeRates, Series
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.report import build_report, open_ro, read_run, render_report_html, run_report
from echo2.learner_hub.status_http import render_html
from echo2.learner_hub.store import HubStore
from echo2.models.engine import TransformersEngine
from echo2.protocol import envelope
from echo2.protocol.errors import WrongDomain
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, Heartbeat, Receipt, Result, Task, task_hash


def test_series_stays_bounded_and_covers_the_whole_run() -> None:
    s = Series(("step", "wall_s"), cap=8)
    for i in range(1000):
        s.add((float(i), 2.0 * i), {"reward": i / 1000, "bad": float("nan"), "worse": float("inf")})
        pts = s.points()
        assert len(pts) <= 9 and pts[0][0][0] == 0.0 and pts[-1][0][0] == float(i)  # first and newest kept
    xs = [p[0][0] for p in s.points()]
    assert xs == sorted(xs) and len(xs) >= 4
    assert all(b - a == s.stride for a, b in zip(xs[:-2], xs[1:-1], strict=True))  # evenly thinned
    cols = s.columns()
    assert cols["step"] == xs and cols["wall_s"] == [2 * x for x in xs]
    assert list(cols["series"]) == ["reward"]  # NaN and infinity are no points


def test_node_rates_over_the_last_minutes() -> None:
    r = NodeRates(sample_s=10.0, window_s=120.0)
    for t in range(0, 301, 5):  # node a: 10 tokens/s throughout; b: joins at 200 s, 50 tokens/s
        toks = {"a": 10 * t} | ({"b": 50 * (t - 200)} if t >= 200 else {})
        r.add(float(t), toks)
    assert len(r.times) <= 13 and r.times[0] >= 300 - 120
    assert r.rate("a", 305.0, 3050, 60.0) == pytest.approx(10.0)
    assert r.rate("b", 305.0, 50 * 105, 60.0) == pytest.approx(50.0)
    assert r.rate("c", 305.0, 0, 60.0) is None
    cols = r.columns()
    assert cols["series"]["a"][-1] == pytest.approx(10.0) and len(cols["wall_s"]) == len(r.times) - 1


class _FullRates:
    """The reference: every node's count copied at every sample (what NodeRates did before it
    recorded only the nodes that changed)."""

    def __init__(self, sample_s: float, window_s: float) -> None:
        self.sample_s, self.window_s = sample_s, window_s
        self.samples: list[tuple[float, dict[str, int]]] = []

    def add(self, now: float, tokens: dict[str, int]) -> None:
        if self.samples and now - self.samples[-1][0] < self.sample_s:
            return
        self.samples.append((now, dict(tokens)))
        while now - self.samples[0][0] > self.window_s:
            self.samples.pop(0)

    def rate(self, peer: str, now: float, tokens_now: int, over_s: float) -> float | None:
        for t, toks in self.samples:
            if now - t <= over_s and t < now and peer in toks:
                return (tokens_now - toks[peer]) / (now - t)
        return None

    def columns(self, most: int) -> dict[str, object]:
        pts = self.samples
        first, last = pts[0][1], pts[-1][1]
        gains = {p: last[p] - first.get(p, 0) for p in last}
        series = {p: [((b[1][p] - a[1][p]) / (b[0] - a[0])) if p in a[1] and p in b[1] else None
                      for a, b in zip(pts, pts[1:], strict=False)] for p in last}
        return {"wall_s": [t for t, _ in pts[1:]], "gains": gains, "series": series}


@pytest.mark.parametrize("seed", range(30))
def test_node_rates_incremental_matches_full_copies(seed: int) -> None:
    """Random joins, leaves and token counts: the rates and the chart from samples of only the
    nodes that changed equal those from copying every node's count at every sample."""
    import random

    rng = random.Random(seed)
    inc, ref = NodeRates(sample_s=10.0, window_s=60.0), _FullRates(10.0, 60.0)
    tokens: dict[str, int] = {}
    changed: set[str] = set()
    gone: set[str] = set()  # a node that left comes back under a new name (a rejoin is out of scope)
    t = 0.0
    for _ in range(300):
        t += rng.choice([1.0, 3.0, 7.0, 10.0, 25.0])
        for _ in range(rng.randrange(4)):
            op, p = rng.random(), f"n{rng.randrange(40)}"
            if p in gone:
                continue
            if p not in tokens:
                tokens[p] = 0
                changed.add(p)  # sampled from its first count, as the fleet marks a joining node
            elif op < 0.15:
                del tokens[p]
                changed.discard(p)
                gone.add(p)
            elif op < 0.9:
                tokens[p] += rng.randrange(1, 500)
                changed.add(p)
        if inc.due(t):
            inc.add(t, {p: tokens[p] for p in changed}, present=tokens)
            changed.clear()
        ref.add(t, tokens)
        now = t + rng.choice([0.0, 0.5, 5.0])
        for p in tokens:
            for over in (20.0, 60.0):
                assert inc.rate(p, now, tokens[p] + 7, over) == pytest.approx(ref.rate(p, now, tokens[p] + 7, over))
        if ref.samples and tokens:
            full = ref.columns(most=4)
            got = inc.columns(most=4, present=tokens)
            assert got["wall_s"] == full["wall_s"]
            gains = {p: g for p, g in full["gains"].items() if p in tokens}  # a node gone is not drawn
            assert sorted(gains[p] for p in got["series"]) == sorted(gains.values())[-4:]
            for p, ys in got["series"].items():
                assert ys == pytest.approx(full["series"][p])
    assert set(inc.per_peer) <= set(tokens) | {p for p in gone if p in ref.samples[0][1]}  # the departed forgotten


class _Scripts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if (tag in ("script", "img", "iframe") and a.get("src")) or (tag == "link" and a.get("href")):
            self.external.append(f"{tag} {a}")


def _short_run(tmp_path: Path, steps: int) -> tuple[Hub, list[int]]:
    """A real hub trains ``steps`` steps on one in-process node's rollouts (network skipped)."""
    cfg = HubConfig(dir=str(tmp_path), steps=steps, prompts_per_step=2, group_size=2, staleness=10, max_new_tokens=4,
                    checkpoint_every=1)
    hub = Hub(cfg)
    node = Identity.generate()
    assert admit(hub, node).admitted
    eng = TransformersEngine(device="cpu")
    eng.load_version(0, hub.model_config, hub.artifacts, hub.learner.state_dict_for_publish())
    tokens: list[int] = []

    async def run_node() -> None:
        await hold(hub, node, 0)
        seq = 0
        while hub.learner.version < cfg.steps:
            seq += 1
            hb = Heartbeat(peer_id=node.peer_id, seq=seq, versions_held=[0], busy_tasks=0, queue_free=1)
            reply = await hub.on_work(node.peer_id, envelope.seal(node, hb))
            try:
                task = envelope.open_envelope(reply, Task, replay=None).message
            except Exception:
                envelope.open_envelope(reply, ErrorReply, replay=None)
                await trio.sleep(0.05)
                continue
            comps = await trio.to_thread.run_sync(
                eng.generate, task.prompts, task.group_size, task.max_new_tokens, task.temperature, task.top_p, task.seed)
            n = sum(len(c.token_ids) for c in comps)
            res = Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0,
                         completions=comps, started_at=time.time(), gen_seconds=0.1, tokens=n)
            reply = await hub.on_result(node.peer_id, envelope.seal(node, res))
            try:  # accepted: a signed receipt (issue 19), or an "ok" reply
                ok = envelope.open_envelope(reply, ErrorReply, replay=None).message.code == "ok"
            except WrongDomain:
                ok = envelope.open_envelope(reply, Receipt, replay=None).message.task_ids == [task.task_id]
            if ok:
                tokens.append(n)

    async def main() -> None:
        with trio.fail_after(60):
            await hub.publish()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hub.housekeeping)
                nursery.start_soon(hub.learner_loop)
                await run_node()
                await hub.done.wait()
                nursery.cancel_scope.cancel()

    trio.run(main)
    return hub, tokens


@pytest.mark.timeout(120)
def test_curves_and_report_of_a_real_run(tmp_path: Path) -> None:
    hub, tokens = _short_run(tmp_path, steps=2)
    st = hub.status()
    train = st["curves"]["train"]
    assert train["step"] == [1.0, 2.0] and train["wall_s"] == sorted(train["wall_s"])
    assert len(train["series"]["reward"]) == 2 and "echo2/learner_busy_fraction" in train["series"]
    # trainmetrics' figures (TRL's names) join the training room's history on the same steps
    assert all(v is not None for v in train["series"]["completions/mean_length"])
    assert any(k.startswith("rewards/") and k.endswith("/mean") for k in train["series"])
    [row] = st["nodes"]
    assert {"versions_behind", "tokens_per_s_1m", "tokens_per_s_5m"} <= set(row)
    assert 0.0 <= row["staleness_mean"] <= 1.0  # its rows were made with version 0, trained at steps 1 and 2
    page = render_html(st)
    assert 'id="tables"' in page and "echo2Live(" in page
    # evaluations as the hub records them (its store's own API), then the report, while the hub's
    # store worker still holds the database open
    for step, acc in ((0, 0.25), (1, 0.75), (2, 0.5)):
        hub.store.submit(HubStore.record_eval, {"step": step, "wall_s": float(step), "mean_reward": acc / 2,
                                                "accuracy": acc, "n": 4, "excluded": 0}, time.time())
    hub.store.flush()
    out = tmp_path / "out"
    out.mkdir()
    rep = run_report(tmp_path, out / "r.html", out / "r.json", out / "png")
    pngs = sorted(out.joinpath("png").iterdir())
    assert len(pngs) == 6 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    s = json.loads((out / "r.json").read_text())["summary"]
    assert s == rep["summary"]
    assert s["steps"] == 2 and s["nodes_seen"] == 1 and s["bans"] == {}
    assert s["accepted_tokens"] == sum(tokens) and s["accepted_results"] == len(tokens)
    assert (s["eval_accuracy_first"], s["eval_accuracy_best"], s["eval_accuracy_best_step"], s["eval_accuracy_last"]) == (0.25, 0.75, 1, 0.5)
    assert rep["curves"]["eval"]["step"] == [0.0, 1.0, 2.0]
    # each node's tokens/s curve integrates back to its accepted tokens
    nc = rep["curves"]["nodes"]
    widths = [b - a for a, b in zip([0.0, *nc["wall_s"]], nc["wall_s"], strict=False)]
    assert sum(r * w for v in nc["series"].values() for r, w in zip(v, widths, strict=True)) == pytest.approx(sum(tokens))
    assert rep["curves"]["broadcast"]["version"] == [0.0, 1.0, 2.0][: len(rep["curves"]["broadcast"]["version"])]
    # the train_metrics table records every step
    assert s["per_step_figures"] and rep["curves"]["train"]["step"] == [1.0, 2.0]
    assert s["reward_first"] == train["series"]["reward"][0] and s["reward_last"] == train["series"]["reward"][-1]
    # one self-contained file: every script inline, nothing fetched
    html_text = (out / "r.html").read_text()
    p = _Scripts()
    p.feed(html_text)
    assert p.scripts >= 3 and p.external == []
    assert "uPlot" in html_text and 'id="curves-data"' in html_text
    # the report's connection cannot write
    db = open_ro(tmp_path)
    with pytest.raises(sqlite3.OperationalError):
        db.execute("DELETE FROM results")
    db.close()
    hub.store.close()
    # and after the hub has stopped, the same figures
    assert build_report(read_run(tmp_path))["summary"] == rep["summary"] | {"wall_s": s["wall_s"]}
    assert "<script" in render_report_html(rep, "x")
