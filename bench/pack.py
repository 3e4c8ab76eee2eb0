"""``echo2 bench pack``: policy packing of a realistic optimizer step.

Builds a random Llama-shaped model of about ``--params`` parameters (fp32 master weights), runs
``--warmup`` AdamW steps on random tokens, takes the bf16 state dict (version 1), runs the measured
AdamW step at ``--lr`` and takes the bf16 state dict again (version 2). Packs version 1 full,
version 2 as delta against version 1 (timed: flatten + chunk + XOR + zstd + hashes, one process),
version 2 as full (for the ratio), then decodes every chunk of version 2 with its parent and
assembles the state dict (timed) and checks it is bit-identical to version 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=100e6, help="approximate model size (default 100e6)")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate of the measured step (default 1e-6)")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="chunk size (default: packing's)")
    parser.add_argument("--warmup", type=int, default=3, help="AdamW steps before version 1 (default 3)")
    parser.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument("--no-split", action="store_true", help="do not split bf16 byte planes")
    parser.add_argument("--repeat", type=int, default=3, help="timed encode/decode runs; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="the LoRA case: bytes per adapter version of a rank-R adapter vs the full model's (bench/pack_lora.py)")
    parser.add_argument("--model", default="tiny", help="with --lora: tiny | smollm2 | a local model directory (default tiny)")


def _llama_config(n_params: int) -> Any:
    from transformers import LlamaConfig

    vocab = 32000 if n_params >= 20_000_000 else 4096
    best: tuple[int, int, int] | None = None
    for h in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096):
        heads = max(1, h // 64)
        kv = max(1, heads // 4)
        inter = max(64, round(h * 8 / 3 / 64) * 64)
        per_layer = 2 * h * h + 2 * h * (kv * h // heads) + 3 * h * inter + 2 * h
        layers = round((n_params - 2 * vocab * h - h) / per_layer)
        if layers >= max(2, h // 128) or best is None:
            best = (h, max(2, layers), inter)
    assert best is not None
    h, layers, inter = best
    heads = max(1, h // 64)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _train(cfg: Any, lr: float, warmup: int) -> tuple[dict[str, Any], dict[str, Any], int, float]:
    """bf16 state dicts before and after the measured AdamW step (fp32 master weights)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        ids = torch.randint(0, cfg.vocab_size, (2, 32))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def bf16_state() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sd1 = bf16_state()
    step()
    sd2 = bf16_state()
    return sd1, sd2, n_params, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    if args.lora > 0:
        from .pack_lora import run_lora

        return run_lora(args)
    import torch

    from echo2.models import statedict
    from echo2.protocol import packing

    torch.manual_seed(args.seed)
    chunk_size = args.chunk_bytes or packing.DEFAULT_CHUNK_SIZE
    split = not args.no_split
    cfg = _llama_config(int(args.params))
    sd1, sd2, n_params, train_s = _train(cfg, args.lr, args.warmup)
    gc.collect()

    changed = sum(int((sd1[k].view(torch.int16) != sd2[k].view(torch.int16)).sum()) for k in sd1)
    common: dict[str, Any] = {"model_config": cfg.to_json_string(), "artifacts": {}, "chunk_size": chunk_size,
                              "level": args.level, "bf16_split": split}
    v1 = statedict.pack_version(sd1, version=1, parent=None, **common)
    encode_s = math.inf
    for _ in range(max(1, args.repeat)):
        t = time.perf_counter()
        v2 = statedict.pack_version(sd2, version=2, parent=v1, **common)
        encode_s = min(encode_s, time.perf_counter() - t)
    t = time.perf_counter()
    v2_full = statedict.pack_version(sd2, version=2, parent=None, **common)
    full_encode_s = time.perf_counter() - t
    full_bytes = v2_full.encoded_bytes
    del v2_full
    gc.collect()

    man = v2.manifest
    raw_bytes = man.total_bytes
    decode_s = math.inf
    for _ in range(max(1, args.repeat)):
        out = {}
        gc.collect()
        t = time.perf_counter()
        raws = [
            packing.decode_chunk(
                c, enc, v1.raw_chunks[c.index] if c.encoding == "delta" else None, bf16_split=man.bf16_split
            )
            for c, enc in zip(man.chunks, v2.encoded, strict=True)
        ]
        out = statedict.assemble(man, raws, verify=False)
        decode_s = min(decode_s, time.perf_counter() - t)
        del raws
    equal = set(out) == set(sd2) and all(
        out[k].dtype == sd2[k].dtype
        and out[k].shape == sd2[k].shape
        and torch.equal(out[k].reshape(-1).view(torch.uint8), sd2[k].reshape(-1).view(torch.uint8))
        for k in sd2
    )
    delta_bytes = v2.encoded_bytes
    n_values = raw_bytes // 2
    result = {
        "params": n_params,
        "raw_bytes": raw_bytes,
        "full_zstd_bytes": full_bytes,
        "delta_zstd_bytes": delta_bytes,
        "delta_ratio": delta_bytes / raw_bytes,
        "full_ratio": full_bytes / raw_bytes,
        "encode_MBps": raw_bytes / encode_s / 1e6,
        "decode_MBps": raw_bytes / decode_s / 1e6,
        "full_encode_MBps": raw_bytes / full_encode_s / 1e6,
        "chunk_bytes": chunk_size,
        "chunks": len(man.chunks),
        "lr": args.lr,
        "bf16_split": split,
        "level": args.level,
        "changed_fraction": changed / max(1, n_values),
        "delta_chunks": sum(c.encoding == "delta" for c in man.chunks),
        "train_seconds": train_s,
        "repeat": args.repeat,
        "equal": equal,
    }
    rows = [
        ("params", f"{n_params / 1e6:.1f} M ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})"),
        ("raw bytes", f"{raw_bytes / 1e6:.1f} MB in {len(man.chunks)} chunks of {chunk_size / 2**20:g} MiB"),
        ("bf16 values changed", f"{100 * result['changed_fraction']:.2f} % (lr {args.lr:g})"),
        ("full (zstd)", f"{full_bytes / 1e6:.1f} MB  ratio {result['full_ratio']:.4f}  "
                        f"({result['full_encode_MBps']:.0f} MB/s)"),
        ("delta (XOR+zstd)", f"{delta_bytes / 1e6:.2f} MB  ratio {result['delta_ratio']:.4f}  "
                             f"({raw_bytes / max(1, delta_bytes):.1f}x smaller)"),
        ("encode v2 (delta)", f"{result['encode_MBps']:.0f} MB/s"),
        ("decode+assemble v2", f"{result['decode_MBps']:.0f} MB/s"),
        ("bit-identical", str(equal)),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"echo2 bench pack (bf16 split {'on' if split else 'off'}, zstd level {args.level})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0 if equal else 1
