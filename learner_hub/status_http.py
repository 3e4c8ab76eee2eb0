"""Operator status over HTTP: JSON, a server-rendered HTML page, and Prometheus metrics.

A small HTTP/1.1 server on trio, h11 parsing the requests and framing the responses: GET only
(HEAD and every other method get 405), one request per connection (``Connection: close``), the
request head read with a size limit and a timeout, everything else answered 400/404/431/501.
The ``/metrics`` text is rendered by prometheus-client. It is read-only and binds to 127.0.0.1
by default, so exposing it is an explicit operator decision (e.g. through an SSH tunnel). A
request must name this server in its Host header (a localhost name, the bound address, or an
operator-configured name; any port): a page whose DNS name was re-pointed at 127.0.0.1 (DNS
rebinding) gets 421, a request without Host 400.

Routes: ``/status.json`` (``status_provider()``), ``/`` (HTML rendered from the same dict: tables,
and charts drawn by inlined JavaScript), ``/tables.html`` (its tables alone), ``/metrics``
(Prometheus text format 0.0.4 from ``metrics_provider()``).

Given ``snapshot`` (the hub's), every route answers from the last status the hub's periodic
writer produced (:class:`StatusSnapshot`: its bytes as written, its dict, its time; the age is
sent in the ``Age`` header and as ``written_at`` in the JSON), rendered in a worker thread:
building the status on the loop for each request cost the loop 148 ms at 10,000 nodes (`echo2
bench intake`), so a page left open, or anyone who can reach the port, could stall the hub.
"""

from __future__ import annotations

import html
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import h11
import prometheus_client
import prometheus_client.metrics_core as prom
import trio

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


# --- Prometheus exposition -------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """One metric family: ``samples`` are (labels, value) pairs. Only counter/gauge/untyped are
    needed here; a counter's name ends in ``_total``, as Prometheus names them."""

    name: str
    type: str  # "counter" | "gauge" | "untyped"
    help: str
    samples: Sequence[tuple[Mapping[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ValueError(f"invalid metric name {self.name!r}")
        if self.type not in ("counter", "gauge", "untyped"):
            raise ValueError(f"unsupported metric type {self.type!r}")
        if self.type == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")
        for labels, _ in self.samples:
            for k in labels:
                if not _LABEL_NAME.match(k) or k.startswith("__"):
                    raise ValueError(f"invalid label name {k!r} in {self.name}")


def gauge(name: str, help: str, value: float | None, **labels: str) -> Metric:
    return Metric(name, "gauge", help, [] if value is None else [(labels, float(value))])


class _Families:
    """A prometheus-client collector over a list of ``Metric`` (a repeated name is merged into
    one family, in first-seen order): the exposition text and its escaping are the library's."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[prom.Metric]:
        merged: dict[str, tuple[Metric, list[tuple[Mapping[str, str], float]]]] = {}
        for m in self.metrics:
            merged.setdefault(m.name, (m, []))[1].extend(m.samples)
        for first, samples in merged.values():
            # CounterMetricFamily strips _total from the family name; its samples keep it
            fam = (prom.CounterMetricFamily(first.name, first.help) if first.type == "counter"
                   else prom.Metric(first.name, first.help, first.type))
            for labels, value in samples:
                fam.add_sample(first.name, {k: str(v) for k, v in labels.items()}, float(value))
            yield fam


def render_metrics(metrics: Sequence[Metric]) -> str:
    """Prometheus text exposition format 0.0.4 (families in order; a repeated name is merged)."""
    return prometheus_client.generate_latest(_Families(metrics)).decode()  # type: ignore[arg-type]


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def hub_metrics(status: Mapping[str, Any]) -> list[Metric]:
    """The hub's standard metrics from its status dict (keys as in ``Hub.status()``; missing
    keys are skipped). Extra keys understood: ``last_train_s``, ``train_s_total``,
    ``ledger`` (``Totals.as_dict()``), and per node ``state``."""
    ms: list[Metric] = []

    def g(name: str, help: str, key: str) -> None:
        v = _num(status.get(key))
        if v is not None:
            ms.append(gauge(name, help, v))

    g("echo2_learner_step", "Learner step (= newest policy version trained).", "step")
    g("echo2_learner_utilization", "Fraction of wall time the learner spends training.", "learner_busy_fraction")
    g("echo2_learner_step_seconds", "Duration of the last learner step.", "last_train_s")
    hist = status.get("history")
    if _num(status.get("last_train_s")) is None and isinstance(hist, list) and hist and isinstance(hist[-1], dict):
        v = _num(hist[-1].get("train_s"))
        if v is not None:
            ms.append(gauge("echo2_learner_step_seconds", "Duration of the last learner step.", v))
    if isinstance(hist, list):
        total = sum(_num(h.get("train_s")) or 0.0 for h in hist if isinstance(h, dict))
        ms.append(Metric("echo2_learner_train_seconds_total", "counter", "Seconds spent in learner steps.", [({}, total)]))
    g("echo2_loop_lag_p99_ms", "99th percentile of the trio loop's scheduling lag, ms.", "loop_lag_p99_ms")
    g("echo2_loop_lag_max_ms", "Largest trio loop scheduling lag seen recently, ms.", "loop_lag_max_ms")
    g("echo2_policy_latest_version", "Newest published policy version.", "latest_version")
    acc = _num(status.get("results_accepted"))
    if acc is not None:
        ms.append(Metric("echo2_results_accepted_total", "counter", "Results accepted.", [({}, acc)]))
    ro = _num(status.get("rollouts_accepted"))
    if ro is not None:
        ms.append(Metric("echo2_rollouts_accepted_total", "counter", "Rollouts (completions) accepted.", [({}, ro)]))
    refused = status.get("refused_by_reason")
    if isinstance(refused, Mapping):
        samples = [({"reason": str(k)}, float(v)) for k, v in sorted(refused.items()) if _num(v) is not None]
        ms.append(Metric("echo2_results_refused_total", "counter", "Results and requests refused, by reason.", samples))
    rw = status.get("rewards")
    if isinstance(rw, Mapping) and isinstance(rw.get("excluded_by_reason"), Mapping):
        samples = [({"reason": str(k)}, float(v)) for k, v in sorted(rw["excluded_by_reason"].items()) if _num(v) is not None]
        ms.append(Metric("echo2_reward_excluded_total", "counter", "Completions the reward functions could not score, by reason.", samples))
        v = _num(rw.get("completions_scored"))
        if v is not None:
            ms.append(Metric("echo2_reward_scored_total", "counter", "Completions given a reward.", [({}, v)]))
    ev = status.get("eval")
    latest = ev.get("latest") if isinstance(ev, Mapping) else None
    if isinstance(latest, Mapping):
        for key, name, help in (
            ("step", "echo2_eval_step", "Learner step of the latest evaluation."),
            ("accuracy", "echo2_eval_accuracy", "Share of eval completions whose reward reached eval_pass_threshold (latest evaluation)."),
            ("mean_reward", "echo2_eval_mean_reward", "Mean reward of the latest evaluation's completions."),
        ):
            v = _num(latest.get(key))
            if v is not None:
                ms.append(gauge(name, help, v))
    stale = _num(status.get("stale_dropped"))
    if stale is not None:
        ms.append(Metric("echo2_results_stale_dropped_total", "counter", "Results dropped as too stale.", [({}, stale)]))
    nodes = status.get("nodes")
    counted = status.get("node_states")  # a snapshot's count by state (it keeps only the first nodes)
    if isinstance(nodes, list) or isinstance(counted, Mapping):
        states: dict[str, int] = {}
        if isinstance(counted, Mapping):
            states = {str(k): int(v) for k, v in counted.items() if _num(v) is not None}
        elif isinstance(nodes, list):
            for n in nodes:
                if isinstance(n, dict):
                    s = str(n.get("state", "active"))
                    states[s] = states.get(s, 0) + 1
        ms.append(Metric("echo2_nodes", "gauge", "Known nodes by state.", [({"state": s}, float(c)) for s, c in sorted(states.items())]))
        active = states.get("active", 0)
        ms.append(gauge("echo2_nodes_active", "Nodes currently active.", active))
    bc = status.get("broadcast")
    if isinstance(bc, Mapping):
        recent = bc.get("recent")
        if isinstance(recent, list) and recent and isinstance(recent[-1], Mapping):
            last = recent[-1]
            samples = [
                ({"which": w}, v)
                for w in ("first", "median", "last")
                if (v := _num(last.get(f"{w}_s"))) is not None
            ]
            ms.append(
                Metric(
                    "echo2_broadcast_seconds",
                    "gauge",
                    "Seconds from publishing the latest measured version until the first/median/last node held it.",
                    samples,
                )
            )
    led = status.get("ledger")
    if isinstance(led, Mapping):
        for key, name, help in (
            ("cost_usd", "echo2_cost_usd_total", "Total cost of active node time, USD."),
            ("accepted_tokens", "echo2_tokens_accepted_total", "Generated tokens accepted."),
        ):
            v = _num(led.get(key))
            if v is not None:
                ms.append(Metric(name, "counter", help, [({}, v)]))
        v = _num(led.get("usd_per_token"))
        if v is not None:
            ms.append(gauge("echo2_usd_per_accepted_token", "Cost per accepted token, USD.", v))
    return ms


def json_safe(x: Any, depth: int = 0) -> Any:
    """A copy with NaN/inf as None (strict JSON) and non-str keys as str."""
    if depth > 64:
        return None
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v, depth + 1) for v in x]
    return x


# --- HTML ----------------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if isinstance(v, float):
        v = f"{v:.4g}"
    elif isinstance(v, (dict, list)):
        v = json.dumps(v)[:120]
    return html.escape(str(v))


def _table(rows: Sequence[Mapping[str, Any]], limit: int = 200) -> str:
    rows = [r for r in rows if isinstance(r, Mapping)][:limit]
    if not rows:
        return "<p><i>none</i></p>"
    cols: list[str] = []
    for r in rows:
        cols += [str(k) for k in r if str(k) not in cols]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary(status: Mapping[str, Any]) -> str:
    util = _num(status.get("learner_busy_fraction"))
    pred = _num(status.get("predicted_busy_fraction"))
    led = status.get("ledger") if isinstance(status.get("ledger"), Mapping) else {}
    assert isinstance(led, Mapping)
    cost = _num(led.get("cost_usd"))
    per_mtok = _num(led.get("usd_per_million_tokens"))
    ev = status.get("eval")
    latest = ev.get("latest") if isinstance(ev, Mapping) else None
    acc = _num(latest.get("accuracy")) if isinstance(latest, Mapping) else None
    summary = [
        ("hub", status.get("peer_id", "?")),
        ("learner step", f"{status.get('step', '?')} / {status.get('steps', '?')}"),
        ("latest version", status.get("latest_version", "?")),
        ("staleness S", status.get("staleness", "?")),
        ("learner utilization (model)", ("-" if util is None else f"{100 * util:.1f}%")
         + ("" if pred is None else f" ({100 * pred:.1f}%)")),
        ("eval accuracy (step)", "-" if acc is None or not isinstance(latest, Mapping) else f"{acc:.3f} ({latest.get('step')})"),
        ("results accepted", status.get("results_accepted", "?")),
        ("rollouts accepted", status.get("rollouts_accepted", "?")),
        ("stale dropped", status.get("stale_dropped", "?")),
        ("cost so far", "-" if cost is None else f"${cost:.4f}"),
        ("$ per 1M accepted tokens", "-" if per_mtok is None else f"${per_mtok:.2f}"),
        ("wall time", f"{status.get('wall_s', '?')} s"),
    ]
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{_cell(v)}</td></tr>" for k, v in summary) + "</table>"


#: the per-node table's columns, in order (status.json has more)
NODE_COLUMNS = ("peer_id", "state", "versions_behind", "staleness_mean", "tokens_per_s_1m", "tokens_per_s_5m",
                "tokens", "refused", "reputation", "price_usd_per_hour", "cost_usd")


def render_tables(status: Mapping[str, Any]) -> str:
    """The page's tables in ``<div id="tables">`` (served alone at /tables.html for the live page's
    refresh): summary, fleet with each node's recent throughput, evaluations, versions, refusals."""
    refused = status.get("refused_by_reason")
    refused_rows = [{"reason": k, "count": v} for k, v in sorted(refused.items())] if isinstance(refused, Mapping) else []
    raw_nodes = status.get("nodes")
    nodes: list[Any] = raw_nodes if isinstance(raw_nodes, list) else []
    # the table shows 200 nodes: rows of those only (building 10,000 took ~10 ms)
    node_rows = [{c: n.get(c) for c in NODE_COLUMNS if c in n} for n in nodes[:200] if isinstance(n, Mapping)]
    bc = status.get("broadcast")
    versions = bc.get("recent", []) if isinstance(bc, Mapping) else status.get("versions", [])
    if not isinstance(versions, list):
        versions = []
    ev = status.get("eval")
    evals = ev.get("history", []) if isinstance(ev, Mapping) else []
    # a snapshot keeps only the first nodes, and says how many there are
    count = int(nc) if (nc := _num(status.get("node_count"))) is not None else len(nodes)
    eval_rows = [{k: e.get(k) for k in ("step", "wall_s", "accuracy", "mean_reward", "n", "excluded")}
                 for e in (evals if isinstance(evals, list) else [])[-20:] if isinstance(e, Mapping)]
    return f"""<div id="tables">
{_summary(status)}
<h2>Fleet ({count} nodes)</h2>
<p>tokens/s over the last 1 and 5 minutes; versions behind: the newest version minus the one it holds;
staleness: mean over its trained rows of the learner's version before the step minus the row's</p>
{_table(node_rows)}
<h2>Evaluations (latest 20)</h2>
{_table(eval_rows)}
<h2>Policy versions (broadcast)</h2>
{_table(list(versions)[-20:])}
<h2>Refused</h2>
{_table(refused_rows)}
</div>"""


def render_html(status: Mapping[str, Any]) -> str:
    """The status page: charts drawn in the browser from status.json (charts.py, uPlot inlined)
    over server-rendered tables. Without JavaScript it is the tables, refreshed every 5 s."""
    from .charts import charts_block

    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><noscript><meta http-equiv="refresh" content="5"></noscript>
<title>echo2 hub</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}}th{{background:#f0f0f0}}</style>
</head><body>
<h1>echo2 hub</h1>
{charts_block(status.get("curves"), live=True)}
{render_tables(status)}
<p><a href="/status.json">status.json</a> · <a href="/metrics">metrics</a></p>
</body></html>
"""


# --- HTTP server -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StatusSnapshot:
    """One status as the hub's writer produced it: the JSON bytes it wrote, the same as a dict
    (for the page and /metrics; never changed after), and when (``time.time()``)."""

    body: tuple[bytes, ...]  # the file's parts, in order (status_nodes.NodeFragments.body says why)
    status: Mapping[str, Any]
    written_at: float


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 421: "Misdirected Request",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
            503: "Service Unavailable"}
_CONTENT_TYPE_METRICS = prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4
#: Names that always mean this machine. A browser sends the name it resolved in Host, so a page
#: on evil.example whose name was re-pointed at 127.0.0.1 (DNS rebinding) is told apart here.
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: bytes) -> str | None:
    """The name part of a Host header value (port and IPv6 brackets removed, lower case, no
    trailing dot), or None when it is not a plausible host."""
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, _, port = text.partition(":")
        if port and not port.isdigit():
            return None
    name = name.rstrip(".")
    return name or None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes | tuple[bytes, ...]  # parts: sent one by one, never joined (a 4 MB status.json)
    content_type: str = "text/plain; charset=utf-8"
    extra: Sequence[tuple[str, str]] = ()

    def parts(self) -> tuple[bytes, ...]:
        return (self.body,) if isinstance(self.body, bytes) else self.body

    def headers(self) -> list[tuple[str, str]]:
        return [
            ("Content-Type", self.content_type),
            ("Content-Length", str(sum(map(len, self.parts())))),
            ("Connection", "close"),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            *self.extra,
        ]


def _text(status: int, msg: str, extra: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, (msg + "\n").encode(), extra=extra)


class StatusServer:
    """``await nursery.start(server.serve)``; then ``server.port`` is the bound port."""

    def __init__(
        self,
        status_provider: Callable[[], Mapping[str, Any]],
        metrics_provider: Callable[[], Sequence[Metric]],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        allowed_hosts: Sequence[str] = (),
        snapshot: Callable[[], StatusSnapshot | None] | None = None,
    ) -> None:
        self.status_provider = status_provider
        self.snapshot = snapshot
        self.metrics_provider = metrics_provider
        self.host = host
        # The port is not checked: an SSH tunnel shows the server under another port.
        bound = set() if host in _WILDCARDS else {host.strip("[]").lower()}
        self.allowed_hosts = frozenset(LOCAL_NAMES | bound | {h.strip("[]").lower().rstrip(".") for h in allowed_hosts})
        self.port = port
        self.max_request_bytes = max_request_bytes
        self.timeout_s = timeout_s
        self._limiter = trio.CapacityLimiter(max_connections)
        self.requests = 0
        self.errors = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        sock = listeners[0].socket
        self.port = int(sock.getsockname()[1])
        log.info("status HTTP on http://%s:%d/", self.host, self.port)
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        # The outer guard: whatever a client sends, this task ends quietly.
        try:
            try:
                self._limiter.acquire_nowait()
            except trio.WouldBlock:
                return
            try:
                with trio.move_on_after(self.timeout_s):
                    await self._serve_one(stream)
            finally:
                self._limiter.release()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            self.errors += 1
            log.exception("status HTTP: unexpected error")
        finally:
            with trio.move_on_after(1.0) as cs:
                cs.shield = True
                try:
                    await stream.aclose()
                except Exception:
                    pass

    def _connection(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_request_bytes)

    async def _read_request(self, stream: trio.abc.Stream) -> tuple[h11.Connection, h11.Request | Response | None]:
        """The connection to answer on and the request head, or the refusal to send, or None when
        the client left without asking. h11 refuses a head over ``max_request_bytes`` (431) and
        one cut short by end of input."""
        conn = self._connection()
        received = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                hint = exc.error_status_hint
                return conn, _text(hint, "request head too large" if hint == 431 else f"bad request: {exc}")
            if isinstance(event, h11.Request):
                return conn, event
            if isinstance(event, h11.ConnectionClosed):
                return conn, None
            # never more than limit + 1 bytes: a head that does not end within the limit is 431
            data = await stream.receive_some(min(4096, self.max_request_bytes + 1 - received))
            received += len(data)
            conn.receive_data(data)

    async def _serve_one(self, stream: trio.abc.Stream) -> None:
        conn, got = await self._read_request(stream)
        if got is None:
            return
        if isinstance(got, h11.Request):
            self.requests += 1
            # from a snapshot nothing reads live state: rendering (the page, /metrics: ~10 ms at
            # 10,000 nodes) runs off the loop
            resp = await trio.to_thread.run_sync(self.respond, got) if self.snapshot is not None else self.respond(got)
        else:
            resp = got  # h11 still lets the server answer a client in its error state
        head = h11.Response(status_code=resp.status, headers=resp.headers(),
                            reason=_REASONS.get(resp.status, "Error").encode())
        # a response to HEAD carries its headers only (h11 enforces it)
        body = () if isinstance(got, h11.Request) and got.method == b"HEAD" else tuple(h11.Data(data=p) for p in resp.parts())
        events = (head, *body, h11.EndOfMessage())
        if resp.status == 200:
            # part by part: joined, a 4 MB status.json was one copy on the loop (NodeFragments.body)
            for ev in events:
                if out := conn.send(ev):
                    await stream.send_all(out)
        else:  # the client may still be sending (a POST body): do not reset the connection on it
            await self._refuse_and_drain(stream, b"".join(conn.send(ev) or b"" for ev in events))

    async def _refuse_and_drain(self, stream: trio.abc.Stream, data: bytes) -> None:
        # Closing a socket with unread input makes the kernel send RST, which can destroy the
        # response before the client reads it: half-close, then discard a bounded amount of input.
        await stream.send_all(data)
        if isinstance(stream, trio.abc.HalfCloseableStream):
            await stream.send_eof()
        discarded = 0
        with trio.move_on_after(0.5):
            while discarded < 16 * self.max_request_bytes:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                discarded += len(chunk)

    def respond(self, request: h11.Request) -> Response:
        """The response to a parsed request (exposed for tests of routing without sockets)."""
        target = bytes(request.target)
        # h11 accepts absolute-form targets and bytes outside ASCII; this server serves paths only
        if not target.startswith(b"/") or any(b <= 32 or b >= 127 for b in target):
            return _text(400, "malformed request target")
        if not all(bytes(v).isascii() for _, v in request.headers):
            return _text(400, "request head is not ASCII")
        if request.method != b"GET":
            return _text(405, "only GET is supported", [("Allow", "GET")])
        hosts = [v for k, v in request.headers if k == b"host"]
        if not hosts:  # HTTP/1.1 requires it (h11 enforces that); an HTTP/1.0 request gets the same answer
            return _text(400, "a Host header is required")
        name = host_name(bytes(hosts[0]))
        if name not in self.allowed_hosts:
            log.info("status HTTP: refused a request for host %r (DNS rebinding?)", bytes(hosts[0])[:100])
            return _text(421, "this server does not answer for that host name")
        path = target.decode("ascii").split("?", 1)[0].split("#", 1)[0]
        try:
            status: Mapping[str, Any] | None = None
            if self.snapshot is not None and path in ("/status.json", "/metrics", "/", "/index.html", "/tables.html"):
                snap = self.snapshot()
                if snap is None:  # the hub writes its first status within a second of starting
                    return _text(503, "no status written yet; retry in a second", [("Retry-After", "1")])
                age = ("Age", str(max(0, int(time.time() - snap.written_at))))
                if path == "/status.json":
                    return Response(200, snap.body, "application/json", extra=[age])
                status = snap.status
            if path == "/status.json":
                body = json.dumps(json_safe(self.status_provider()), default=str, allow_nan=False).encode()
                return Response(200, body, "application/json")
            if path == "/metrics":
                return Response(200, render_metrics(self.metrics_provider() if status is None else hub_metrics(status)).encode(),
                                _CONTENT_TYPE_METRICS)
            if path in ("/", "/index.html"):
                return Response(200, render_html(self.status_provider() if status is None else status).encode(),
                                "text/html; charset=utf-8")
            if path == "/tables.html":
                return Response(200, render_tables(self.status_provider() if status is None else status).encode(),
                                "text/html; charset=utf-8")
        except Exception:
            self.errors += 1
            log.exception("status HTTP: provider failed for %s", path)
            return _text(500, "internal error")
        return _text(404, "not found")
