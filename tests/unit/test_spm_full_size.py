"""A SentencePiece vocabulary of Gemma 3's size (262,144 pieces) in a `gemma3` GGUF file: the
tokenizer shardwise builds from it (shardwise.gguf.tokenizer, through transformers' GGUF
conversion) encodes like SentencePiece's BPE as llama.cpp runs it, written out here as the
reference: start from the text's characters (spaces as "\u2581", no space prefix), merge the
adjacent pair whose union is the best-scored piece (leftmost on ties) until none is in the
vocabulary, and spell what is left outside it as byte tokens. BOS first, control tokens whole.

The vocabulary: 3 specials, 2 control tokens, the 256 byte tokens, an alphabet (ASCII, Latin-1,
Greek, Cyrillic, 2,000 CJK characters), BPE merges learned from real text, runs of
"\u2581" and newlines, then pieces each made of two earlier ones (every piece a merge, as
SentencePiece's BPE is), scored minus their rank. Full tier: building the tokenizer takes
seconds (the test prints how long).
"""

from __future__ import annotations

import json
import random
import time

import pytest

pytestmark = pytest.mark.full

SIZE = 262_144
BOS, BYTE0 = 2, 7
"""<bos>'s id and <0x00>'s."""
CONTROL = ("<start_of_turn>", "<end_of_turn>")
TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families.",
    "Tensor parallelism splits each layer's matrices across ranks; every rank reads its own blocks of the file.",
    "Der schnelle braune Fuchs springt \u00fcber den faulen Hund. \u0391\u03b8\u03ae\u03bd\u03b1 \u041c\u043e\u0441\u043a\u0432\u0430",
]
SAMPLES = [
    "It is a truth universally acknowledged",
    "every rank reads its own blocks",
    " a leading space",
    "two  spaces,   three, and\ttabs\t\tand a trailing one ",
    "lines\n\nand\n\n\n\nmore lines\n",
    "caf\u00e9, na\u00efve, \u00fcber, \u0391\u03b8\u03ae\u03bd\u03b1, \u041c\u043e\u0441\u043a\u0432\u0430",
    "\u4e2d\u6587\u6587\u672c and \u65e5\u672c\u8a9e",
    "emoji \U0001f642\U0001f680 and \u2603 outside the alphabet: bytes",
    "\x00\x01 raw control bytes \x7f",
    "<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\n",
    "",
]


def gemma_sized_vocabulary(size: int = SIZE, seed: int = 0) -> list[tuple[str, float, int]]:
    """(piece, score, token type) x size, as the module docstring describes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    head = [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 2), ("<mask>", 0.0, 4)]
    head += [(t, 0.0, 3) for t in CONTROL] + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]  # Gemma's order
    chars = [chr(c) for c in range(33, 127)] + ["\u2581", "\n", "\t"]
    chars += [chr(c) for c in range(0xC0, 0x180)] + [chr(c) for c in range(0x391, 0x3CA)]
    chars += [chr(c) for c in range(0x410, 0x450)] + [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]
    pieces: list[str] = list(dict.fromkeys(chars))
    seen = set(pieces)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=3000, show_progress=False))
    for merge in json.loads(tok.to_str())["model"]["merges"]:  # in the order learned
        a, b = merge if isinstance(merge, list) else merge.split(" ")
        if a in seen and b in seen and a + b not in seen:
            pieces.append(a + b)
            seen.add(a + b)
    for run in ("\u2581", "\n", "\t"):
        for k in range(2, 32 if run == "\u2581" else 9):
            if run * k not in seen:
                pieces.append(run * k)
                seen.add(run * k)
    rng = random.Random(seed)
    while len(head) + len(pieces) < size:
        n = len(pieces)
        a, b = pieces[int(n * rng.random() ** 2)], pieces[int(n * rng.random() ** 2)]  # favour early pieces
        if a + b not in seen and len(a + b) <= 16:
            pieces.append(a + b)
            seen.add(a + b)
    return head + [(p, -float(i), 1) for i, p in enumerate(pieces)]


def spm_encode(text: str, vocab: list[tuple[str, float, int]]) -> list[int]:
    """SentencePiece BPE as llama.cpp runs it (see the module docstring): BOS (2), then each
    stretch between control tokens merged by score."""
    ids = {p: i for i, (p, _, _) in enumerate(vocab)}
    scores = {p: s for p, s, k in vocab if k == 1}
    out = [BOS]
    parts, rest = [], text
    while rest:
        hits = [(rest.find(c), c) for c in CONTROL if c in rest]
        if not hits:
            parts.append(rest)
            break
        at, c = min(hits)
        parts += [rest[:at], c]
        rest = rest[at + len(c) :]
    for part in parts:
        if part in CONTROL:
            out.append(ids[part])
            continue
        symbols = list(part.replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                s = scores.get(symbols[i] + symbols[i + 1])
                if s is not None and (best is None or s > best[0]):
                    best = (s, i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out += [ids[s]] if s in scores else [BYTE0 + b for b in s.encode("utf-8")]
    return out


def write_vocabulary_file(path, vocab) -> None:
    """A gemma3 GGUF file holding only the vocabulary (the tokenizer reads nothing else), with
    Gemma's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3; BOS added, no space prefix."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _, _ in vocab])
    w.add_token_scores([s for _, s, _ in vocab])
    w.add_token_types([k for _, _, k in vocab])
    for add, tid in ((w.add_pad_token_id, 0), (w.add_eos_token_id, 1), (w.add_bos_token_id, 2)):
        add(tid)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma_sized_vocabulary_tokenizes_like_sentencepiece(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from shardwise.gguf import gguf_tokenizer

    vocab = gemma_sized_vocabulary()
    assert len(vocab) == SIZE and len({p for p, _, _ in vocab}) == SIZE
    path = tmp_path / "gemma3-vocab.gguf"
    write_vocabulary_file(path, vocab)
    t0 = time.perf_counter()
    tok = gguf_tokenizer(path)
    built = time.perf_counter() - t0
    print(f"built the tokenizer of {SIZE} pieces in {built:.1f} s")
    assert tok.get_vocab_size() == SIZE
    failures, used_bytes, merged = [], False, 0
    for text in SAMPLES:
        want, got = spm_encode(text, vocab), tok.encode(text).ids
        if got != want:
            failures.append(f"{text!r}: {got} != SentencePiece {want}")
        used_bytes |= any(BYTE0 <= i < BYTE0 + 256 for i in want)
        merged = max(merged, max((len(vocab[i][0]) for i in want if i >= BYTE0 + 256), default=0))
    assert not failures, "\n".join(failures)
    assert used_bytes, "no sample fell back to byte tokens"
    assert merged >= 4, "no sample used a long merged piece"
