"""Train the default model that ships in src/shardwise/assets/default, with shardwise itself.

    .venv/bin/python scripts/train_default_model.py            # trains (about 7 min on 2 CPU cores), installs
    .venv/bin/python scripts/train_default_model.py --run DIR  # installs from a finished run in DIR

It runs exactly these commands, then installs the export and writes the asset's README:

    shardwise train --config configs/austen-tp2.toml --backend gloo --out DIR --no-progress
    shardwise checkpoint export-hf DIR/checkpoints DIR/hf

The model keeps the shape, tokenizer and special tokens of the seeded random model it
replaces (scripts/make_default_model.py still makes that tokenizer); only the weights,
config.json, generation_config.json and README.md change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "src" / "shardwise" / "assets" / "default"
CONFIG = ROOT / "configs" / "austen-tp2.toml"
PROMPT = "It is a truth universally acknowledged"
DEFAULT_PROMPT = "Tensor parallelism splits each layer"  # shardwise generate's default prompt
SAMPLING = ("--temperature", "0.7", "--top-k", "40")


def _shardwise(*args: str) -> str:
    print("$ shardwise " + " ".join(args), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "shardwise", *args], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    print(out.stdout, flush=True)
    return out.stdout


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="a finished run directory (skip training)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "default-model", help="run directory to train into")
    args = parser.parse_args()
    run = args.run or args.out
    if args.run is None:
        shutil.rmtree(run, ignore_errors=True)
        _shardwise("train", "--config", str(CONFIG), "--backend", "gloo", "--out", str(run), "--no-progress")
    hf = run / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    _shardwise("checkpoint", "export-hf", str(run / "checkpoints"), str(hf))
    if _sha(hf / "tokenizer.json") != _sha(ASSET / "tokenizer.json"):
        sys.exit("the run used a different tokenizer than the shipped one")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(hf / name, ASSET / name)
    from shardwise.checkpoint import CheckpointReader

    manifest = CheckpointReader(run / "checkpoints").manifest
    history = manifest.extra["history"]
    gen = ("generate", "--tp", "2", "--backend", "gloo", "--json")
    greedy = json.loads(_shardwise(*gen))["text"][0]  # what `make demo` shows: the default prompt, greedy
    sampled = [
        json.loads(_shardwise(*gen, "--prompt", PROMPT, "--max-new-tokens", "48", *SAMPLING, "--seed", seed))["text"][0]
        for seed in ("1", "3")
    ]
    (ASSET / "README.md").write_text(_readme(manifest, history, greedy, sampled))
    print(f"installed into {ASSET}")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _readme(manifest, history, greedy: str, sampled: list[str]) -> str:
    import tokenizers
    import torch

    c = manifest.model
    params = sum(math.prod(e.global_shape) for k, e in manifest.tensors.items() if k.startswith("param/"))
    checksums = "\n".join(
        f"    {_sha(ASSET / n)}  {n}"
        for n in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
    )
    first, last = history[0][1], history[-1][1]
    samples = "\n\n".join(_indent(PROMPT + text) for text in sampled)
    return f"""# shardwise default model (trained on three Jane Austen novels)

The model `shardwise generate` uses when no `--model` is given. A small Llama-shaped model
trained with `shardwise train` at tp=2 on the corpus that ships in the repository
(`data/austen/`): it writes recognisable, if wandering, Austen-flavoured English.

`shardwise generate --tp 2` (greedy, 32 tokens after the default prompt; the same tokens as tp=1):

{_indent(DEFAULT_PROMPT + greedy)}

`shardwise generate --tp 2 --prompt "{PROMPT}" --max-new-tokens 48 --temperature 0.7 --top-k 40 --seed 1` (and `--seed 3`):

{samples}

## What is here

| file | what |
|---|---|
| `config.json` | `LlamaConfig` (`model_type: llama`), written by `shardwise checkpoint export-hf` |
| `model.safetensors` | fp32 weights, {params:,} parameters |
| `generation_config.json` | bos and eos token ids |
| `tokenizer.json` | byte-level BPE (`tokenizers` library), 512 tokens, made by `scripts/make_default_model.py` |
| `README.md` | this file |

Model: Llama architecture, hidden_size={c["hidden_size"]}, num_hidden_layers={c["num_layers"]},
num_attention_heads={c["num_heads"]}, num_key_value_heads={c["num_kv_heads"]} (grouped-query attention),
intermediate_size={c["intermediate_size"]}, max_position_embeddings={c["max_positions"]},
vocab_size={c["vocab_size"]}, untied input embeddings and LM head. Valid tensor-parallel sizes: 1, 2, 4, 8.
Special tokens: `<|bos|>` = 0, `<|eos|>` = 1; the training text contains neither, so the
model practically never stops by itself.

## How it was made

    .venv/bin/python scripts/train_default_model.py

from the repository root, which runs

    shardwise train --config configs/austen-tp2.toml --backend gloo --out runs/default-model --no-progress
    shardwise checkpoint export-hf runs/default-model/checkpoints runs/default-model/hf

and copies the export here. The run is deterministic: training twice on this machine gave
byte-identical weights (the checksum below). Training: {manifest.step} steps of AdamW at tp=2 (gloo, one
thread per rank), global batch 16 sequences of 128 tokens (2,048 tokens a step, about
{manifest.step * 2048 / 1e6:.1f}M tokens in all, a little over two passes over the corpus), lr 3e-3 with
50 warmup steps and cosine decay to 3e-4, weight decay 0.1, gradient clipping at 1.0;
initialisation normal(0, 0.02) from seed 0. Training loss (mean cross-entropy per token):
{first:.3f} at step 1, {last:.3f} at step {manifest.step}. About 0.4 s per step on 2 CPU cores.
Made with Python {sys.version.split()[0]}, torch {torch.__version__}, tokenizers {tokenizers.__version__}.

## The training text and its licence

`data/austen/austen.txt`: *Pride and Prejudice* (1813), *Persuasion* (1818) and *Northanger
Abbey* (1818) by Jane Austen, public domain worldwide, taken offline from Debian's
`r-cran-janeaustenr` package (MIT-licensed R package carrying the texts); see
`data/austen/README.md` for the source, the extraction command and the licence.

The tokenizer was trained on `pydoc_data/topics.py` from the CPython 3.11.7 standard library
(the Python documentation's language reference topics; PSF License Agreement, and since
Python 3.8.6 the Zero-Clause BSD licence for the code examples); it contains only merge rules
and token strings derived from that text.

## Checksums (sha256)

{checksums}
"""


if __name__ == "__main__":
    main()
