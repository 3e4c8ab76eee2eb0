"""``echo2 node doctor``: can this machine be a useful node for that hub, and if not, why not.

Every check says pass / fail / info / skip, what it saw, and for a failure the fix. Local
checks need nothing; the network checks use a real libp2p host with the node's identity (or a
throw-away one before the first run) and the hub's probe service (``/echo2/probe/1.0.0``):
hub reachable (connect + ping), the home router's port mapping (node.portmap, held during the
probe), our listen port reachable from the hub (it dials back), clock
skew against the hub, bandwidth over the data plane. Every network step is bounded by
``timeout``. Exit code 1 when any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import platform
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PASS, FAIL, INFO, SKIP = "pass", "fail", "info", "skip"
MIN_PYTHON = (3, 11)
MIN_FREE_DISK = 2 * 1024**3
MAX_CLOCK_SKEW_S = 5.0
MODEL_CONFIG_FILE = "model_config.json"  # the hub's model config, once known (see report)
DEFAULT_DIR = Path.home() / ".echo2" / "node"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | fail | info | skip
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


# --- local checks ---------------------------------------------------------------------------------


def check_python() -> Check:
    v = sys.version_info
    if (v.major, v.minor) >= MIN_PYTHON:
        return Check("python", PASS, f"Python {platform.python_version()}")
    return Check(
        "python", FAIL, f"Python {platform.python_version()}", f"install Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
    )


def check_torch() -> Check:
    try:
        import torch
    except Exception as exc:  # a broken install raises more than ImportError
        return Check("torch", FAIL, f"cannot import torch: {exc}", "pip install 'torch>=2.4'")
    cuda = torch.version.cuda or "none"
    return Check("torch", PASS, f"torch {torch.__version__} (CUDA {cuda})")


def check_engine(engine: str) -> Check:
    want = engine
    have_vllm = importlib.util.find_spec("vllm") is not None
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception:
        cuda = False
    if engine == "auto":
        want = "vllm" if have_vllm and cuda else "transformers"
    if want == "transformers":
        try:
            import transformers
        except Exception as exc:
            return Check("engine", FAIL, f"transformers does not import: {exc}", "pip install 'transformers>=5.16'")
        return Check("engine", PASS, f"transformers {transformers.__version__} (engine {engine!r} -> transformers)")
    if want == "vllm":
        if not have_vllm:
            return Check("engine", FAIL, "vLLM is not installed", "pip install 'echo2[vllm]' (GPU nodes), or --engine transformers")
        if not cuda:
            return Check("engine", FAIL, "vLLM is installed but no CUDA GPU is usable", "use --engine transformers on this machine")
        return Check("engine", PASS, "vLLM importable, CUDA available")
    return Check("engine", FAIL, f"unknown engine {engine!r}", "use --engine auto, transformers or vllm")


def check_gpu(hw: Any) -> Check:
    if hw.accelerator_count:
        detail = f"{hw.accelerator_count} × {hw.accelerator}, {hw.accelerator_memory_bytes / 1024**3:.1f} GiB each"
        if hw.accelerator_source == "nvidia-smi":
            return Check(
                "gpu",
                FAIL,
                detail + " (seen by nvidia-smi, but torch cannot use it)",
                "install a CUDA build of torch matching your driver (https://pytorch.org/get-started/locally/)",
            )
        return Check("gpu", PASS, detail)
    return Check("gpu", INFO, "none (CPU node)")


def load_model_config(data_dir: Path, model_config: str | None) -> str | None:
    """The hub's model config JSON text: ``--model-config FILE`` or DIR/model_config.json."""
    path = Path(model_config) if model_config else data_dir / MODEL_CONFIG_FILE
    try:
        return path.read_text()
    except OSError:
        return None


def check_memory(hw: Any, model_config_json: str | None, engine: str) -> Check:
    from .hardware import fits

    if model_config_json is None:
        return Check("memory fit", INFO, "the hub's model is not known yet (learnt from its first manifest)")
    on_gpu = hw.accelerator_count > 0 and hw.accelerator_source == "torch"
    dtype = "bfloat16" if on_gpu and engine != "transformers" else "float32"
    mem = hw.accelerator_memory_bytes if on_gpu else hw.ram_bytes
    ok, _needed, message = fits(model_config_json, dtype, mem)
    where = "GPU memory" if on_gpu else "RAM"
    if ok:
        return Check("memory fit", PASS, f"{where}: {message}")
    return Check("memory fit", FAIL, f"{where}: {message}", "use a machine with more memory, or ask the hub for a smaller model")


def check_disk(hw: Any, data_dir: Path) -> Check:
    free = hw.free_disk_bytes
    detail = f"{free / 1024**3:.1f} GiB free in {data_dir}"
    if free >= MIN_FREE_DISK:
        return Check("disk", PASS, detail)
    return Check("disk", FAIL, detail, f"free space or use --data-dir on a disk with >= {MIN_FREE_DISK // 1024**3} GiB free")


def check_identity(data_dir: Path) -> tuple[Check, Any]:
    """(check, the Identity to use or None)."""
    from echo2.keyfile import load_identity
    from echo2.protocol.errors import IdentityError

    path = data_dir / "node.key"
    if not path.exists():
        return Check("identity", INFO, f"no {path} yet (created by the first `echo2 node run`)"), None
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check("identity", FAIL, f"{path} has mode {mode:04o}: others can read your key", f"chmod 600 {path}"), None
    try:
        ident = load_identity(path)
    except (IdentityError, OSError) as exc:
        return Check(
            "identity", FAIL, f"{path} does not load: {exc}", f"move {path} away; a new identity (new peer ID) is made on the next run"
        ), None
    return Check("identity", PASS, f"{path} (mode 0600), peer ID {ident.peer_id}"), ident


# --- network checks -------------------------------------------------------------------------------

PORTMAP_WAIT_S = 15.0  # NAT-PMP gives up after 1.75 s, UPnP discovery after 1 s plus its HTTP calls


def port_map_check(mapper: Any) -> Check:
    """What the home router did with our port (node.portmap): mapped, not asked and why, or no
    router answered (then the fix)."""
    if mapper.mappings:
        return Check("port mapping", PASS, f"{mapper.status} (deleted when the doctor ends)")
    fix = ""
    if mapper.status.startswith("no port mapping"):
        fix = ("enable UPnP or NAT-PMP on your router, or forward the port by hand (with a fixed --listen-port); "
               "without it a node behind NAT relays only by reverse connections and hole punching")
    return Check("port mapping", INFO, mapper.status, fix)


HUB_FIX = "check the multiaddr in the hub's hub.addrs (it must end in /p2p/<peer ID>) and that no firewall blocks it"


async def network_checks(
    hub: str,
    identity: Any,
    *,
    timeout: float,
    listen_host: str,
    listen_port: int,
    bandwidth: bool,
    announce_fields: dict[str, Any],
    port_map: str = "auto",
) -> list[Check]:
    import trio

    from echo2 import __version__
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.framing import RemoteError
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import Announce
    from echo2.protocol.net.control import ControlHost

    from .measure import BandwidthNotOffered, measure_bandwidth, probe_hub
    from .portmap import PortMapper, mapped

    names = ("hub reachable", "port mapping", "listen port reachable", "clock skew", "bandwidth")
    checks: list[Check] = []

    def skip_rest(why: str) -> list[Check]:
        done = {c.name for c in checks}
        return checks + [Check(n, SKIP, why) for n in names if n not in done]

    parts = hub.rstrip("/").split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
        checks.append(Check("hub reachable", FAIL, f"not a hub multiaddr: {hub[:200]!r}", HUB_FIX))
        return skip_rest("hub address unusable")
    hub_peer = parts[parts.index("p2p") + 1]
    ident = identity or Identity.generate()
    try:
        host_cm = ControlHost(ident, listen_port=listen_port, listen_host=listen_host, dial_timeout_s=timeout)
        async with host_cm as host:
            try:
                with trio.fail_after(timeout):
                    await host.connect(hub)
                    rtt = await host.ping(hub_peer, timeout_s=timeout)
                checks.append(Check("hub reachable", PASS, f"{hub} (ping {rtt * 1000:.1f} ms)"))
            except (Echo2Error, trio.TooSlowError) as exc:
                why = str(exc) or f"no answer within {timeout:g} s"
                checks.append(Check("hub reachable", FAIL, f"cannot reach {hub}: {why}", HUB_FIX))
                return skip_rest("hub not reachable")
            # the router's port mapping (node.portmap), held while the hub dials back: the probe then
            # sees this machine as a node run with the same --port-map would be
            mapper = PortMapper(port_map, lambda: [host.listen_addr[1]], host.remote_ip(hub_peer) or "", host=listen_host)
            async with mapped(mapper):
                with trio.move_on_after(PORTMAP_WAIT_S):
                    await mapper.settled.wait()
                checks.append(port_map_check(mapper))
                announce = Announce(
                    peer_id=ident.peer_id,
                    software_version=__version__,
                    listen_addrs=(mapper.multiaddrs(host.listen_addr[1], ident.peer_id) + list(host.addrs))[:16],
                    data_addr="",
                    reachable=False,
                    versions_held=[],
                    **announce_fields,
                )
                probe_timeout = 4 * timeout + 5.0
                try:
                    with trio.fail_after(probe_timeout + 1.0):
                        result = await probe_hub(host, hub_peer, hub_peer, ident, announce, timeout_s=probe_timeout)
                except RemoteError as exc:
                    if exc.code == "expired":
                        checks.append(Check("clock skew", FAIL, f"the hub refused our probe: {exc}", "enable NTP: timedatectl set-ntp true"))
                    return skip_rest(f"the hub did not answer the probe: [{exc.code}] {exc}")
                except (Echo2Error, trio.TooSlowError) as exc:
                    return skip_rest(f"the hub did not answer the probe (no probe service?): {exc or 'timeout'}")
                port = host.listen_addr[1]
                if result.reachable:
                    checks.append(Check("listen port reachable", PASS, f"the hub dialled back port {port}: {result.reason}"))
                else:
                    checks.append(
                        Check(
                            "listen port reachable",
                            FAIL,
                            f"the hub could not dial back port {port}: {result.reason}",
                            f"open TCP port {port} in your firewall or forward it on your router; "
                            "use --listen-host 0.0.0.0 (or an address the hub can reach) and a fixed --listen-port",
                        )
                    )
                skew = result.clock_skew_s
                detail = f"hub clock {'ahead of' if skew >= 0 else 'behind'} ours by {abs(skew):.3f} s (± {result.skew_uncertainty_s:.3f} s)"
                if abs(skew) < MAX_CLOCK_SKEW_S:
                    checks.append(Check("clock skew", PASS, detail))
                else:
                    checks.append(Check("clock skew", FAIL, detail, "enable NTP: timedatectl set-ntp true (or chronyd/ntpd)"))
                if not bandwidth:
                    checks.append(Check("bandwidth", SKIP, "not measured (--no-bandwidth)"))
                elif not result.probe_data_addr:
                    checks.append(Check("bandwidth", INFO, "the hub runs no bandwidth responder"))
                else:
                    try:
                        with trio.fail_after(4 * timeout + 10.0):
                            bw = await measure_bandwidth(result.probe_data_addr, ident, hub_peer, timeout_s=max(timeout, 5.0))
                        checks.append(
                            Check("bandwidth", PASS, f"upload {bw.upload_MBps:.1f} MB/s, download {bw.download_MBps:.1f} MB/s to the hub")
                        )
                    except BandwidthNotOffered as exc:
                        checks.append(Check("bandwidth", INFO, f"{exc} (run the doctor again once admitted)"))
                    except (Echo2Error, trio.TooSlowError) as exc:
                        checks.append(
                            Check(
                                "bandwidth",
                                FAIL,
                                f"data plane {result.probe_data_addr}: {exc or 'timeout'}",
                                "allow outgoing TCP to the hub's data-plane port (firewall)",
                            )
                        )

    except Echo2Error as exc:
        checks.append(
            Check("listen port reachable", FAIL, f"cannot listen on {listen_host}:{listen_port}: {exc}", "choose another --listen-port (is a node already running?)")
        )
        return skip_rest("no local listener")
    return checks


async def run_doctor_async(
    hub: str,
    data_dir: Path,
    engine: str = "auto",
    timeout: float = 3.0,
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 0,
    model_config: str | None = None,
    bandwidth: bool = True,
    port_map: str = "auto",
    price_usd_per_hour: float = 0.0,
) -> list[Check]:
    from .hardware import probe

    data_dir = Path(data_dir)
    hw = probe(data_dir)
    checks = [check_python(), check_torch(), check_engine(engine), check_gpu(hw)]
    checks.append(check_memory(hw, load_model_config(data_dir, model_config), engine))
    checks.append(check_disk(hw, data_dir))
    id_check, identity = check_identity(data_dir)
    checks.append(id_check)
    fields = {
        "accelerator": hw.accelerator[:128],
        "accelerator_count": hw.accelerator_count,
        "accelerator_memory_bytes": hw.accelerator_memory_bytes,
        "cpu_model": hw.cpu_model[:256],
        "cpu_cores": hw.cpu_cores,
        "ram_bytes": hw.ram_bytes,
        "free_disk_bytes": hw.free_disk_bytes,
        "engine": engine[:64],
        "engine_version": "",
        "tokens_per_s": 0.0,
        "rollouts_per_s": 0.0,
        "upload_MBps": 0.0,
        "download_MBps": 0.0,
        "price_usd_per_hour": float(price_usd_per_hour),
        "max_upload_MBps": 0.0,
    }
    checks += await network_checks(
        hub,
        identity,
        timeout=timeout,
        listen_host=listen_host,
        listen_port=listen_port,
        bandwidth=bandwidth,
        port_map=port_map,
        announce_fields=fields,
    )
    return checks


def run_doctor(hub: str, data_dir: Path, engine: str = "auto", timeout: float = 3.0, **kw: Any) -> list[Check]:
    """Blocking form of :func:`run_doctor_async` (runs its own trio loop)."""
    import trio

    async def main() -> list[Check]:
        return await run_doctor_async(hub, data_dir, engine, timeout, **kw)

    return trio.run(main)


# --- output -----------------------------------------------------------------------------------


_MARK = {PASS: "ok", FAIL: "FAIL", INFO: "info", SKIP: "skip"}


def render_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks) if checks else 0
    lines = []
    for c in checks:
        lines.append(f"{_MARK.get(c.status, c.status):>4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':>4}  {'':<{width}}  fix: {c.fix}")
    failed = sum(c.failed for c in checks)
    lines.append(f"{failed} check(s) failed" if failed else "all checks passed")
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.failed for c in checks) else 0


def checks_json(checks: list[Check]) -> str:
    return json.dumps({"ok": exit_code(checks) == 0, "checks": [asdict(c) for c in checks]}, indent=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hub", required=True, help="the hub's multiaddr, ending in /p2p/<peer ID> (see DIR/hub.addrs)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DIR, help=f"the node's data dir (default {DEFAULT_DIR})")
    p.add_argument("--engine", default="auto", choices=["auto", "transformers", "vllm"])
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for each network step (default 3)")
    p.add_argument("--listen-host", default="127.0.0.1", help="the address your node will listen on")
    p.add_argument("--listen-port", type=int, default=0, help="the port your node will listen on (0 = any)")
    p.add_argument("--port-map", dest="port_map", default="auto", choices=["auto", "upnp", "natpmp", "off"],
                   help="ask the home router to forward the listen port during the check, as `node run` does")
    p.add_argument("--model-config", default=None, help="the hub's model config.json (default DIR/model_config.json)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurement")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd(args: argparse.Namespace) -> int:
    checks = run_doctor(
        args.hub,
        args.data_dir,
        args.engine,
        args.timeout,
        listen_host=args.listen_host,
        listen_port=args.listen_port,
        model_config=args.model_config,
        bandwidth=not args.no_bandwidth,
        port_map=args.port_map,
    )
    print(checks_json(checks) if args.json else render_table(checks))
    return exit_code(checks)


def register_doctor(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``doctor`` to ``echo2 node``'s subparsers (the object ``add_subparsers`` returned)."""
    help_text = "check that this machine can serve a hub, and say how to fix what cannot"
    p = subparsers.add_parser("doctor", help=help_text, description=help_text)
    add_arguments(p)
    p.set_defaults(func=cmd)
    return p


__all__ = [
    "Check",
    "add_arguments",
    "checks_json",
    "cmd",
    "exit_code",
    "register_doctor",
    "render_table",
    "run_doctor",
    "run_doctor_async",
]
