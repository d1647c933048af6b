"""A Hugging Face Llama checkpoint written as GGUF (F32 or Q8_0), for timing llama.cpp on the
same weights shardwise runs (benchmarks/bench_quant.py).

    .venv/bin/python benchmarks/gguf_export.py /tmp/smol-shape /tmp/smol-shape.q8_0.gguf --type q8_0

What llama.cpp's convert_hf_to_gguf.py does for a Llama, reduced to what these random-weight
checkpoints need, written with the `gguf` package's GGUFWriter:
- llama architecture metadata from config.json (layers, widths, heads, rope base, norm eps);
- tensors under llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm, output; no
  `output` when the embeddings are tied: llama.cpp then reads token_embd for the head);
- q_proj and k_proj rows permuted within each head from Hugging Face's rotate-half RoPE
  layout to llama.cpp's interleaved pairs (the converter's `permute`);
- Q8_0: every 2-D weight in blocks of 32 (an fp16 scale + 32 int8: 34 bytes per 32 weights),
  by gguf.quants.quantize; norms stay F32;
- a dummy SentencePiece-style vocabulary the loader accepts: <unk>, <s>, </s>, the 256 byte
  tokens <0x00>..<0xFF>, then <t259>, <t260>, ... up to the model's vocab size (the benchmark
  feeds token ids, so the strings never matter).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

__all__ = ["export_gguf", "ensure_gguf"]

TYPES = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """(heads * head_dim, in) rows from rotate-half order (x_0..x_{d/2-1} paired with
    x_{d/2}..) to interleaved pairs (x_0 with x_1, ...), per head: llama.cpp's converter."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_tensors(src: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        out |= load_file(f)
    return {k.removeprefix("model."): v for k, v in out.items()}


def export_gguf(src: Path, dst: Path, kind: str) -> Path:
    """Write `src` (a Hugging Face Llama directory, fp32 safetensors) to `dst` as GGUF of
    `kind` ("f32" or "q8_0"); written next to `dst` and renamed over it."""
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{src}: model_type {cfg.get('model_type')!r}, this writer handles llama only")
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    tied = cfg.get("tie_word_embeddings", False)

    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(src.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(head_dim)
    if head_dim * heads != hidden:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[kind])

    # the dummy vocabulary: control tokens, byte tokens, then placeholders
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    hf = _read_tensors(src)
    named = {"token_embd.weight": hf.pop("embed_tokens.weight"), "output_norm.weight": hf.pop("norm.weight")}
    head = hf.pop("lm_head.weight", None)
    if not tied:
        named["output.weight"] = head
    for i in range(layers):
        for hf_name, name in LAYER_NAMES.items():
            t = hf.pop(f"layers.{i}.{hf_name}")
            if hf_name.startswith("self_attn.q_proj"):
                t = permute(t, heads)
            elif hf_name.startswith("self_attn.k_proj"):
                t = permute(t, kv)
            named[f"blk.{i}.{name}"] = t
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if hf:
        raise ValueError(f"{src}: tensors this writer does not map: {sorted(hf)}")
    for name, t in named.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if kind == "q8_0" and t.ndim == 2:
            q = gguf.quants.quantize(t, TYPES[kind])  # (rows, cols / 32 * 34) uint8
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=TYPES[kind])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


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
    ap.add_argument("src", type=Path, help="a Hugging Face Llama directory")
    ap.add_argument("dst", type=Path, help="the .gguf to write")
    ap.add_argument("--type", choices=sorted(TYPES), default="f32")
    args = ap.parse_args()
    print(export_gguf(args.src, args.dst, args.type))


if __name__ == "__main__":
    main()
