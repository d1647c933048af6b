"""A Hugging Face checkpoint written as GGUF (F32 or Q8_0), for timing llama.cpp on the same
weights shardwise runs (benchmarks/bench_quant.py): the command line of the one GGUF writer,
tests/gguf_files.py (what llama.cpp's convert_hf_to_gguf.py does, for the families shardwise
runs, written with the `gguf` package's GGUFWriter).

    .venv/bin/python benchmarks/gguf_export.py /tmp/smol-shape /tmp/smol-shape.q8_0.gguf --type q8_0

A checkpoint without a tokenizer.json gets a placeholder SentencePiece-style vocabulary
(<unk>, <s>, </s>, the 256 byte tokens, then <tN>): the benchmarks feed token ids.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gguf_files import write_gguf  # noqa: E402

__all__ = ["export_gguf", "ensure_gguf"]

TYPES = ("f32", "q8_0")


def export_gguf(src: Path, dst: Path, kind: str) -> Path:
    """Write `src` (a Hugging Face directory of safetensors) to `dst` as GGUF of `kind` ("f32" or "q8_0")."""
    return write_gguf(src, dst, kind.upper(), name=src.name)


def ensure_gguf(src: Path, kind: str, root: Path) -> Path:
    """`root`/<src name>.<kind>.gguf, written once (rewritten when the checkpoint is newer)."""
    dst = root / f"{src.name}.{kind}.gguf"
    newest = max(f.stat().st_mtime for f in src.glob("*.safetensors"))
    if not dst.exists() or dst.stat().st_mtime < newest:
        root.mkdir(parents=True, exist_ok=True)
        export_gguf(src, dst, kind)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a Hugging Face checkpoint directory")
    ap.add_argument("dst", type=Path, help="the .gguf to write")
    ap.add_argument("--type", choices=TYPES, default="f32")
    args = ap.parse_args()
    print(export_gguf(args.src, args.dst, args.type))


if __name__ == "__main__":
    main()
