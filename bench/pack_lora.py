"""``echo2 bench pack --lora R``: the bytes a LoRA policy publishes per version.

The model (``--model tiny|smollm2|PATH``) is wrapped with peft (rank R, alpha 2R, the hub's
default target modules), published as the hub publishes it (base + adapter under publication
names, bf16, ``echo2.models.lora``): version 0 in full, then ``--warmup`` AdamW steps on random
tokens at ``--lr`` over the adapter only, version 1 as a delta against version 0 (the first
adapter version: the whole adapter changed since the zero-initialised lora_B), the measured step,
version 2 as a delta against version 1, and version 3 packed as a snapshot version
(``full_every`` = 3) with unchanged chunks kept as deltas, as the hub does for LoRA. Each is
compared with version 0's encoded bytes (what a full fine-tune's snapshot costs); version 2 is
decoded against version 1 and checked bit-identical.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def _model(name: str) -> tuple[Any, str]:
    from echo2.models.policy import load_policy

    model, mc, _arts = load_policy(name, tiny_hidden=128, tiny_layers=2)
    return model, mc


def run_lora(args: argparse.Namespace) -> int:
    import torch

    from echo2.learner_hub.config import LoraSpec
    from echo2.models import lora, statedict
    from echo2.protocol import packing

    torch.manual_seed(args.seed)
    model, mc = _model(args.model)
    targets = LoraSpec().target_modules
    peft_model = lora.wrap(model, r=args.lora, alpha=2 * args.lora, target_modules=targets)
    inner = peft_model.get_base_model()
    inner.train()
    params = [p for p in inner.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in inner.parameters())
    n_adapter = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr)
    vocab = int(inner.config.vocab_size)

    def step() -> None:
        ids = torch.randint(0, vocab, (2, 32))
        inner(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def published() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in lora.published_names(inner.state_dict()).items()}

    chunk_size = args.chunk_bytes or packing.DEFAULT_CHUNK_SIZE
    common: dict[str, Any] = {"model_config": mc, "artifacts": {lora.ADAPTER_CONFIG: lora.adapter_config_json(peft_model)},
                              "chunk_size": chunk_size, "level": args.level, "bf16_split": not args.no_split,
                              "full_every": 3, "keep_unchanged": True}
    t = time.perf_counter()
    v0 = statedict.pack_version(published(), version=0, parent=None, **common)
    v0_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(max(0, args.warmup)):
        step()
    train_s = time.perf_counter() - t
    v1 = statedict.pack_version(published(), version=1, parent=v0, **common)
    step()
    sd2 = published()
    t = time.perf_counter()
    v2 = statedict.pack_version(sd2, version=2, parent=v1, **common)
    v2_s = time.perf_counter() - t
    step()
    v3 = statedict.pack_version(published(), version=3, parent=v2, **common)

    man = v2.manifest
    raws = [packing.decode_chunk(c, enc, v1.raw_chunks[c.index] if c.encoding == "delta" else None,
                                 bf16_split=man.bf16_split) for c, enc in zip(man.chunks, v2.encoded, strict=True)]
    out = statedict.assemble(man, raws, verify=False)
    equal = set(out) == set(sd2) and all(torch.equal(out[k].view(torch.uint8), sd2[k].view(torch.uint8)) for k in sd2)
    adapter_raw = sum(e.nbytes for e in man.tensors if e.name.startswith(lora.ADAPTER_PREFIX))
    v0_hashes = {c.raw_hash for c in v0.manifest.chunks}

    def figures(p: Any) -> dict[str, Any]:
        return {"encoded_bytes": p.encoded_bytes, "ratio_to_full": p.encoded_bytes / v0.encoded_bytes,
                "chunks_new": sum(c.raw_hash not in v0_hashes for c in p.manifest.chunks),
                "chunks": len(p.manifest.chunks)}

    result = {
        "model": args.model, "params": n_params, "lora_r": args.lora, "lora_alpha": 2 * args.lora,
        "target_modules": targets, "adapter_params": n_adapter, "adapter_raw_bytes": adapter_raw,
        "raw_bytes": man.total_bytes, "full_bytes": v0.encoded_bytes, "full_encode_s": v0_s,
        "v1": figures(v1), "v2": figures(v2), "v3_snapshot": figures(v3), "v2_encode_s": v2_s,
        "lr": args.lr, "warmup": args.warmup, "train_seconds": train_s, "chunk_bytes": chunk_size, "equal": equal,
    }
    result["max_ratio"] = max(result[k]["ratio_to_full"] for k in ("v1", "v2", "v3_snapshot"))
    print(f"echo2 bench pack --lora {args.lora} ({args.model}: {n_params / 1e6:.1f} M params, "
          f"{n_adapter / 1e6:.3f} M adapter params, bf16)")
    print(f"  version 0 (full)        {v0.encoded_bytes / 1e6:9.3f} MB  of {man.total_bytes / 1e6:.1f} MB raw")
    for k, label in (("v1", "version 1 (delta)"), ("v2", "version 2 (delta)"), ("v3_snapshot", "version 3 (snapshot)")):
        f = result[k]
        print(f"  {label:<23} {f['encoded_bytes'] / 1e6:9.3f} MB  ratio {f['ratio_to_full']:.4f}  "
              f"({f['chunks_new']} of {f['chunks']} chunks not in version 0)")
    print(f"  adapter raw bytes       {adapter_raw / 1e6:9.3f} MB")
    print(f"  bit-identical           {equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0 if equal else 1
