"""GGUF files for tests and benchmarks (benchmarks/gguf_export.py is this writer's command
line), written with the `gguf` package the way llama.cpp's converter writes them
(architecture metadata, GGUF tensor names, Llama's q/k rows permuted per head, Llama 3.1
rope scaling as `rope_freqs` divisors, Gemma's norms + 1, GPT-2's Conv1D weights as
(out, in)).

The vocabulary: the checkpoint's byte-level BPE tokenizer.json as a "gpt2" vocabulary; a
SentencePiece-style ("llama") one when given (spm_vocabulary trains a small one); else a
placeholder SentencePiece vocabulary (<unk>, <s>, </s>, the 256 byte tokens, then <tN>) that
llama.cpp accepts, for files fed token ids.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16 and F32 are quantized from the checkpoint's
weights by the gguf package. It cannot quantize the K-quants, so for Q4_K, Q5_K and Q6_K
every matrix is random valid blocks (fp16 scales chosen so weights have a spread like the
tiny models'); the reference is then the file itself, dequantized by transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "phi3": "phi3"}
_ARCH |= {"gemma3_text": "gemma3", "gpt2": "gpt2", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
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


def write_gguf(
    hf_dir: Path, out: Path, qtype: str = "F32", *, name: str | None = None, spm: list | None = None
) -> Path:
    """Convert the safetensors checkpoint in hf_dir (one file or several) to a GGUF file of
    `qtype` matrices, written next to `out` and renamed over it. spm: a SentencePiece-style
    vocabulary [(piece, score, token type)] (spm_vocabulary) to write instead of the
    checkpoint's."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg["model_type"]
    arch = _ARCH[mt]
    enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(name or mt)
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"
    if hasattr(gguf.LlamaFileType, file_type):
        w.add_file_type(gguf.LlamaFileType[file_type])
    heads, kv, layers = write_metadata(w, cfg)
    if arch != "gpt2":
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _rope_freqs(rope, hd))
    vocab = cfg["vocab_size"]
    w.add_vocab_size(vocab)
    _tokenizer(w, hf_dir, vocab, cfg, spm)

    names = gguf.get_tensor_name_map(enum, layers)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state |= load_file(str(f))
    state = _stack_experts(state)
    for i, (hf_name, t) in enumerate(sorted(state.items())):
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        a = t.float().numpy()
        if arch == "gpt2" and hf_name.endswith(_CONV1D):
            a = a.T
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            a = _permute(a, heads if ".q_proj." in hf_name else kv)
        if arch in ("gemma", "gemma3") and hf_name.endswith("norm.weight"):
            a = a + 1
        g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert g is not None, hf_name
        _add(w, g, np.ascontiguousarray(a, dtype=np.float32), qtype, seed=i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (experts.{e}.w1) stacked as llama.cpp's converter does: one
    (E, rows, cols) tensor under the name without the index (experts.w1)."""
    out, stacks = {}, {}
    for name, t in state.items():
        m = _EXPERT.search(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(_EXPERT.sub(".experts.", name), {})[int(m[1])] = t
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def write_metadata(w, cfg: dict) -> tuple[int, int, int]:
    """The architecture's metadata from a config.json dict; returns (heads, KV heads, layers)."""
    if cfg["model_type"] == "gpt2":
        hidden, heads, layers = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
        w.add_context_length(cfg.get("n_positions", 1024))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg.get("n_inner") or 4 * hidden)
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_layer_norm_eps(cfg.get("layer_norm_epsilon", 1e-5))
        return heads, heads, layers
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
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp fixes the local ones)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_rope_dimension_count(hd)
    gemma3 = cfg["model_type"] == "gemma3_text"
    if hd != hidden // heads or gemma3:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if cfg.get("sliding_window") and cfg["model_type"] in ("mistral", "gemma3_text"):
        w.add_sliding_window(cfg["sliding_window"])
    if gemma3:  # llama.cpp's Gemma 3 keys: linear rope scaling; the layer pattern when not every 6th is global
        import gguf

        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["factor"]))
        local = [t == "sliding_attention" for t in cfg["layer_types"]]
        if local != [(i + 1) % 6 != 0 for i in range(layers)]:
            w.add_sliding_window_pattern(local)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:  # llama.cpp's MoE keys
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    return heads, kv, layers


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

    kind = qtype if a.ndim >= 2 else "F32"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    if a.shape[-1] % block:
        kind = "Q8_0" if a.shape[-1] % 32 == 0 else "F32"  # as llama.cpp falls back
    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, a)
    elif kind in K_QUANTS:
        rows = random_blocks(int(np.prod(a.shape[:-1])), a.shape[-1], kind, seed)
        w.add_tensor(name, rows.reshape(*a.shape[:-1], -1), raw_dtype=qt)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)


def _tokenizer(w, hf_dir: Path, vocab: int, cfg: dict, spm: list | None) -> None:
    """The checkpoint's byte-level BPE tokenizer.json as a "gpt2" GGUF vocabulary, `spm` as a
    "llama" one, or a placeholder "llama" vocabulary of `vocab` tokens."""
    path = hf_dir / "tokenizer.json"
    if spm is None and path.exists():
        tok = json.loads(path.read_text())
        ids = dict(tok["model"]["vocab"])
        ids |= {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        tokens = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
        special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
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
        return
    add_spm_vocabulary(w, spm or placeholder_vocabulary(vocab), add_bos=spm is not None)


_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_UNKNOWN, _CONTROL, _BYTE, _NORMAL = 2, 3, 6, 1
"""llama.cpp's token types (gguf.TokenType)."""


def placeholder_vocabulary(vocab: int) -> list[tuple[str, float, int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then <t259>, <t260>, ...: `vocab` tokens (for
    files fed token ids; llama.cpp refuses a file without a vocabulary)."""
    head = [("<unk>", 0.0, _UNKNOWN), ("<s>", 0.0, _CONTROL), ("</s>", 0.0, _CONTROL)]
    head += [(b, 0.0, _BYTE) for b in _BYTES]
    return (head + [(f"<t{i}>", 0.0, _NORMAL) for i in range(len(head), vocab)])[:vocab]


def spm_vocabulary(texts: list[str], size: int) -> list[tuple[str, float, int]]:
    """A SentencePiece-style BPE vocabulary of `size` tokens learned from `texts` as
    llama.cpp's converter writes a Llama tokenizer.model: <unk>, <s>, </s>, the 256 byte
    tokens (byte fallback), then pieces with "▁" for a space, each scored minus its
    rank so that a better merge scores higher. Learned with the tokenizers library (no
    SentencePiece model is available offline here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size - 259, special_tokens=["<unk>"]))
    pieces = [p for p, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if p != "<unk>"]
    head = placeholder_vocabulary(259)
    return head + [(p, -float(i), _NORMAL) for i, p in enumerate(pieces)]


def add_spm_vocabulary(w, vocabulary: list[tuple[str, float, int]], *, add_bos: bool = False) -> None:
    """A "llama" (SentencePiece) vocabulary: pieces, scores and types; <unk> 0, <s> 1, </s> 2."""
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _, _ in vocabulary])
    w.add_token_scores([s for _, s, _ in vocabulary])
    w.add_token_types([k for _, _, k in vocabulary])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)


def reference_logits(path: Path, ids: torch.Tensor, mask: torch.Tensor):
    """transformers' own GGUF load of `path` (every weight dequantized in one process): (model, logits)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return model, out.logits
