"""A small emulated LAN of Linux network namespaces with kernel-shaped uploads (for benches/tests).

Topology (all made here, all removed by :meth:`Net.teardown`, on exit and on SIGTERM)::

    namespace <prefix>sw   : bridge br0, one port p<i> per host
    namespace <prefix>h<i> : eth0 = veth peer of p<i>, address <subnet>.<i+1>/24,
                             the kernel's tbf on eth0 egress = the host's UPLOAD

With ``nat`` (a set of host indices), each of those hosts lives in a home behind a router of its
own, as a volunteer's home router does::

    namespace <prefix>r<i> : wan0 = veth peer of p<i> on the bridge, address <subnet>.<i+1>/24;
                             lan0 = 192.168.<i>.1/24; nftables MASQUERADE out of wan0, and
                             inbound from wan0 dropped unless it belongs to a connection the home
                             opened (conntrack established/related)
    namespace <prefix>h<i> : eth0 = 192.168.<i>.2/24, default route via the router, tbf on eth0

so two NATed hosts traverse two NATs to reach each other. With ``upnp``, each home router also
runs miniupnpd (Debian package miniupnpd-nftables: UPnP IGD and NAT-PMP, nftables backend),
listening on lan0 with wan0 as its external interface, its config written here
(:func:`miniupnpd_config`), stopped with the rest; a mapping it grants is a DNAT rule in its own
table, and the router's filter lets DNATed connections in. miniupnpd refuses to map when its
external address is private or reserved ("private/reserved address 10.213.0.2 is not suitable
for external IP", and 198.18.0.0/15 alike): with ``upnp`` the bridge's subnet is
:data:`UPNP_SUBNET`, a global unicast range that exists only inside the namespaces made here
(no route leads out of them). Linux MASQUERADE keeps a connection's
source port when it is free (measured here, ../shared/BRIEF.md section 11), which is what TCP
simultaneous open relies on. Needs ``nft`` (Debian package nftables) for homes.

Only uploads are shaped (rate in MB/s = 10**6 bytes/s at layer 2); a host's download is limited
only by its senders' uploads, as the data plane's token bucket models it. Traffic never leaves the
namespaces made here. Needs root, iproute2 (``ip``, ``tc``) and the veth, bridge and sch_tbf
kernel modules; :func:`available` says whether they can be made here. (Ported from the session's
``tools/netshape.py``; on this kernel tbf at 8 MB/s measured 7.6-7.9 MB/s for one TCP flow,
``netem`` is not available. The bucket depth: :data:`DEFAULT_BURST`.)

Use::

    with Net(n_hosts=9, rate_MBps=8) as net:     # h0..h8
        p = net.popen(0, [sys.executable, "-m", "http.server"])
        with net.inside(0):                       # this thread's sockets in h0
            ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

DEFAULT_SUBNET = "10.213.0"
UPNP_SUBNET = "11.213.0"  # see the module doc: miniupnpd maps only behind a public-looking address
#: Depth of each host's token bucket. Why 128 KB and not tbf's usual 32 KB: tbf splits in software
#: every GSO packet larger than its burst, and the kernel's TCP hands the qdisc packets of up to
#: 64 KB (68 KB on the wire with a header per segment); split, each travels the veth, the bridge
#: and the receiver's stack as 45 packets. Measured here (bare sockets, a relay host uploading
#: 32 MB to two hosts while downloading 32 MB, 8 MB/s): 32kb 2.7-3.0 CPU-s per GB, 128kb 1.3-1.9;
#: upload 7.59-7.60 vs 7.62-7.66 MB/s. With the echo2 broadcast (N = 8, 32 MB, same period) the
#: node and hub CPU fell from 17-19 to 13 CPU-s per GB. Not more generous in any way that counts:
#: over any interval t a host sends at most rate*t + 128 KB, so a 32 MB version at 8 MB/s can gain
#: at most 0.4 % (16 ms) on M/b; a real home uplink's shaper has at least this much (a cable
#: modem's configured Max Traffic Burst is commonly tens of KB to MBs, "PowerBoost" more).
DEFAULT_BURST = "128kb"
CLONE_NEWNET = 0x40000000


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def list_netns(prefix: str) -> list[str]:
    r = _sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def teardown_prefix(prefix: str) -> list[str]:
    """Remove every namespace named ``<prefix>*`` (leftovers of a crashed run); what is left."""
    for name in list_netns(prefix):
        _sh(["ip", "netns", "del", name], check=False)
    return list_netns(prefix)


def available() -> str | None:
    """None if namespaces with veth, bridge and tbf can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    try:
        with Net(1, 8.0, prefix=f"e2p{uuid.uuid4().hex[:6]}"):
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make namespaces: {e}"
    return None


#: miniupnpd's own table (its nftables backend adds rules to these chains, creates none), as
#: Debian's /etc/miniupnpd/nft_init.sh makes it, with our names
MINIUPNPD_TABLE = "\n".join([
    "table inet miniupnpd {",
    *(line for c in ("miniupnpd", "prerouting_miniupnpd", "postrouting_miniupnpd") for line in (f"  chain {c} {{", "  }")),
    *(line for name, kind, hook, prio, target in (
        ("forward", "filter", "forward", "-10", "miniupnpd"),
        ("prerouting", "nat", "prerouting", "dstnat", "prerouting_miniupnpd"),
        ("postrouting", "nat", "postrouting", "srcnat", "postrouting_miniupnpd"))
      for line in (f"  chain {name} {{", f"    type {kind} hook {hook} priority {prio}; policy accept;",
                   f"    jump {target}", "  }")),
    "}", ""])


def miniupnpd_config(i: int) -> str:
    """miniupnpd.conf for home ``i``: UPnP IGD and NAT-PMP on lan0, wan0 external; secure mode and
    permission rules: a host of the home may map ports >= 1024 to itself only."""
    return "\n".join([
        "ext_ifname=wan0", "listening_ip=lan0", "http_port=0", "enable_natpmp=yes", "enable_upnp=yes",
        "secure_mode=yes", "system_uptime=no", f"uuid=6563686f-0002-4000-8000-{i:012d}",
        "upnp_table_name=miniupnpd", "upnp_nat_table_name=miniupnpd", "upnp_forward_chain=miniupnpd",
        "upnp_nat_chain=prerouting_miniupnpd", "upnp_nat_postrouting_chain=postrouting_miniupnpd",
        f"allow 1024-65535 192.168.{i}.0/24 1024-65535", "deny 0-65535 0.0.0.0/0 0-65535", ""])


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Net:
    """``n_hosts`` namespaces on one bridge, each host's upload shaped to ``rate_MBps``."""

    def __init__(self, n_hosts: int, rate_MBps: float, *, prefix: str | None = None, subnet: str = DEFAULT_SUBNET,
                 burst: str = DEFAULT_BURST, latency: str = "50ms", mtu: int = 1500,
                 nat: frozenset[int] | set[int] = frozenset(), isolate_homes: bool = False,
                 upnp: bool = False) -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError("n_hosts must be in 1..250")
        if rate_MBps <= 0:
            raise ValueError("rate_MBps must be positive")
        self.n = n_hosts
        if any(not 0 <= i < n_hosts for i in nat):
            raise ValueError("nat: host indices in 0..n_hosts-1")
        if nat and not shutil.which("nft"):
            raise RuntimeError("homes behind NAT need nft (Debian package nftables)")
        self.nat = frozenset(nat)
        if upnp and not (nat and shutil.which("miniupnpd")):
            raise RuntimeError("upnp needs homes (nat) and miniupnpd (Debian package miniupnpd-nftables)")
        self.upnp = upnp
        if upnp and subnet == DEFAULT_SUBNET:
            subnet = UPNP_SUBNET
        self._tmp: str | None = None  # miniupnpd's config and log files
        # routers drop what their home sends to another home (a firewall, or a carrier-grade NAT
        # that no hole gets through): hole punching between homes fails, tests its fallback
        self.isolate_homes = isolate_homes
        self.rate_MBps = float(rate_MBps)
        # a fresh prefix per run: two runs at once (or a crashed one's leftovers) never collide
        self.prefix = prefix or f"e2{uuid.uuid4().hex[:6]}"
        self.subnet = subnet
        self.burst, self.latency, self.mtu = burst, latency, mtu
        self.sw = self.prefix + "sw"
        self._procs: list[subprocess.Popen[Any]] = []
        self._up = False
        self._old_term: Any = None

    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def router(self, i: int) -> str:
        return f"{self.prefix}r{i}"

    def ip(self, i: int) -> str:
        """The address host ``i`` binds (inside its home for a NATed host)."""
        return f"192.168.{i}.2" if i in self.nat else self.public_ip(i)

    def public_ip(self, i: int) -> str:
        """Where others see host ``i``: its own address, or its home router's for a NATed host."""
        return f"{self.subnet}.{i + 1}"

    # --- lifecycle ------------------------------------------------------------------------------
    def setup(self) -> Net:
        leftovers = list_netns(self.prefix)
        if leftovers:
            raise RuntimeError(f"namespaces with prefix {self.prefix!r} already exist: {leftovers}")
        self._up = True  # from here on, teardown() must run
        rate_bit = int(self.rate_MBps * 8e6)
        _sh(["ip", "netns", "add", self.sw])
        _sh(["ip", "-n", self.sw, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.sw, "link", "set", "br0", "up"])
        for i in range(self.n):
            h, port = self.ns(i), f"p{i}"
            _sh(["ip", "netns", "add", h])
            if i in self.nat:
                self._home(i, rate_bit)
                continue
            _sh(["ip", "link", "add", "name", port, "netns", self.sw, "type", "veth", "peer", "name", "eth0", "netns", h])
            _sh(["ip", "-n", self.sw, "link", "set", port, "mtu", str(self.mtu), "master", "br0", "up"])
            _sh(["ip", "-n", h, "link", "set", "lo", "up"])
            _sh(["ip", "-n", h, "link", "set", "eth0", "mtu", str(self.mtu), "up"])
            _sh(["ip", "-n", h, "addr", "add", self.ip(i) + "/24", "dev", "eth0"])
            _sh(["ip", "netns", "exec", h, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                 "rate", f"{rate_bit}bit", "burst", self.burst, "latency", self.latency])
        return self

    def _home(self, i: int, rate_bit: int) -> None:
        h, r, port = self.ns(i), self.router(i), f"p{i}"
        _sh(["ip", "netns", "add", r])
        _sh(["ip", "link", "add", "name", port, "netns", self.sw, "type", "veth", "peer", "name", "wan0", "netns", r])
        _sh(["ip", "-n", self.sw, "link", "set", port, "mtu", str(self.mtu), "master", "br0", "up"])
        _sh(["ip", "link", "add", "name", "lan0", "netns", r, "type", "veth", "peer", "name", "eth0", "netns", h])
        for ns_, dev, addr in ((r, "wan0", self.public_ip(i) + "/24"), (r, "lan0", f"192.168.{i}.1/24"),
                               (h, "eth0", self.ip(i) + "/24")):
            _sh(["ip", "-n", ns_, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns_, "link", "set", dev, "mtu", str(self.mtu), "up"])
            _sh(["ip", "-n", ns_, "addr", "add", addr, "dev", dev])
        _sh(["ip", "-n", h, "route", "add", "default", "via", f"192.168.{i}.1"])
        _sh(["ip", "netns", "exec", r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        rules = "\n".join([
            "table ip nat {", "  chain postrouting {", "    type nat hook postrouting priority 100; policy accept;",
            '    oifname "wan0" masquerade', "  }", "}",
            "table inet filter {",
            *(line for hook in ("forward", "input") for line in (
                f"  chain {hook} {{", f"    type filter hook {hook} priority 0; policy accept;",
                '    iifname "wan0" ct state established,related accept',
                *(['    iifname "wan0" ct status dnat accept'] if self.upnp and hook == "forward" else []),
                '    iifname "wan0" drop', "  }")),
            "}", ""])
        others = sorted(self.public_ip(j) for j in self.nat if j != i)
        if self.isolate_homes and others:
            rules += "\n".join([
                "table inet isolate {", "  chain forward {", "    type filter hook forward priority -1; policy accept;",
                f'    oifname "wan0" ip daddr {{ {", ".join(others)} }} drop', "  }", "}", ""])
        if self.upnp:
            rules += MINIUPNPD_TABLE
        subprocess.run(["ip", "netns", "exec", r, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)
        if self.upnp:
            self._miniupnpd(i)
        _sh(["ip", "netns", "exec", h, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
             "rate", f"{rate_bit}bit", "burst", self.burst, "latency", self.latency])

    def _miniupnpd(self, i: int) -> None:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix=f"{self.prefix}upnp")
        conf = os.path.join(self._tmp, f"r{i}.conf")
        with open(conf, "w") as f:
            f.write(miniupnpd_config(i))
        with open(os.path.join(self._tmp, f"r{i}.log"), "wb") as logf:
            p: subprocess.Popen[Any] = subprocess.Popen(
                ["ip", "netns", "exec", self.router(i), "miniupnpd", "-d", "-f", conf, "-P", conf + ".pid"],
                stdout=subprocess.DEVNULL, stderr=logf, start_new_session=True)
        self._procs.append(p)

    def miniupnpd_log(self, i: int) -> str:
        """What home ``i``'s miniupnpd logged (for a failing test's message)."""
        try:
            with open(os.path.join(self._tmp or "", f"r{i}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def teardown(self) -> None:
        for p in list(self._procs):
            self.kill(p)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if not self._up:
            return
        errors = []
        for i in range(self.n):
            _sh(["ip", "-n", self.sw, "link", "del", f"p{i}"], check=False)
        routers = [self.router(i) for i in sorted(self.nat)]
        for name in [self.ns(i) for i in range(self.n)] + routers + [self.sw]:
            r = _sh(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                errors.append((name, r.stderr.strip()))
        self._up = False
        left = list_netns(self.prefix)
        if left or errors:
            raise RuntimeError(f"teardown incomplete: left={left} errors={errors}")

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through __exit__: teardown runs

    def __enter__(self) -> Net:
        try:
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: the caller's own handler must tear down
            self._old_term = None
        try:
            return self.setup()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.teardown()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)

    # --- processes and sockets ------------------------------------------------------------------
    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``'s namespace, in its own process group."""
        kw.setdefault("start_new_session", True)
        p: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kw)
        self._procs.append(p)
        return p

    def kill(self, p: subprocess.Popen[Any], grace: float = 2.0) -> None:
        """Stop a process started by :meth:`popen` and its process group (and only those)."""
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # leader gone; its group may remain
        if p in self._procs:
            self._procs.remove(p)

    @contextlib.contextmanager
    def inside(self, i: int) -> Iterator[None]:
        """Run this thread in host ``i``'s namespace: sockets it opens (and threads it starts,
        which inherit the namespace) live there. Back in the original namespace on exit."""
        orig = os.open(f"/proc/self/task/{_tid()}/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.ns(i)}")
            try:
                yield
            finally:
                _setns(f"/proc/self/fd/{orig}")
        finally:
            os.close(orig)


def _tid() -> int:
    import threading

    return threading.get_native_id()
