"""``echo2 hub init | run | status | admit | token | join-string | nodes | ledger | plan | report | export``."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="hub_cmd", metavar="{init,run,status,admit,token,join-string,nodes,ledger,plan,report,export}")
    sub.required = True
    init = sub.add_parser("init", help="write a commented config and the hub's key", description="write a commented config and the hub's key")
    init.add_argument("--dir", type=Path, required=True, help="hub directory")
    init.add_argument("--task", default="copy", choices=["copy", "reverse", "arith", "jsonl"])
    init.add_argument("--model", default="tiny", help='"tiny" or a local Hugging Face model directory')
    init.add_argument("--force", action="store_true", help="overwrite an existing config")
    init.set_defaults(func=_init)
    run = sub.add_parser("run", help="run the hub", description="run the hub: learner, dispatcher, publisher")
    run.add_argument("--config", type=Path, required=True, help="hub.toml written by `echo2 hub init`")
    run.add_argument("--steps", type=int, default=None, help="override the config's step count")
    run.add_argument("--exit-when-done", action="store_true", help="stop after the last step")
    run.add_argument("--learner-procs", type=int, default=None, metavar="N", help="override learner_procs: N FSDP2 learner ranks")
    run.set_defaults(func=_run)

    def dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", type=Path, default=Path("."), help="hub directory (default: current directory)")

    status = sub.add_parser("status", help="the hub's status: steps, results, refusals, intake workers",
                            description="summarise DIR/status.json (what the running hub wrote last)")
    status.add_argument("--json", action="store_true", help="print status.json as it is")
    dir_arg(status)
    status.set_defaults(func=_status)

    admit = sub.add_parser("admit", help="add a peer ID to the allowlist", description="add a peer ID to the allowlist (admission = allowlist or token)")
    admit.add_argument("peer_id")
    admit.add_argument("--note", default="")
    dir_arg(admit)
    admit.set_defaults(func=_admit)
    token = sub.add_parser(
        "token", help="print a signed join token (or: token revoke ID, token list)",
        description="print a join token signed by the hub's key (its id goes to stderr); "
        "`token revoke ID` refuses every later admission with it; `token list` shows tokens and their uses",
    )
    token.add_argument("action", nargs="?", choices=["revoke", "list"], help="revoke a token by id, or list tokens")
    token.add_argument("token_id", nargs="?", help="the token id to revoke (printed when the token was made)")
    token.add_argument("--expires", default="7d", help="lifetime, e.g. 30m, 12h, 7d (default 7d)")
    token.add_argument("--peer", default=None, help="bind the token to one peer ID")
    token.add_argument("--max-uses", type=int, default=None, help="at most this many distinct nodes may join with it")
    dir_arg(token)
    token.set_defaults(func=_token)
    js = sub.add_parser(
        "join-string", help="print the hub's address and a new join token as one string for `echo2 node run --join`",
        description="print MULTIADDR/join/TOKEN: the hub's address (from DIR/hub.addrs, written when the hub starts, "
        "or --addr) and a new join token (as `echo2 hub token` makes it; --no-token for an open hub)",
    )
    js.add_argument("--addr", default=None, help="the address nodes dial (default: the first of DIR/hub.addrs)")
    js.add_argument("--host", default=None, metavar="NAME",
                    help="put this host name in the address (/dns4/NAME/...), e.g. the hub's public DNS name")
    js.add_argument("--no-token", action="store_true", help="no join token (a hub with admission = open)")
    js.add_argument("--expires", default="7d", help="token lifetime, e.g. 30m, 12h, 7d (default 7d)")
    js.add_argument("--peer", default=None, help="bind the token to one peer ID")
    js.add_argument("--max-uses", type=int, default=None, help="at most this many distinct nodes may join with it")
    dir_arg(js)
    js.set_defaults(func=_join_string)
    nodes = sub.add_parser("nodes", help="the fleet: hardware, price, measured rate, reputation, state, cost", description="the fleet table")
    dir_arg(nodes)
    nodes.set_defaults(func=_nodes)
    ledger = sub.add_parser("ledger", help="per-node cost and production ledger", description="per-node cost and production ledger")
    ledger.add_argument("--csv", action="store_true")
    dir_arg(ledger)
    ledger.set_defaults(func=_ledger)
    plan = sub.add_parser("plan", help="capacity model for the current fleet", description="required rate, eligible nodes, smallest S, predicted utilization")
    plan.add_argument("--staleness", type=int, default=None)
    dir_arg(plan)
    plan.set_defaults(func=_plan)
    report = sub.add_parser("report", help="a run's curves and summary from its store (while it runs or after)",
                            description="read DIR/hub.sqlite read-only: the run's curves as a self-contained HTML file, "
                            "PNGs (echo2[bench]) and a JSON summary; prints the summary")
    report.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the curves and tables as one HTML file")
    report.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the summary as JSON")
    report.add_argument("--png", type=Path, default=None, metavar="DIR", help="write the curves as PNG files (matplotlib)")
    dir_arg(report)
    report.set_defaults(func=_report)
    export = sub.add_parser(
        "export", help="write a policy version as a Hugging Face model directory",
        description="write a checkpointed policy version (the newest by default) as a Hugging Face model directory: "
        "config, safetensors weights, generation config, the run's tokenizer and a model card; a LoRA run's adapter in "
        "peft's format (and with --merge the merged model). Reads the hub directory only, running or stopped.",
    )
    dir_arg(export)
    export.add_argument("--out", type=Path, required=True, help="the model directory to write")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=None, metavar="N", help="this version (it needs a checkpoint)")
    which.add_argument("--best-eval", action="store_true", help="the checkpointed version with the best evaluation")
    export.add_argument("--merge", action="store_true", help="LoRA run: also write the merged model (adapter goes to OUT/adapter)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights dtype (default: the run's publish_dtype, the policy nodes sampled; float32 = master weights)")
    export.add_argument("--max-shard-size", default="5GB", help="shard model.safetensors above this size (default 5GB)")
    export.add_argument("--config", type=Path, default=None, help="the run's hub.toml (default: DIR/hub.toml)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out")
    export.set_defaults(func=_export)


def _status(args: argparse.Namespace) -> int:
    import json

    from echo2.learner_hub.hubsummary import load, render

    st = load(args.dir)
    if st is None:
        print(f"no status at {args.dir / 'status.json'}: has a hub run with --dir {args.dir}?")
        return 1
    print(json.dumps(st, indent=1) if args.json else render(st))
    return 0


def _init(args: argparse.Namespace) -> int:
    from echo2.keyfile import load_or_create_identity
    from echo2.learner_hub.config import HubConfig, render_config

    d: Path = args.dir
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "hub.toml"
    if cfg_path.exists() and not args.force:
        print(f"{cfg_path} exists (use --force to overwrite)")
        return 1
    cfg = HubConfig(dir=".", task=args.task, model=args.model)
    cfg.validate()
    cfg_path.write_text(render_config(cfg))
    ident = load_or_create_identity(d / "hub.key")
    print(f"wrote {cfg_path}\nhub peer ID {ident.peer_id} (key in {d / 'hub.key'}, mode 0600)")
    print(f"start it with: echo2 hub run --config {cfg_path}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from echo2.learner_hub.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        if args.steps is not None:
            cfg.steps = args.steps
        if args.exit_when_done:
            cfg.exit_when_done = True
        if args.learner_procs is not None:
            cfg.learner_procs = args.learner_procs
        cfg.validate(f"{args.config} with --steps")
    except ConfigError as exc:  # the operator's file or flags: say what is wrong, not a traceback
        print(f"echo2 hub run: {exc.message}", file=sys.stderr)
        return 1
    from echo2.learner_hub.hub import run_hub

    try:
        return run_hub(cfg)
    except ConfigError as exc:  # found while building the hub (a reward function, a dataset file)
        print(f"echo2 hub run: {exc.message}", file=sys.stderr)
        return 1


def _store(d: Path):  # type: ignore[no-untyped-def]
    from echo2.learner_hub.store import HubStore

    if not (d / "hub.sqlite").exists() and not (d / "hub.key").exists():
        raise SystemExit(f"{d} is not a hub directory (no hub.key / hub.sqlite); use --dir")
    return HubStore.in_dir(d)


def _admit(args: argparse.Namespace) -> int:
    from echo2.protocol.identity import IdentityError, public_key_from_peer_id

    try:
        public_key_from_peer_id(args.peer_id)
    except IdentityError as exc:
        raise SystemExit(f"not an Ed25519 peer ID: {exc}") from exc
    with _store(args.dir) as store:
        store.allow(args.peer_id, time.time(), note=args.note)
    print(f"allowlisted {args.peer_id}")
    return 0


def _token(args: argparse.Namespace) -> int:
    if args.action == "revoke":
        if not args.token_id or not re.fullmatch(r"[0-9a-f]{16}", args.token_id):
            raise SystemExit("usage: echo2 hub token revoke TOKEN_ID (16 hex digits, printed when the token was made)")
        with _store(args.dir) as store:
            known = store.revoke_token(args.token_id, time.time())
        print(f"revoked join token {args.token_id}" + ("" if known else " (not made by this hub's store: revoked anyway)"))
        return 0
    if args.action == "list":
        with _store(args.dir) as store:
            for t in store.tokens():
                state = "revoked" if t.revoked_at is not None else ("expired" if t.expires < time.time() else "valid")
                cap = "unlimited" if t.max_uses is None else str(t.max_uses)
                print(f"{t.token_id}  {state:7}  uses {t.uses}/{cap}  peer {t.peer or '-'}")
        return 0
    if args.token_id:
        raise SystemExit("a token id is only taken by `echo2 hub token revoke ID`")
    print(_new_token(args))
    return 0


def _new_token(args: argparse.Namespace) -> str:
    """A join token made and recorded as `echo2 hub token` does (its id goes to stderr)."""
    import secrets

    from echo2.keyfile import load_identity
    from echo2.learner_hub.admission import MAX_TOKEN_USES, make_join_token, parse_duration, token_id

    if args.max_uses is not None and not 1 <= args.max_uses <= MAX_TOKEN_USES:
        raise SystemExit(f"--max-uses must be in [1, {MAX_TOKEN_USES}]")
    ttl = parse_duration(args.expires)
    ident = load_identity(args.dir / "hub.key")
    now, nonce = time.time(), secrets.token_bytes(16)
    tok = make_join_token(ident, ttl_s=ttl, now=now, peer_id=args.peer, nonce=nonce, max_uses=args.max_uses)
    with _store(args.dir) as store:
        store.record_token(token_id(nonce), now, now + ttl, args.max_uses, args.peer)
    print(f"token id {token_id(nonce)} (revoke with: echo2 hub token revoke {token_id(nonce)})", file=sys.stderr)
    return tok


def _join_string(args: argparse.Namespace) -> int:
    from echo2.protocol.joinstring import JoinStringError, make_join_string

    addr = args.addr
    if addr is None:
        path = args.dir / "hub.addrs"
        if not path.exists() or not path.read_text().split():
            raise SystemExit(f"no {path}: start the hub once (it writes its addresses there) or pass --addr")
        addr = path.read_text().split()[0]
    if args.host:
        # /ip4/IP/tcp/... -> /dns4/NAME/tcp/... (or /ip4, /ip6 when NAME is an address)
        parts = addr.split("/")
        kind = "ip6" if ":" in args.host else ("ip4" if re.fullmatch(r"[0-9.]+", args.host) else "dns4")
        addr = "/".join(["", kind, args.host, *parts[3:]])
    try:
        make_join_string(addr)  # the address is checked before a token is made for it
    except JoinStringError as exc:
        raise SystemExit(f"echo2 hub join-string: {exc.message}") from exc
    print(make_join_string(addr, "" if args.no_token else _new_token(args)))
    return 0


def _nodes(args: argparse.Namespace) -> int:
    with _store(args.dir) as store:
        print(store.nodes_report())
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    from .report import run_report

    try:
        rep = run_report(args.dir, args.html, args.json, args.png)
    except FileNotFoundError as exc:
        print(f"echo2 hub report: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(rep["summary"], indent=2, default=str))
    return 0


def _ledger(args: argparse.Namespace) -> int:
    with _store(args.dir) as store:
        print(store.ledger_report(as_csv=args.csv))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from echo2.learner_hub.capacity import NodeCapacity, capacity_report

    with _store(args.dir) as store:
        meta = store.get_meta("capacity", None)
    if not meta:
        print("no capacity measurements yet: run the hub with some nodes first")
        return 1
    nodes = [NodeCapacity(n["node_id"], n["load_s"], n["task_s"], n["rate"]) for n in meta["nodes"]]
    s = meta["staleness"] if args.staleness is None else args.staleness
    print(capacity_report(meta["batch"], max(meta["t_train"], 1e-3), s, nodes, overhead_s=meta.get("overhead_s", 0.0)).format())
    return 0


def _export(args: argparse.Namespace) -> int:
    from echo2.learner_hub.export import ExportError, export

    try:
        res = export(args.dir, args.out, version=args.version, best_eval=args.best_eval, merge=args.merge,
                     dtype=args.dtype, max_shard_size=args.max_shard_size, config=args.config, force=args.force)
    except ExportError as exc:
        print(f"echo2 hub export: {exc}", file=sys.stderr)
        return 1
    what = "LoRA adapter" + (" + merged model" if res.merged else "") if res.lora else "model"
    print(f"exported version {res.step} ({res.note}) as a {what} in {res.dtype} to {res.out}: {len(res.files)} files")
    return 0
