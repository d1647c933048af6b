"""GGUF files for tests, written with the `gguf` package the way llama.cpp's converter
writes them (architecture metadata, GGUF tensor names, Llama's q/k rows permuted per
head, Llama 3.1 rope scaling as `rope_freqs` divisors, Gemma's norms + 1, GPT-2's Conv1D
weights as (out, in)).

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16 and F32 are quantized from the checkpoint's
weights by the gguf package. It cannot quantize the K-quants, so for Q4_K, Q5_K and Q6_K
every matrix is random valid blocks (fp16 scales chosen so weights have a spread like the
tiny models'); the reference is then the file itself, dequantized by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "phi3": "phi3"}
_ARCH["gpt2"] = "gpt2"
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: within a head of d rows, row a * d/2 + j moves to 2j + a."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(rows: int, cols: int, qtype: str, seed: int) -> np.ndarray:
    """(rows, bytes) of valid K-quant blocks with sane fp16 scales."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)

    def f16(pos: int, value: float) -> None:
        raw[:, :, pos : pos + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    if qtype == "Q6_K":
        f16(208, 2e-4)
    else:  # d, dmin: the mean of d * sc * q about cancels dmin * mn
        f16(0, 8e-4 if qtype == "Q4_K" else 4e-4)
        f16(2, 6e-3)
    return raw.reshape(rows, -1)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", *, name: str | None = None) -> Path:
    """Convert the safetensors checkpoint in hf_dir to a GGUF file of `qtype` matrices."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg["model_type"]
    arch = _ARCH[mt]
    enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name or mt)
    if arch == "gpt2":
        hidden, heads, layers = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
        w.add_context_length(cfg.get("n_positions", 1024))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg.get("n_inner") or 4 * hidden)
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_layer_norm_eps(cfg.get("layer_norm_epsilon", 1e-5))
        kv = heads
    else:
        hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or hidden // heads
        w.add_context_length(cfg.get("max_position_embeddings", 2048))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
        rope = cfg.get("rope_parameters") or {}
        w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
        w.add_rope_dimension_count(hd)
        if hd != hidden // heads:
            w.add_key_length(hd)
            w.add_value_length(hd)
        if rope.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _rope_freqs(rope, hd))
    vocab = cfg["vocab_size"]
    w.add_vocab_size(vocab)
    _tokenizer(w, hf_dir, vocab, cfg)

    names = gguf.get_tensor_name_map(enum, layers)
    state = load_file(str(hf_dir / "model.safetensors"))
    for i, (hf_name, t) in enumerate(sorted(state.items())):
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        a = t.float().numpy()
        if arch == "gpt2" and hf_name.endswith(_CONV1D):
            a = np.ascontiguousarray(a.T)
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            a = _permute(a, heads if ".q_proj." in hf_name else kv)
        if arch == "gemma" and hf_name.endswith("norm.weight"):
            a = a + 1
        g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert g is not None, hf_name
        _add(w, g, np.ascontiguousarray(a, dtype=np.float32), qtype, seed=i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _rope_freqs(rope: dict, hd: int) -> np.ndarray:
    """llama.cpp's per-frequency divisors for Llama 3.1 rope scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, hd, 2):
        wavelen = 2 * np.pi * rope["rope_theta"] ** (i / hd)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add(w, name: str, a: np.ndarray, qtype: str, seed: int) -> None:
    import gguf

    kind = qtype if a.ndim == 2 else "F32"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    if a.shape[-1] % block:
        kind = "Q8_0" if a.shape[-1] % 32 == 0 else "F32"  # as llama.cpp falls back
    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, a)
    elif kind in K_QUANTS:
        w.add_tensor(name, random_blocks(*a.shape, kind, seed), raw_dtype=qt)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)


def _tokenizer(w, hf_dir: Path, vocab: int, cfg: dict) -> None:
    """The checkpoint's byte-level BPE tokenizer.json as a "gpt2" GGUF vocabulary, or a
    placeholder vocabulary of `vocab` tokens when it ships none."""
    path = hf_dir / "tokenizer.json"
    if path.exists():
        tok = json.loads(path.read_text())
        ids = dict(tok["model"]["vocab"])
        ids |= {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        tokens = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
        special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    else:
        tokens, merges, special = [f"<t{i}>" for i in range(vocab)], [], set()
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    if merges:
        w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])


def reference_logits(path: Path, ids: torch.Tensor, mask: torch.Tensor):
    """transformers' own GGUF load of `path` (every weight dequantized in one process): (model, logits)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return model, out.logits
