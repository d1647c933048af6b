"""Write the small default model that ships inside shardwise: src/shardwise/assets/default/.

    .venv/bin/python scripts/make_default_model.py            # writes the shipped asset
    .venv/bin/python scripts/make_default_model.py --out DIR  # writes the same files elsewhere

A Llama-shaped model with seeded RANDOM weights (no training) and a real byte-level BPE
tokenizer, so that `shardwise generate` runs with no download. It produces nonsense.

NOTE: the shipped weights are now the trained ones of scripts/train_default_model.py (same
shape and tokenizer); this script remains the tokenizer's recipe. Writing the asset with it
replaces the trained model by a random one: use --out DIR for anything but that.

Deterministic: re-running writes byte-identical files (same torch, transformers and
tokenizers versions). The tokenizer is trained on the English text of the CPython
standard library's `pydoc_data/topics.py` (the Python documentation's language
reference topics, PSF License); its sha256 is pinned below, and the script refuses a
different text rather than silently writing a different tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "src" / "shardwise" / "assets" / "default"

SEED = 0
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>"]  # ids 0 and 1
INITIALIZER_RANGE = 0.2
PROBE_PROMPT = "The quick brown fox"
PROBE_NEW_TOKENS = 32
MIN_DISTINCT = 8
MAX_MODEL_BYTES = 12 * 1024 * 1024

# sha256 of the training text as built by corpus() from CPython 3.11.7's pydoc_data/topics.py.
CORPUS_SHA256 = "edf9b16fef54db7006c721146d704e09a569cccc0e70af0bbe0a036638530d89"

MODEL_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    max_position_embeddings=512,
)


def corpus() -> tuple[list[str], str]:
    """The training text as paragraphs (topics in sorted order), and the source file's path."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    paragraphs = [p.strip("\n") for p in text.split("\n\n")]
    return [p for p in paragraphs if p.strip()], topics.__file__


def train_tokenizer(paragraphs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    return tok


def greedy(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, one full forward each (no stop token: the check wants all n)."""
    out: list[int] = []
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=seq).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    paragraphs, source = corpus()
    text_sha = hashlib.sha256("\n\n".join(paragraphs).encode()).hexdigest()
    if text_sha != CORPUS_SHA256:
        print(
            f"error: the training text from {source} has sha256 {text_sha}, expected {CORPUS_SHA256} "
            f"(CPython 3.11.7's pydoc_data/topics.py); another Python version would write a different "
            f"tokenizer. Run with CPython 3.11.7, or update CORPUS_SHA256 deliberately.",
            file=sys.stderr,
        )
        return 1

    tok = train_tokenizer(paragraphs)
    vocab = tok.get_vocab_size()
    special_ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if special_ids != [0, 1]:
        raise AssertionError(f"special tokens got ids {special_ids}, expected [0, 1]")
    tok.save(str(out / "tokenizer.json"))

    config = LlamaConfig(
        vocab_size=vocab,
        **MODEL_SHAPE,
        tie_word_embeddings=False,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=special_ids[0],
        eos_token_id=special_ids[1],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)

    model_bytes = (out / "model.safetensors").stat().st_size
    if model_bytes > MAX_MODEL_BYTES:
        raise AssertionError(f"model.safetensors is {model_bytes} bytes, over {MAX_MODEL_BYTES}")

    prompt = tok.encode(PROBE_PROMPT).ids
    gen = greedy(model, prompt, PROBE_NEW_TOKENS)
    distinct = len(set(gen))
    if distinct < MIN_DISTINCT:
        raise AssertionError(f"greedy output has {distinct} distinct ids (< {MIN_DISTINCT}): {gen}")

    files = sorted(p.name for p in out.iterdir() if p.name != "README.md")
    hashes = "\n".join(f"    {sha256(out / f)}  {f}" for f in files)
    (out / "README.md").write_text(
        README.format(
            vocab=vocab,
            seed=SEED,
            init=INITIALIZER_RANGE,
            n_params=n_params,
            mb=model_bytes / 1e6,
            source_name="pydoc_data/topics.py",
            source=source,
            text_sha=text_sha,
            n_paragraphs=len(paragraphs),
            n_chars=sum(len(p) for p in paragraphs),
            torch=torch.__version__,
            transformers=transformers.__version__,
            tokenizers=tokenizers.__version__,
            python=sys.version.split()[0],
            prompt=PROBE_PROMPT,
            prompt_ids=prompt,
            new=PROBE_NEW_TOKENS,
            gen=gen,
            distinct=distinct,
            hashes=hashes,
            **MODEL_SHAPE,
        )
    )
    print(f"wrote {out}: {n_params:,} parameters, model.safetensors {model_bytes / 1e6:.2f} MB, vocab {vocab}")
    print(f"tokenizer trained on {source} ({len(paragraphs)} paragraphs, sha256 {text_sha[:12]}...)")
    print(f"greedy {PROBE_NEW_TOKENS} tokens from {PROBE_PROMPT!r}: {distinct} distinct ids: {gen}")
    return 0


README = """\
# shardwise default model (seeded random weights)

This is the model `shardwise generate` uses when no `--model` is given, so that the
command runs with no download. **Its weights are random, not trained: it writes
nonsense.** It exists to exercise loading, sharding and generation end to end; a trained
model will replace it.

## What is here

| file | what |
|---|---|
| `config.json` | `LlamaConfig` (`model_type: llama`), written by transformers' `save_pretrained` |
| `model.safetensors` | fp32 weights, {n_params:,} parameters ({mb:.2f} MB), written by `LlamaForCausalLM(config).save_pretrained` |
| `generation_config.json` | written by transformers alongside the weights |
| `tokenizer.json` | byte-level BPE (`tokenizers` library), {vocab} tokens |
| `README.md` | this file |

Model: Llama architecture, hidden_size={hidden_size}, num_hidden_layers={num_hidden_layers},
num_attention_heads={num_attention_heads}, num_key_value_heads={num_key_value_heads} (grouped-query
attention), intermediate_size={intermediate_size}, max_position_embeddings={max_position_embeddings},
vocab_size={vocab}, untied input embeddings and LM head. Valid tensor-parallel sizes: 1, 2, 4, 8
(8 replicates each KV head on 2 ranks).

Special tokens: `<|bos|>` = 0 (bos_token_id), `<|eos|>` = 1 (eos_token_id). The tokenizer
adds neither by itself; no padding token is defined.

## How it was made

    .venv/bin/python scripts/make_default_model.py

from the repository root. The script is deterministic: re-running it with the same
versions writes byte-identical files. Made with Python {python}, torch {torch},
transformers {transformers}, tokenizers {tokenizers}.

- Weights: `torch.manual_seed({seed})`, then `LlamaForCausalLM(config)` with
  `initializer_range={init}` (normal init of every linear and embedding weight; RMSNorm
  weights 1). The range is wider than the usual 0.02 so that greedy output is not one
  repeated token: greedy {new} tokens from the prompt {prompt!r} (ids {prompt_ids}) give
  {distinct} distinct ids: {gen}.
- Tokenizer: `tokenizers` BPE with the ByteLevel pre-tokenizer (no prefix space) and
  ByteLevel decoder, so any text round-trips through encode and decode; `BpeTrainer` with
  vocab_size={vocab}, min_frequency=2, the 256-byte initial alphabet and the two special
  tokens first.

## The tokenizer's training text and its licence

The text is `{source_name}` from the CPython {python} standard library (installed with
every CPython; here at `{source}`).
It is generated from the Python documentation (the language reference topics that
`help()` shows): English prose with Python examples. The script joins the `topics` dict's
values in sorted key order and trains on its {n_paragraphs} non-empty paragraphs
({n_chars:,} characters), sha256 of the joined text `{text_sha}` (the script refuses a
different text).

Licence: the Python documentation is licensed under the PSF License Agreement (Python
Software Foundation License Version 2, see `LICENSE.txt` in the CPython distribution);
since Python 3.8.6 the code examples in it are also under the Zero-Clause BSD licence.
The tokenizer contains only merge rules and token strings derived from this text, not the
text itself. The random weights carry no third-party content.

## Checksums (sha256)

{hashes}
"""


if __name__ == "__main__":
    sys.exit(main())
