"""``echo2 node run | status``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .prefs_cli import add_pref_flags, pref_overrides, register_prefs

DEFAULT_DIR = Path.home() / ".echo2" / "node"


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="node_cmd", metavar="{run,status,receipts,doctor,prefs}")
    sub.required = True
    run = sub.add_parser("run", help="join a hub and produce rollouts", description="join a hub and produce rollouts")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--hub", help="the hub's multiaddr, ending in /p2p/<peer ID> (see DIR/hub.addrs); "
                                     "/dns4/NAME/tcp/PORT/p2p/ID and /dns6/... take a host name")
    where.add_argument("--join", metavar="JOIN_STRING",
                       help="the hub's address and join token in one string, as `echo2 hub join-string` prints it")
    run.add_argument("--data-dir", type=Path, default=DEFAULT_DIR, help=f"identity, state and chunk store (default {DEFAULT_DIR})")
    run.add_argument("--engine", default="auto", choices=["auto", "transformers", "vllm"])
    run.add_argument("--price", type=float, default=0.0, dest="price", metavar="USD_PER_HOUR", help="your price in USD per hour")
    run.add_argument("--max-upload-MBps", type=float, default=0.0, help="cap on what this node uploads (0 = unlimited)")
    run.add_argument("--listen-host", default="127.0.0.1")
    run.add_argument("--listen-port", type=int, default=0)
    run.add_argument("--port-map", dest="port_map", default="auto", choices=["auto", "upnp", "natpmp", "off"],
                     help="ask the home router (NAT-PMP, then UPnP IGD) to forward the node's ports while it runs, so "
                          "that it can relay to others as a reachable parent (default auto: only behind a private "
                          "address, with --listen-host other than loopback; deleted on exit; off: never ask)")
    run.add_argument("--join-token", default=os.environ.get("ECHO2_JOIN_TOKEN", ""),
                     help="join token printed by `echo2 hub token` (or set ECHO2_JOIN_TOKEN; visible in ps otherwise)")
    run.add_argument("--join-token-file", type=Path, default=None, help="read the join token from this file")
    run.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    run.add_argument("--memory-budget-MiB", type=int, default=0, dest="memory_budget_MiB",
                     help="memory a hub may make this node use for the model and its tasks; larger models are "
                          "refused and larger tasks declined (default 0: 80%% of RAM, or of GPU memory)")
    run.add_argument("--allow-model-hub", action="store_true",
                     help="let transformers reach the Hugging Face hub (default: offline; a node needs nothing from it, "
                          "and a hub-sent setting could make it fetch code)")
    run.add_argument("--json", action="store_true", dest="json_events",
                     help="progress as JSON events on stdout, one per line (for machines)")
    run.add_argument("--max-tasks", type=int, default=0, help=argparse.SUPPRESS)
    run.add_argument("--result-linger-ms", type=float, default=0.0, metavar="MS",
                     help="let a finished result wait up to MS for the next one to go in the same batch, when that "
                          "one is expected in time (default 0: what is finished goes at once)")
    add_pref_flags(run)
    run.set_defaults(func=_run)
    st = sub.add_parser("status", help="what the running node is doing", description="what the running node is doing")
    st.add_argument("--data-dir", type=Path, default=DEFAULT_DIR)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_status)
    rc = sub.add_parser("receipts", help="the hub's signed receipts for this node's work: credit per hub and day",
                        description="sum the receipts kept in DATA_DIR/receipts.bin; --verify checks every signature "
                                    "offline (the key is in the receipt's hub ID) and exits 1 if any fails")
    rc.add_argument("--data-dir", type=Path, default=DEFAULT_DIR)
    rc.add_argument("--verify", action="store_true", help="exit 1 unless every kept receipt verifies")
    rc.add_argument("--json", action="store_true", help="machine-readable output")
    rc.set_defaults(func=_receipts)
    from .doctor import register_doctor

    register_doctor(sub)
    register_prefs(sub, DEFAULT_DIR)


def _run(args: argparse.Namespace) -> int:
    from echo2.node.runtime import NodeConfig, run_node

    if args.price < 0:
        raise SystemExit("--price must be >= 0")
    if args.memory_budget_MiB < 0:
        raise SystemExit("--memory-budget-MiB must be >= 0")
    token = args.join_token
    if args.join_token_file is not None:
        token = args.join_token_file.read_text().strip()
    hub = args.hub
    if args.join is not None:
        from echo2.protocol.joinstring import JoinStringError, parse_join_string

        try:
            hub, joined = parse_join_string(args.join)
        except JoinStringError as exc:
            raise SystemExit(f"--join: {exc.message}") from exc
        token = joined or token
    cfg = NodeConfig(
        hub=hub,
        data_dir=args.data_dir,
        engine=args.engine,
        price_usd_per_hour=args.price,
        max_upload_MBps=args.max_upload_MBps,
        listen_host=args.listen_host,
        listen_port=args.listen_port,
        join_token=token,
        threads=args.threads,
        max_tasks=args.max_tasks,
        result_linger_ms=max(0.0, args.result_linger_ms),
        memory_budget_MiB=args.memory_budget_MiB,
        model_hub_offline=not args.allow_model_hub,
        json_events=args.json_events,
        port_map=args.port_map,
        prefs=pref_overrides(args, args.data_dir),
    )
    return run_node(cfg)


def _status(args: argparse.Namespace) -> int:
    path = args.data_dir / "node.state.json"
    if not path.exists():
        print(f"no node state at {path}: is a node running with --data-dir {args.data_dir}?")
        return 1
    from .receipts import render, summary

    state = json.loads(path.read_text())
    receipts = summary(args.data_dir)  # credit per hub and day, refusals with their reason (issue 19)
    age = time.time() - float(state.get("updated", 0))
    state["state_age_s"] = round(age, 1)
    hours = float(state.get("uptime_s", 0)) / 3600
    state["estimated_earnings_usd"] = round(hours * float(state.get("price_usd_per_hour", 0)), 6)
    if args.json:
        print(json.dumps(state | {"receipts": receipts}, indent=1))
        return 0
    for key in ("peer_id", "hub", "admitted", "admission_reason", "paused", "pause_reason", "version", "tasks_done", "tasks_declined",
                "results_refused", "outbox_waiting", "mean_batch", "tokens", "price_usd_per_hour", "estimated_earnings_usd", "state_age_s"):
        print(f"{key:24} {state.get(key)}")
    print(render(receipts))
    return 0


def _receipts(args: argparse.Namespace) -> int:
    from .receipts import render, summary

    s = summary(args.data_dir)
    print(json.dumps(s, indent=1) if args.json else render(s))
    if args.verify and not args.json:
        print(f"verify: {s['verified']} of {s['receipts']} receipts verified, {len(s['refused'])} refused")
    return 1 if args.verify and s["refused"] else 0
