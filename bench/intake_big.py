"""``echo2 bench intake --big-result-MB 36``: what one large Result costs the hub (issue 20, item 3).

A real :class:`~echo2.learner_hub.hub.Hub` (tiny model, SQLite store in its thread, the built-in
reward functions) with one admitted node, in this process. The node's task is answered with a
Result of about the asked size, sealed twice: as the list-of-numbers ``Result`` (v1, what nodes
sent before) and as the packed ``PackedResult`` (v2: int32/float32 bytes). Each is handed to
:meth:`Hub.on_result` as the network layer would, and the process CPU across the call
(``time.process_time``: the trio thread, the store's and the reward functions' threads) and its
wall time are reported. Sealing is outside the timed window (it is the node's cost).

Then parts, measured again alone on the same tokens: opening the envelope, and detokenising by
the hub's decoder (learner_hub/detok.py's byte table for this byte-level tokenizer) next to the
tokenizer's own ``decode_batch``. The ids are drawn uniformly from the byte tokens, so about half
the bytes are invalid UTF-8: the worst case for the table's UTF-8 decode (3.4 M tokens, table alone:
66 ms for these, 46 ms for Python source text).
"""

from __future__ import annotations

import gc
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

GROUP = 16


def _hub(workdir: Path, prompts: int, max_new: int, workers: int = 0) -> Any:
    from echo2.learner_hub.config import HubConfig
    from echo2.learner_hub.hub import Hub

    cfg = HubConfig(dir=str(workdir), steps=10**6, prompts_per_step=prompts, group_size=GROUP,
                    max_new_tokens=max_new, staleness=1, task_deadline_s=3600.0, intake_workers=workers)
    hub = Hub(cfg)
    if workers:
        hub.intake_pool.wait_ready()  # a worker's start-up (~2 s) is not the result's cost
    gc.freeze()
    return hub


def _workers_cpu_s(hub: Any) -> float:
    from .attack_cpu import process_cpu_s

    return sum(process_cpu_s(pid) for pid in hub.intake_pool.pids())


async def _one(hub: Any, packed: bool, target_bytes: int, profile: str | None) -> dict[str, Any]:
    import numpy as np

    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import (
        AdmissionRequest,
        Announce,
        Completion,
        Heartbeat,
        Result,
        Task,
        task_hash,
    )

    await hub.publish()
    node = Identity.generate()
    ann = Announce(
        peer_id=node.peer_id, software_version="0.1.0", accelerator="", accelerator_count=0,
        accelerator_memory_bytes=0, cpu_model="bench", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30,
        engine="transformers", engine_version="", tokens_per_s=0.0, rollouts_per_s=1000.0, upload_MBps=0.0,
        download_MBps=0.0, price_usd_per_hour=0.0, listen_addrs=[], data_addr="", reachable=False,
        versions_held=[], max_upload_MBps=0.0,
    )
    await hub.on_admission(node.peer_id, envelope.seal(node, AdmissionRequest(peer_id=node.peer_id, join_token="",
                                                                               announce=ann)))
    hub.nodes[node.peer_id].held_version = 0
    st = hub.dispatcher.nodes[node.peer_id]
    st.claimed, st.rate = False, 1000.0  # set-up shortcut: hub-timed and fast, so one task takes every prompt
    hub.outbox.feed()
    await hub.store.call(lambda st: None)
    hb = envelope.seal(node, Heartbeat(peer_id=node.peer_id, seq=1, versions_held=[0], busy_tasks=0, queue_free=1))
    reply = await hub.on_work(node.peer_id, hb)
    task = envelope.open_envelope(reply, Task, replay=None).message
    stop_ids = set(hub.tok.stop_ids)
    plain = np.array([t for t in range(3, min(hub.tok.vocab_size, 1000)) if t not in stop_ids], dtype=np.int64)
    n_comp = len(task.prompts) * task.group_size
    # v1 costs ~11 bytes a token (the tiny model's ids < 259: 1 or 2 bytes; a float64: 9), v2 8: size by the v1 form, so both
    # messages carry the same tokens
    per = min(task.max_new_tokens, max(1, target_bytes // (11 * n_comp)))
    rng = np.random.default_rng(0)
    ids = rng.choice(plain, size=(n_comp, per))
    lps = -rng.random((n_comp, per), dtype=np.float32)
    if packed:
        from echo2.protocol.packedresult import PackedCompletion, PackedResult

        comps_p = [PackedCompletion(prompt_index=k // task.group_size, token_ids=ids[k].astype("<i4").tobytes(),
                                    logprobs=lps[k].astype("<f4").tobytes(), finish_reason="length")
                   for k in range(n_comp)]
        msg: Any = PackedResult(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0,
                                completions=comps_p, started_at=time.time(), gen_seconds=1.0, tokens=n_comp * per)
    else:
        comps = [Completion(prompt_index=k // task.group_size, token_ids=ids[k].tolist(),
                            logprobs=[float(x) for x in lps[k]], finish_reason="length") for k in range(n_comp)]
        msg = Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0,
                     completions=comps, started_at=time.time(), gen_seconds=1.0, tokens=n_comp * per)
    data = envelope.seal(node, msg, ttl_s=600.0)
    gc.collect()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    p0, w0, k0 = time.process_time(), time.perf_counter(), _workers_cpu_s(hub)
    await hub.on_result(node.peer_id, data)
    await hub.store.call(lambda st: None)  # the store's write of the payload is part of the cost
    cpu, wall, workers_cpu = time.process_time() - p0, time.perf_counter() - w0, _workers_cpu_s(hub) - k0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    # user / kernel split and page faults: with workers the hub's CPU for one large result is
    # bimodal here (0.04 or 0.17-0.33 s), the extra in the kernel; these say whether it is faults
    split = {"user_s": round(r1.ru_utime - r0.ru_utime, 3), "system_s": round(r1.ru_stime - r0.ru_stime, 3),
             "minor_faults": r1.ru_minflt - r0.ru_minflt}
    if prof is not None:
        prof.disable()
        prof.dump_stats(f"{profile}.{'v2' if packed else 'v1'}.prof")
    # parts of it, measured again alone on the same bytes: opening the envelope (signature over the
    # raw bytes, decode, schema checks) and detokenising every completion (what reward functions read)
    from echo2.protocol.wire import MAX_RESULT

    types: tuple[Any, ...] = (Result,)
    try:  # absent from the code before issue 20 item 3 (this module also runs against that code)
        from echo2.protocol.packedresult import PackedResult

        types = (PackedResult, Result)
    except ImportError:
        pass
    p0 = time.process_time()
    envelope.open_envelope(data, types, replay=None, max_size=MAX_RESULT)
    open_cpu = time.process_time() - p0
    seqs = [x.tolist() for x in ids]
    p0 = time.process_time()
    if hasattr(hub.tok, "decode_batch"):
        hub.tok.decode_batch(seqs)
    else:
        [hub.tok.decode(x) for x in seqs]
    tokenizer_cpu = time.process_time() - p0
    # what the hub runs: intake's decoder (learner_hub/detok.py's byte table when the tokenizer
    # has one) on what intake hands it (int32 views of a packed result's bytes, lists otherwise)
    hub_seqs: list[Any] = [x.astype("<i4") for x in ids] if packed else seqs
    p0 = time.process_time()
    hub.intake.decode_batch(hub_seqs)
    decode_cpu = time.process_time() - p0
    kind = getattr(hub.intake.decode_batch, "kind", "tokenizer")
    return {"message": "PackedResult (v2)" if packed else "Result (v1)", "intake_workers": hub.intake_pool.workers,
            "bytes": len(data), "completions": n_comp, "tokens": n_comp * per, "process_cpu_s": round(cpu, 3),
            "workers_cpu_s": round(workers_cpu, 3), "wall_s": round(wall, 3), "process_cpu_split": split,
            "parts_alone": {"open_envelope_cpu_s": round(open_cpu, 3), "detokenise_cpu_s": round(decode_cpu, 3),
                            "detokeniser": kind, "tokenizer_decode_batch_cpu_s": round(tokenizer_cpu, 3)}}


def run_big(megabytes: float, profile: str | None = None, workers: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """The list form and the packed form with no intake workers, then the packed form with each
    other count of ``workers`` (``--workers 0,2``): the hub process's CPU for one large result
    with its checks in the workers, and theirs."""
    import logging

    import trio

    logging.getLogger("echo2").setLevel(logging.WARNING)
    target = int(megabytes * 1024 * 1024)
    rows = []
    runs = [(False, 0), (True, 0)] + [(True, w) for w in workers if w > 0]
    for packed, n_workers in runs:
        with tempfile.TemporaryDirectory(prefix="echo2-bench-big-") as d:
            # 16 prompts x 16 completions x up to 8192 tokens: 36 MB needs ~14,000 tokens a
            # completion at 256 completions, so the task is sized to take them at <= 8192 each
            prompts = max(1, -(-target // (10 * GROUP * 8192)))
            hub = _hub(Path(d), prompts, 8192, n_workers)
            try:
                rows.append(trio.run(_one, hub, packed, target, profile))
            finally:
                hub.intake_pool.close()
                hub.store.close()
        r = rows[-1]
        print(f"{r['message']:<18} workers={r['intake_workers']} {r['bytes'] / 1e6:6.1f} MB  {r['tokens']} tokens  hub "
              f"process CPU {r['process_cpu_s']:.3f} s [user {r['process_cpu_split']['user_s']:.3f}, system {r['process_cpu_split']['system_s']:.3f}, {r['process_cpu_split']['minor_faults']} faults] (intake workers {r['workers_cpu_s']:.3f} s)  wall "
              f"{r['wall_s']:.3f} s  (alone: open_envelope "
              f"{r['parts_alone']['open_envelope_cpu_s']:.3f} s, detokenise {r['parts_alone']['detokenise_cpu_s']:.3f} s "
              f"by the {r['parts_alone']['detokeniser']}, tokenizer's decode_batch "
              f"{r['parts_alone']['tokenizer_decode_batch_cpu_s']:.3f} s)",
              flush=True)
    return {"measures": ("one large Result handed to a real Hub's on_result (1 admitted node, tiny model); process "
                         "CPU (all threads) and wall time until the store wrote it; sealing not timed"),
            "rows": rows,
            "ratio_cpu_v1_over_v2": round(rows[0]["process_cpu_s"] / max(rows[1]["process_cpu_s"], 1e-9), 2),
            # the hub process's own CPU for the packed result with N workers over that with none
            "ratio_hub_process_cpu_by_workers": {f"{r['intake_workers']}/0": round(
                r["process_cpu_s"] / max(rows[1]["process_cpu_s"], 1e-9), 3) for r in rows[2:]}}
