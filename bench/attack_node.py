"""Attacks on an honest node (A4, A7, A8): a stranger at its data plane, and a hostile hub (the
bench holds the hub's key, as anyone who stole or forged it would) sending it hub-signed versions
on its data plane."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from echo2.bench.attack_common import RssPeak, codes, stranger_connect
from echo2.bench.attack_swarm import attacker_source

if TYPE_CHECKING:
    from echo2.bench.attack import Ctx, Effect

MiB = 1024 * 1024


# --- A4 -------------------------------------------------------------------------------------------


async def a4_open_dataplane(ctx: Ctx) -> Effect:
    """A stranger at node 0's data plane: four connections announcing 64 MiB MESSAGE frames and
    sending them at 64 KiB/s, one sending whole 16 MiB MESSAGE frames, one spamming requests.
    Effect: the node's RSS, and whether a stranger was served at all."""
    from echo2.protocol import dataframe as dp
    from echo2.protocol.messages import ChunkRequest
    from echo2.protocol.wire import REQ_GET, encode_request

    h, fz = ctx.h, ctx.fz
    addr, peer = h.node_data_addrs[0], fz.node_peers[0]
    if not addr:
        return "not measured: node 0's data plane port was not found", None
    stats: Counter[str] = Counter()
    peak = RssPeak(h.swarm.nodes[0].pid)

    async def session(kind: str) -> None:
        while True:
            conn = await stranger_connect(addr, peer, stats, "refused:")
            if conn is None:
                continue
            stats["accepted"] += 1
            sock = conn._stream
            try:
                if kind == "slow":
                    await sock.send_all(dp.HEADER.pack(dp.FrameType.MESSAGE, dp.ZERO_KEY, 64 * MiB))
                    block = os.urandom(16 * 1024)
                    for _ in range(4096):
                        await sock.send_all(block)
                        stats["slow_bytes"] += len(block)
                        await trio.sleep(0.25)
                elif kind == "big":
                    body = os.urandom(16 * MiB)
                    for _ in range(8):
                        await sock.send_all(dp.HEADER.pack(dp.FrameType.MESSAGE, dp.ZERO_KEY, len(body)) + body)
                        stats["big_frames_delivered"] += 1
                        await trio.sleep(0.2)
                else:
                    for i in range(100_000):
                        req = encode_request(REQ_GET, m=ChunkRequest(version=i % 7, indices=list(range(i % 50, 2000))).to_wire())
                        await conn.send_request(req)
                        stats["requests"] += 1
                        if i % 50 == 0:
                            await trio.sleep(0.05)
            except Exception as exc:
                stats[f"{kind}_ended:{getattr(exc, 'code', type(exc).__name__)}"] += 1
            finally:
                await conn.abort()
            await trio.sleep(0.5)

    async with trio.open_nursery() as n:
        n.start_soon(peak.run)
        with attacker_source():
            for _ in range(4):
                n.start_soon(session, "slow")
            n.start_soon(session, "big")
            n.start_soon(session, "spam")
        await ctx.window()
        n.cancel_scope.cancel()
    effect = {"node_rss_peak_growth_mib": round(peak.peak, 1), "stranger": dict(stats)}
    prevented = stats["accepted"] == 0 or (peak.peak <= 32 and stats["big_frames_delivered"] == 0)
    return effect, prevented


# --- a hostile hub --------------------------------------------------------------------------------


def _peek_store(ctx: Ctx, i: int) -> Any:
    """Node ``i``'s chunk store, read beside the running node: opening a ChunkStore clears its
    stray temporary files, which a live node may be writing (a hostile hub knows its versions
    anyway; reading them here is only the shortest way to them)."""
    from echo2.node.chunkstore import ChunkStore

    class _Peek(ChunkStore):
        def _remove_stray_tmp(self) -> int:
            return 0

    return _Peek(ctx.h.root / f"node{i}" / "store", fsync=False)


def held_manifest(ctx: Ctx, i: int) -> tuple[Any, Any] | None:
    """(Manifest, hub identity): the newest version node ``i`` stored, and the hub's key."""
    from echo2.keyfile import load_identity
    from echo2.protocol import envelope
    from echo2.protocol.messages import Manifest

    store = _peek_store(ctx, i)
    for v in sorted(store.versions(), reverse=True):
        raw = store.manifest_envelope(v)
        if raw is None:
            continue
        m = envelope.open_envelope(raw, Manifest, replay=None).message
        if store.is_complete(m):
            return m, load_identity(ctx.h.root / "hub" / "hub.key")
    return None


def replace_msg(msg: Any, **changes: Any) -> Any:
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return dataclasses.replace(msg, **changes)
    import msgspec

    return msgspec.structs.replace(msg, **changes)


def hostile_version(ctx: Ctx, i: int, model_config: str) -> tuple[int, Any, bytes, bytes] | None:
    """A hub-signed version for node ``i``: its own weights with one byte of the last chunk
    changed (so that one chunk must travel, and the version completes in the node's store worker
    as a real one does) under ``model_config``. (version, hub identity, manifest envelope, the
    CHUNK frame payload)."""
    from echo2.protocol import envelope, packing
    from echo2.protocol.hashing import digest
    from echo2.protocol.wire import ENC_MANIFEST, pack_chunk_frame

    got = held_manifest(ctx, i)
    if got is None:
        return None
    m, hub = got
    raws = _peek_store(ctx, i).load_raw_chunks(m)
    raw = bytearray(raws[-1])
    raw[-1] ^= 1
    enc = packing.encode_chunk(raw)
    last = replace_msg(m.chunks[-1], raw_hash=digest(raw), encoding="full", enc_size=len(enc), enc_hash=digest(enc),
                       parent_raw_hash=None)
    version = m.version + 1000
    bad = replace_msg(m, version=version, created=time.time(), model_config=model_config, chunks=[*m.chunks[:-1], last])
    return version, hub, envelope.seal(hub, bad), pack_chunk_frame(version, last.index, ENC_MANIFEST, enc)


async def send_as_hub(ctx: Ctx, i: int, hub_ident: Any, payload: bytes, linger_s: float, chunk: bytes | None = None) -> str:
    """Open node ``i``'s data plane with the hub's key and send one MESSAGE frame (and a chunk)."""
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.net.dataplane import connect

    try:
        conn = await connect(ctx.h.node_data_addrs[i], hub_ident, ctx.fz.node_peers[i], timeout_s=5)
    except Echo2Error as exc:
        return f"refused:{getattr(exc, 'reason', getattr(exc, 'code', type(exc).__name__))}"
    try:
        await conn.send_message(payload)
        if chunk is not None:  # at once: the hub's next real version would supersede ours
            await conn.send_chunk(chunk)
        with trio.move_on_after(linger_s):
            while True:
                await conn.receive()
        return "sent"
    except Exception as exc:
        return f"sent; link ended {getattr(exc, 'code', type(exc).__name__)}"
    finally:
        await conn.abort()


async def a7_hostile_hub(ctx: Ctx) -> Effect:
    """A hub-signed version for node 0 whose model config needs far more memory than any machine
    has (the weights it names are the node's own, so the version completes at once and goes to
    the engine). Effect: the node process survived (and what it said)."""

    got = held_manifest(ctx, 0)
    if got is None:
        return "not measured: node 0 holds no complete version", None
    cfg = json.loads(got[0].model_config)
    cfg.update(hidden_size=1 << 16, intermediate_size=1 << 18, num_hidden_layers=512, vocab_size=1 << 22)
    hv = hostile_version(ctx, 0, json.dumps(cfg, sort_keys=True))
    if hv is None:
        return "not measured: node 0 holds no complete version", None
    version, hub, payload, chunk = hv
    proc = ctx.h.swarm.nodes[0]
    peak = RssPeak(proc.pid)
    async with trio.open_nursery() as n:
        n.start_soon(peak.run)
        ctx.begin()
        sent = await send_as_hub(ctx, 0, hub, payload, linger_s=2.0, chunk=chunk)
        await trio.sleep(max(0.0, ctx.seconds - 2.0))
        ctx.end()
        n.cancel_scope.cancel()
    alive = proc.poll() is None
    log = ctx.node_log_since(0)
    # the version completed, so the node went on to load it (or refused it, after a fix)
    taken = re.search(rf"holds version {version} verified", log) is not None
    effect = {
        "node_survived": alive, "exit_code": proc.returncode, "sent": sent,
        "claimed_model_params": _params(cfg), "node_rss_peak_growth_mib": round(peak.peak, 1),
        "node_refused_lines": codes(log, "refus", "does not fit", "too large", "memory"),
        "node_said": _tail_lines(log, r"Error|refus|memory|fit", 3), "hostile_version_taken_up": taken,
    }
    if not sent.startswith("sent") or not (taken or effect["node_refused_lines"]):
        return effect, None if alive else False  # the attack did not reach the node's checks
    return effect, alive


def _params(cfg: dict[str, Any]) -> int:
    h, i, n, v = (int(cfg.get(k, 0)) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    return n * (4 * h * h + 3 * h * i) + 2 * v * h


def _tail_lines(text: str, pattern: str, n: int) -> list[str]:
    pat = re.compile(pattern)
    return [line[-200:] for line in text.splitlines() if pat.search(line)][-n:]


async def a8_config_injection(ctx: Ctx) -> Effect:
    """A hub-signed version for node 0 whose model config adds ``attn_implementation`` naming a
    kernels-hub repository (transformers would fetch and run its code) and a key outside any
    allow-list. Effect: whether the setting reached the engine (node log: the version loaded or
    transformers acted on it) or was refused."""

    got = held_manifest(ctx, 0)
    if got is None:
        return "not measured: node 0 holds no complete version", None
    repo = "kernels-community/flash-attn"
    cfg = json.loads(got[0].model_config)
    cfg.update(attn_implementation=repo, echo2_attack_unlisted_key=1)
    hv = hostile_version(ctx, 0, json.dumps(cfg, sort_keys=True))
    if hv is None:
        return "not measured: node 0 holds no complete version", None
    version, hub, payload, chunk = hv
    proc = ctx.h.swarm.nodes[0]
    ctx.begin()
    sent = await send_as_hub(ctx, 0, hub, payload, linger_s=2.0, chunk=chunk)
    await trio.sleep(max(0.0, ctx.seconds - 2.0))
    ctx.end()
    log = ctx.node_log_since(0)
    loaded = re.search(rf"holds version {version} \(", log) is not None  # the engine loaded it
    refused = [line[-200:] for line in log.splitlines()
               if re.search(r"attn_implementation|echo2_attack_unlisted_key", line)
               and re.search(r"refus|not allowed|allow-list|allowlist|ignor|forbidden", line, re.I)]
    acted = [line[-200:] for line in log.splitlines() if "kernels" in line and line[-200:] not in refused]
    reached = (loaded and not refused) or bool(acted)
    effect = {
        "reached_engine": reached, "version_loaded": loaded, "refusal_lines": refused[-3:],
        "transformers_acted_lines": acted[-3:], "node_survived": proc.poll() is None, "sent": sent,
    }
    if not sent.startswith("sent"):
        return effect, None
    if reached:
        return effect, False
    return effect, True if refused else None
