"""The hub's listeners: the control host with its handlers, the policy data plane, the probe
data plane for `echo2 node doctor`, and the status server; then the hub's own tasks, until the
last step (or a signal) ends the run.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

import trio

from echo2.fsutil import atomic_write
from echo2.protocol.net.channel import ChannelServer
from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost, RequestLimits
from echo2.protocol.net.dataplane import DataPlaneServer
from echo2.protocol.net.ratelimit import UploadLimiter
from echo2.protocol.wire import (
    ADMISSION,
    CHANNEL,
    DECLINE,
    HOLDS,
    MAX_CONTROL_REQUEST,
    MAX_RESULT,
    PAUSE,
    REPORT,
    RESULT,
    RESULTS,
    WORK,
)

from .broadcast import PipelinedSender
from .probe_service import MAX_PROBE_REQUEST, PROBE, BandwidthResponder, ProbeService, observed_ip
from .status_http import StatusServer, hub_metrics

if TYPE_CHECKING:
    from .hub import Hub

log = logging.getLogger(__name__)


async def serve(hub: Hub) -> int:
    # Relay reports are rare for honest nodes (one per corrupt parent and version): a tight
    # per-peer budget keeps a liar from filling the database.
    limits = RequestLimits(per_protocol={REPORT: (1.0, 16.0)})
    cfg = hub.cfg
    async with ControlHost(hub.identity, listen_port=cfg.listen_port, listen_host=cfg.listen_host, limits=limits) as host:
        hub.host = host
        host.is_trusted = lambda pid: pid in hub.nodes and pid not in hub.fleet.banned  # strangers: small budgets (A1)
        for proto, handler, size in ((ADMISSION, hub.on_admission, MAX_CONTROL_REQUEST), (WORK, hub.on_work, MAX_CONTROL_REQUEST),
                                     (RESULT, hub.on_result, MAX_RESULT), (DECLINE, hub.on_decline, MAX_CONTROL_REQUEST),
                                     (HOLDS, hub.on_holds, MAX_CONTROL_REQUEST), (REPORT, hub.on_relay_report, MAX_CONTROL_REQUEST),
                                     (PAUSE, hub.on_pause, MAX_CONTROL_REQUEST), (RESULTS, hub.on_results, MAX_RESULT),
                                     (CHANNEL, hub.on_channel, 0)):
            host.set_handler(proto, handler, max_request=size)
        await host.subscribe(ANNOUNCE_TOPIC, hub.on_announce)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.loop_lag.run)
            hub.data_server = server = DataPlaneServer(
                hub.identity, hub.sender.serve_connection, host=cfg.listen_host, port=cfg.data_port,
                allow=lambda pid: pid in hub.nodes and pid not in hub.fleet.banned,
                upload_limiter=UploadLimiter(cfg.upload_limit_MBps) if cfg.upload_limit_MBps > 0 else None,
                max_connections=4096, max_connections_per_ip=4096,
            )
            await nursery.start(server.serve)
            hub.data_addr = f"{cfg.listen_host}:{server.port}"
            await _start_channel(hub, host, nursery)
            if isinstance(hub.sender, PipelinedSender):
                hub.sender.data_addr = hub.data_addr
            # A separate data plane for bandwidth probes (admitted nodes only): the policy downlink
            # starts sending at once, so they cannot share. What it and the dial-back observe is
            # what the planner uses (A10), never the node's claims.
            links, admitted = hub.fleet.links, (lambda pid: pid in hub.nodes and pid not in hub.fleet.banned)
            links.observer = lambda pid: observed_ip(host, pid)
            responder = BandwidthResponder(admitted, links=links)
            hub.probe_server = probe_srv = DataPlaneServer(hub.identity, responder.handle, allow=responder.allow, host=cfg.listen_host,
                                                            port=0, max_connections=16, max_connections_per_peer=2)
            await nursery.start(probe_srv.serve)
            probe = ProbeService(hub.identity, control_host=host, probe_data_addr=f"{cfg.listen_host}:{probe_srv.port}",
                                 links=links, admitted=admitted)
            host.set_handler(PROBE, probe.handle_control, max_request=MAX_PROBE_REQUEST)
            await nursery.start(probe.verify_loop)
            hub.addrs = list(host.addrs)
            atomic_write(hub.dir / "hub.addrs", "\n".join(hub.addrs) + "\n", durable=False)
            print("echo2 hub listening:\n" + "".join(f"  {a}\n" for a in hub.addrs) + f"  data plane {hub.data_addr}", flush=True)
            print(f"  a join string for nodes (`echo2 node run --join STRING`): echo2 hub join-string --dir {hub.dir}"
                  " [--host PUBLIC_NAME]", flush=True)
            # every route answers from the last status written (hubstatus.py), never built on the loop
            status = StatusServer(hub.status, lambda: hub_metrics(hub.status()), host="127.0.0.1", port=cfg.status_port,
                                  snapshot=lambda: hub.status_snapshot)
            await nursery.start(status.serve)
            hub.status_url = f"http://127.0.0.1:{status.port}/"
            print(f"  status {hub.status_url} (metrics at /metrics)", flush=True)
            if hub.resumed_from is not None:
                print(f"  resumed from checkpoint at step {hub.resumed_from}", flush=True)
            await hub.publish()  # the current version (0 on a fresh start)
            nursery.start_soon(hub.learner_loop)
            nursery.start_soon(hub.housekeeping)
            nursery.start_soon(_watch_signals, hub, nursery.cancel_scope)
            await hub.done.wait()
            if cfg.exit_when_done:
                await trio.sleep(0.5)
                nursery.cancel_scope.cancel()
            else:
                await trio.sleep_forever()
    return 0


async def _start_channel(hub: Hub, host: ControlHost, nursery: trio.Nursery) -> None:
    """The nodes' long-lived channel (protocol/channel.py says why the data plane's TCP): heartbeats,
    holds, results and their acknowledgements, served by the same handlers as on the control host."""
    if not hub.cfg.channel:
        return
    handlers = {WORK: hub.on_work, RESULT: hub.on_result, RESULTS: hub.on_results, HOLDS: hub.on_holds,
                DECLINE: hub.on_decline, PAUSE: hub.on_pause}
    channel = ChannelServer(hub.identity, handlers, allow=lambda pid: pid in hub.nodes and pid not in hub.fleet.banned,
                            host=hub.cfg.listen_host, port=hub.cfg.channel_port, rate=host.limits.per_protocol,
                            default_rate=(host.limits.rate_per_s, host.limits.burst), refusals=host.refusals)
    await nursery.start(channel.serve)
    hub.channel_server = channel
    hub.channel_addr = f"{hub.cfg.listen_host}:{channel.port}"  # a node puts the IP it reached us at for 0.0.0.0


async def _watch_signals(hub: Hub, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: stopping the hub", signal.Signals(signum).name)
            await hub.write_status(final=True)
            scope.cancel()
            return
