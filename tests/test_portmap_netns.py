"""Port mapping through a real home router (bench/netns.py ``upnp=True``: miniupnpd with its
nftables backend in each home router namespace): node/portmap.py maps a home node's port by
NAT-PMP and by UPnP IGD, a host outside reaches it there (and not before, nor after the node
exits), and in a broadcast the hub's dial-back finds the home nodes reachable so they relay as
plain parents. Skipped where namespaces, nft or miniupnpd cannot be had (root, Debian packages
nftables and miniupnpd-nftables)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo2.bench import netns

WHY = netns.available() or next((f"needs {b}" for b in ("nft", "miniupnpd") if not shutil.which(b)), None)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"namespaces with a UPnP/NAT-PMP home router: {WHY}")

# Runs inside a home host's namespace (a process of its own: trio's worker threads stay in the
# namespace they were started in). Listens, maps, prints the mapping, waits for a line on stdin,
# then exits cleanly (the mapper deletes its mapping) and says so.
MAPPER = r"""
import json, socket, sys, trio
from echo2.node.portmap import PortMapper
host, hub, mode = sys.argv[1:4]
LEASE_S = 2  # miniupnpd grants 2 s and drops the mapping when it ends (a connect 4 s later timed out)
lst = socket.socket(); lst.bind((host, 0)); lst.listen(8)
port = lst.getsockname()[1]
async def main():
    m = PortMapper(mode, lambda: [port], hub, host=host, lease_s=LEASE_S)
    async with trio.open_nursery() as n:
        await n.start(m.run)
        with trio.fail_after(20):
            await m.settled.wait()
        print(json.dumps({"port": port, "addr": m.external_addr(port), "status": m.status,
                          "kind": m.gateway.kind if m.gateway else ""}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        n.cancel_scope.cancel()
    print(json.dumps({"left": list(m.mappings)}), flush=True)
trio.run(main)
"""


def _connects(net: netns.Net, addr: tuple[str, int]) -> bool:
    with net.inside(0):
        s = socket.socket()
    with s:
        s.settimeout(2.0)
        try:
            s.connect(addr)
            return True
        except OSError:
            return False


@pytest.mark.slow
@pytest.mark.ci  # about 20 s here
def test_home_node_maps_its_port_by_natpmp_and_by_upnp_renews_and_removes_it() -> None:
    """Leases of 2 s: the outside connect 4.5 s after the mapping works only if it was renewed."""
    with netns.Net(3, 8.0, nat={1, 2}, upnp=True) as net:
        prefix = net.prefix
        for i, mode, kind in ((1, "natpmp", "NAT-PMP"), (2, "upnp", "UPnP IGD")):
            p = subprocess.Popen(["ip", "netns", "exec", net.ns(i), sys.executable, "-c", MAPPER, net.ip(i), net.ip(0), mode],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                assert p.stdout is not None and p.stdin is not None
                line = p.stdout.readline()
                assert line, (p.stderr.read() if p.stderr else "") + net.miniupnpd_log(i)
                got = json.loads(line)
                port = got["port"]
                assert got["kind"] == kind, got
                assert got["addr"] == f"{net.public_ip(i)}:{port}", got  # the router's address, our own port
                assert _connects(net, (net.public_ip(i), port))  # from outside the home, through the router
                time.sleep(4.5)  # two lease lengths: renewed at half-life, or gone
                assert _connects(net, (net.public_ip(i), port)), net.miniupnpd_log(i)[-2000:]
                p.stdin.write("quit\n")
                p.stdin.flush()
                assert json.loads(p.stdout.readline()) == {"left": []}
                assert p.wait(timeout=10) == 0
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            assert not _connects(net, (net.public_ip(i), port))  # deleted on exit: dropped again
        # a home host that asked for nothing is not reachable: the mapping is what opened the port
        with net.inside(1):
            lst = socket.socket()
            lst.bind((net.ip(1), 0))
        with lst:
            lst.listen(1)
            assert not _connects(net, (net.public_ip(1), lst.getsockname()[1]))
    assert netns.list_netns(prefix) == []


@pytest.mark.slow
@pytest.mark.ci  # about 15 s here
def test_mapped_home_nodes_are_dialled_back_and_relay_as_plain_parents(tmp_path: Path) -> None:
    """Hub and 3 node processes, 2 of them in homes whose routers offer UPnP IGD / NAT-PMP: the
    nodes map their data port (--port-map auto), tell the hub the mapped address, the hub's
    dial-back reaches both homes (no node is NAT-bound for the planner), and the home nodes upload
    to others as parents; every node verifies the version (the bench waits for every holds report)."""
    out = tmp_path / "r.json"
    args = ["--netns", "--nat", "2", "--upnp", "--nodes", "3", "--mbytes", "8", "--link-MBps", "8",
            "--mode", "pipelined", "--json", str(out)]
    run = subprocess.run([sys.executable, "-m", "echo2", "bench", "broadcast", *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["upnp"] and row["home_nodes"] == 2
    assert row["nat_nodes"] == 0  # the hub dialled every home back at its mapped port
    assert row["home_sent_bytes"] >= 0.3 * 8e6 * 2  # home nodes relayed
    assert row["seconds"] >= 0.9 * row["ideal_seconds"]


# A probe-only hub (the hub's real probe service: it dials a node back at the IP it sees it at),
# in the hub's namespace; prints its multiaddr, serves until a line on stdin.
HUB = r"""
import sys, trio
from echo2.learner_hub import probe_service as hubprobe
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost
async def main():
    me = Identity.generate()
    async with ControlHost(me, listen_host=sys.argv[1], dial_timeout_s=3) as hub:
        svc = hubprobe.ProbeService(me, control_host=hub)
        hub.set_handler(hubprobe.PROBE, svc.handle_control, max_request=hubprobe.MAX_PROBE_REQUEST)
        print(hub.addrs[0], flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
trio.run(main)
"""


@pytest.mark.slow  # 57 s here under load (two doctor runs, each importing torch): not in CI's selection
def test_doctor_in_a_home_maps_its_port_and_the_hub_dials_it_back(tmp_path: Path) -> None:
    """``echo2 node doctor`` in a home whose router offers NAT-PMP/UPnP: its "port mapping" line
    names the mapping, and the hub's probe service dials the listen port back through the router;
    with ``--port-map off`` the same doctor is told the port is not reachable (the NAT drops it)."""
    with netns.Net(2, 8.0, nat={1}, upnp=True) as net:
        hub = subprocess.Popen(["ip", "netns", "exec", net.ns(0), sys.executable, "-c", HUB, net.ip(0)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert hub.stdout is not None and hub.stdin is not None
            addr = hub.stdout.readline().strip()
            assert addr.startswith(f"/ip4/{net.ip(0)}/tcp/"), hub.stderr.read() if hub.stderr else ""
            got = {}
            for mode in ("auto", "off"):
                run = subprocess.run(
                    ["ip", "netns", "exec", net.ns(1), sys.executable, "-m", "echo2", "node", "doctor", "--hub", addr,
                     "--data-dir", str(tmp_path / mode), "--engine", "transformers", "--listen-host", "0.0.0.0",
                     "--no-bandwidth", "--port-map", mode, "--json"],
                    capture_output=True, text=True, timeout=120)
                got[mode] = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
            hub.stdin.write("quit\n")
            hub.stdin.flush()
        finally:
            if hub.poll() is None:
                try:
                    hub.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    hub.kill()
                    hub.wait()
        on, off = got["auto"], got["off"]
        assert on["port mapping"]["status"] == "pass" and net.public_ip(1) in on["port mapping"]["detail"], on
        assert on["listen port reachable"]["status"] == "pass", on["listen port reachable"]
        assert off["port mapping"]["status"] == "info" and "off" in off["port mapping"]["detail"]
        assert off["listen port reachable"]["status"] == "fail", off["listen port reachable"]
