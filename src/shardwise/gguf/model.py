"""A GGUF file as a shardwise model: its architecture and config from the metadata, and
its tensors under the names and in the layout the Hugging Face loader reads.

- ARCHES maps llama.cpp's `general.architecture` to the config.json model_type of the
  family shardwise runs it with (shardwise.hf.families) and to the metadata keys that
  give each config field; `gguf_config` builds that config.json-like dict, so a GGUF file
  goes through the same family config reader, tp check and plan as a checkpoint
  directory.
- `gguf_names` turns the family's name table (Hugging Face names) into GGUF tensor
  names with the `gguf` package's own name map (the one llama.cpp's converter writes
  with). GGUF stores every matrix as (out, in), GPT-2's Conv1D weights included.
- Llama 3.1's rope scaling, stored only as per-frequency divisors (`rope_freqs`), is
  turned back into transformers' llama3 rope parameters (_llama3_rope).
- Mixtures of experts (Mixtral, written as llama with `expert_count`; qwen2moe; qwen3moe)
  stack each layer's experts in one tensor, ffn_{gate,up,down}_exps of shape (E, R, C):
  GGUFCheckpoint shows it as the (E * R, C) matrix of its rows, and each per-expert
  Hugging Face name of the family's table becomes its block of rows (Src.start), so a
  rank reads only its experts' rows (expert parallelism) or its slice of each.
- GGUFCheckpoint reads slices with the converter's changes undone: Llama's q and k rows
  are permuted within each head for llama.cpp's rotary layout (each rank reads its own
  heads, whose rows are contiguous either way, and un-permutes them), Gemma's norm
  weights are stored with the +1 of its RMSNorm added.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.gguf.reader import GGUFError, GGUFFile

__all__ = ["Arch", "ARCHES", "gguf_config", "gguf_names", "GGUFCheckpoint", "GGUFInfo"]

_COMMON = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
}


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture shardwise reads."""

    model_type: str
    """The config.json model_type of the family that runs it."""
    keys: dict = field(default_factory=lambda: dict(_COMMON))
    """config field -> metadata key (after "<arch>.")."""
    defaults: dict = field(default_factory=dict)
    permute_qk: bool = False
    """llama.cpp's converter permuted q and k rows per head (Llama, Mistral)."""
    norm_offset: float = 0.0
    """Added to every norm weight by the converter (Gemma: 1)."""
    experts: str | None = None
    """The model_type of a file of this architecture with `<arch>.expert_count` set (llama.cpp
    writes Mixtral as llama with stacked experts)."""


_WINDOW = {"sliding_window": "attention.sliding_window"}
_EXPERTS = {"num_experts": "expert_count", "num_experts_per_tok": "expert_used_count"}
_QWEN_MOE = _COMMON | _EXPERTS | {"moe_intermediate_size": "expert_feed_forward_length"}

ARCHES: dict[str, Arch] = {
    # Mistral too (llama.cpp writes it as llama), and Mixtral: llama with expert_count set
    "llama": Arch("llama", keys=_COMMON | _WINDOW, permute_qk=True, experts="mixtral"),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "gemma": Arch("gemma", defaults={"hidden_activation": "gelu_pytorch_tanh"}, norm_offset=1.0),
    "gemma3": Arch(
        "gemma3_text", keys=_COMMON | _WINDOW, defaults={"hidden_activation": "gelu_pytorch_tanh"}, norm_offset=1.0
    ),
    "phi3": Arch("phi3"),
    "qwen2moe": Arch(
        "qwen2_moe", keys=_QWEN_MOE | {"shared_expert_intermediate_size": "expert_shared_feed_forward_length"}
    ),
    "qwen3moe": Arch("qwen3_moe", keys=_QWEN_MOE, defaults={"norm_topk_prob": True}),  # llama.cpp renormalizes
    "gpt2": Arch(
        "gpt2",
        keys={
            "n_embd": "embedding_length",
            "n_inner": "feed_forward_length",
            "n_layer": "block_count",
            "n_head": "attention.head_count",
            "layer_norm_epsilon": "attention.layer_norm_epsilon",
            "n_positions": "context_length",
        },
        defaults={"activation_function": "gelu_new"},
    ),
}


def arch_of(f: GGUFFile) -> tuple[str, Arch]:
    name = f.get("general.architecture")
    if name not in ARCHES:
        raise GGUFError(
            f"{f.path}: architecture {name!r} has no shardwise model code; supported GGUF architectures: "
            f"{', '.join(ARCHES)}"
        )
    return name, ARCHES[name]


def gguf_config(f: GGUFFile) -> dict:
    """The file's config as config.json would give it (model_type, sizes, rope, eps, tying)."""
    name, arch = arch_of(f)
    d: dict = {"model_type": arch.model_type, **arch.defaults}
    keys = arch.keys
    if arch.experts is not None and f.get(f"{name}.expert_count"):  # Mixtral, written as llama
        d["model_type"] = arch.experts
        keys = keys | {"num_local_experts": "expert_count", "num_experts_per_tok": "expert_used_count"}
    for key, meta in keys.items():
        value = f.get(f"{name}.{meta}")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise GGUFError(f"{f.path}: metadata '{name}.{meta}' is {value!r}, not a number")
            d[key] = value
    _check_blocks(f, name)
    if "head_dim" in arch.keys and "head_dim" not in d:  # older files: only the rotary width
        rope_dim = f.get(f"{name}.rope.dimension_count")
        if rope_dim is not None:
            d["head_dim"] = rope_dim
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{f.path}: no tensor 'token_embd.weight': not a language model GGUF file")
    d["vocab_size"] = f.tensors["token_embd.weight"].shape[0]
    d["tie_word_embeddings"] = "output.weight" not in f.tensors
    if arch.model_type == "llama":  # llama.cpp keeps biases where the checkpoint had them
        d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        d["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    if arch.model_type == "qwen2_moe":
        d["qkv_bias"] = "blk.0.attn_q.bias" in f.tensors
    if "rope_freqs.weight" in f.tensors:
        if arch.model_type != "llama":
            raise GGUFError(f"{f.path}: tensor 'rope_freqs.weight' in a {name} file is not supported")
        d["rope_parameters"] = _llama3_rope(f, name, d)
    if arch.model_type == "gemma3_text":
        d |= _gemma3(f, name, d)
    for tok in ("bos", "eos"):
        value = f.get(f"tokenizer.ggml.{tok}_token_id")
        if value is not None:
            d[f"{tok}_token_id"] = value
    return d


def _check_blocks(f: GGUFFile, name: str) -> None:
    """block_count against the blocks the file has tensors for (blk.0 .. blk.N-1)."""
    n = f.get(f"{name}.block_count")
    blocks = {int(t.split(".")[1]) for t in f.tensors if t.startswith("blk.") and t.split(".")[1].isdigit()}
    if isinstance(n, int) and blocks != set(range(n)):
        have = f"blocks {min(blocks)}..{max(blocks)} ({len(blocks)} of them)" if blocks else "no blocks"
        raise GGUFError(f"{f.path}: {name}.block_count is {n}, but the file has tensors of {have}")


def _gemma3(f: GGUFFile, name: str, d: dict) -> dict:
    """What llama.cpp fixes in code for Gemma 3 rather than reading it from the file
    (llama-model.cpp): local layers rotate by base 10000 unscaled; every 6th layer is global
    unless `attention.sliding_window_pattern` says (a period, or one flag per layer, True =
    local); the softmax scale is 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the
    27B (62 layers). A linear rope scaling (Gemma 3 4B-27B: x8) applies to the global layers."""
    n, heads = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
    hd = int(d.get("head_dim") or d["hidden_size"] // heads)
    pattern = f.get(f"{name}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise GGUFError(
                f"{f.path}: {name}.attention.sliding_window_pattern has {len(pattern)} flags for {n} layers"
            )
        local = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and pattern >= 1:
        local = [(i + 1) % pattern != 0 for i in range(n)]
    else:
        raise GGUFError(f"{f.path}: {name}.attention.sliding_window_pattern is {pattern!r}, not a period or flags")
    out = {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": d["hidden_size"] // heads if n == 62 else hd,
    }
    kind = f.get(f"{name}.rope.scaling.type")
    if kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(f.get(f"{name}.rope.scaling.factor", 1.0))}
    elif kind not in (None, "none"):
        raise GGUFError(f"{f.path}: {name}.rope.scaling.type {kind!r} is not supported; supported: linear, none")
    return out


def _llama3_rope(f: GGUFFile, name: str, d: dict) -> dict:
    """Llama 3.1-style rope scaling from the per-frequency divisors llama.cpp stores in
    `rope_freqs.weight` (its converter computes them from factor, low/high_freq_factor and
    the original context; GGUF keeps only the result), as transformers' rope_parameters.

    Per frequency, divisor = 1 / ((1 - s) / factor + s) where the smoothing
    s = (orig / wavelen - low) / (high - low), clipped to [0, 1]. factor is the largest
    divisor; s is linear in 1 / wavelen, so two unclipped frequencies fix its slope and
    offset, and any original context with the matching low and high gives the same
    divisors (the file's own original context when it records one)."""
    import math

    theta = float(d.get("rope_theta", 10000.0))
    hd = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    div = f.read_block_range("rope_freqs.weight").double()
    inv_wavelen = torch.tensor([theta ** (-i / hd) / (2 * math.pi) for i in range(0, hd, 2)], dtype=torch.float64)
    if div.numel() != inv_wavelen.numel():
        raise GGUFError(f"{f.path}: rope_freqs.weight has {div.numel()} values for a head_dim of {hd}")
    factor = float(div.max())
    if factor <= 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    s = (1 / div - 1 / factor) / (1 - 1 / factor)  # 1: unscaled, 0: divided by factor
    mid = (s > 1e-6) & (s < 1 - 1e-6)
    if int(mid.sum()) >= 2:  # s = a / wavelen + b on the smoothed band
        x, y = inv_wavelen[mid], s[mid]
        a = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        b = float(y.mean() - a * x.mean())
    else:  # no band: any line from 0 at the last divided frequency to 1 at the first kept one
        lo, hi = float(inv_wavelen[s <= 0.5].max()), float(inv_wavelen[s > 0.5].min())
        a = 1 / (hi - lo)
        b = -lo * a
    orig = float(f.get(f"{name}.rope.scaling.original_context_length") or 8192)
    low = -b * orig / a
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low + orig / a,
        "original_max_position_embeddings": int(orig),
    }


def gguf_names(table: dict, f: GGUFFile) -> dict:
    """A family's name table (Hugging Face names, as shardwise.hf.names builds it) with each
    source renamed to its GGUF tensor and read untransposed."""
    from dataclasses import replace

    try:
        import gguf
    except ImportError as e:
        raise GGUFError(
            f"{f.path}: GGUF tensor names need the gguf package (pip install 'shardwise[hf]'): {e}"
        ) from None

    name, _ = arch_of(f)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
    n_layers = int(f.get(f"{name}.block_count", 0))
    names = gguf.get_tensor_name_map(arch, n_layers)
    out = {}
    for param, sources in table.items():
        renamed = []
        for src in sources:
            # expert e of a stacked ffn_*_exps tensor (E, R, C): its rows [e*R, (e+1)*R) of E*R
            expert = _EXPERT.search(src.name)
            theirs = names.get_name(_EXPERT.sub(".experts.", src.name), try_suffixes=(".weight", ".bias"))
            if theirs is None:
                raise GGUFError(f"{f.path}: no GGUF tensor name for {src.name!r} (for {param}) in {name}")
            if expert is None:
                renamed.append(replace(src, name=theirs, transposed=False))
                continue
            if theirs not in f.tensors or len(f.tensors[theirs].shape) != 3:
                shape = f.tensors[theirs].shape if theirs in f.tensors else None
                raise GGUFError(
                    f"{f.path}: {theirs!r} (for {param}) has shape {shape}, expected stacked experts (E, rows, cols)"
                )
            per = f.tensors[theirs].shape[1]
            renamed.append(replace(src, name=theirs, transposed=False, rows=per, start=int(expert[1]) * per))
        out[param] = renamed
    return out


_EXPERT = re.compile(r"\.experts\.(\d+)\.")
"""A per-expert Hugging Face name (experts.3.w1); GGUF stacks them in one ffn_*_exps tensor."""


def _matrix(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Stacked experts (E, R, C) as the (E * R, C) matrix of their rows; other shapes as they are."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) > 2 else shape


@dataclass(frozen=True)
class GGUFInfo:
    """What shardwise.hf.sources asks of a tensor: its file, shape and a dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


class GGUFCheckpoint:
    """A GGUF file behind the interface of shardwise.hf.checkpoint.Checkpoint (tensors,
    info, read, close), reading dequantized slices with the converter's changes undone."""

    fresh_reads = True
    """read() returns new tensors, never views of the file."""

    def __init__(self, f: GGUFFile, cfg, *, dtype: torch.dtype = torch.float32) -> None:
        self.file, self.path, self.dtype = f, f.path, dtype
        _, self.arch = arch_of(f)
        # stacked experts (E, R, C) are E * R rows; Qwen2-MoE's shared expert gate, a vector
        # in quantized files, is the (1, H) matrix it is in the model
        self._rows = {n for n, t in f.tensors.items() if n.endswith("ffn_gate_inp_shexp.weight") and len(t.shape) == 1}
        self.tensors = {
            n: GGUFInfo(f.path, (1, *t.shape) if n in self._rows else _matrix(t.shape)) for n, t in f.tensors.items()
        }
        self.bytes_read = 0
        self._heads = {}
        if self.arch.permute_qk:
            for i in range(cfg.num_layers):
                for kind, n in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
                    for suffix in ("weight", "bias"):
                        self._heads[f"blk.{i}.attn_{kind}.{suffix}"] = n

    def info(self, name: str, *, needed_for: str = "") -> GGUFInfo:
        if name not in self.tensors:
            why = f" (needed for {needed_for})" if needed_for else ""
            raise GGUFError(f"{self.path}: missing tensor {name!r}{why}")
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or `index` of it (torch order), in self.dtype."""
        index = tuple(index or ())
        rows = index[0] if index else None
        cols = index[1] if len(index) > 1 else None
        if name in self._heads:
            return self._read_permuted(name, rows, cols, self._heads[name])
        if name in self._rows:  # a vector read as its one row
            return self._read(name, cols, None).unsqueeze(0)
        if self.arch.norm_offset and name.endswith("norm.weight"):  # subtracted in float32
            return (self._read(name, rows, cols, torch.float32) - self.arch.norm_offset).to(self.dtype)
        return self._read(name, rows, cols)

    def _read(self, name: str, rows: slice | None, cols: slice | None, dtype: torch.dtype | None = None):
        self.bytes_read += self.file.bytes_of(name, rows, cols)
        return self.file.read_block_range(name, rows, cols, dtype=dtype or self.dtype)

    def format_of(self, name: str) -> str:
        """The ggml type tensor `name` is stored in ("Q4_K", "F32", ...)."""
        return self.file.tensors[name].type

    def read_raw(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """`index` of matrix `name` (torch order) as its own undecoded blocks: (rows, blocks *
        bytes) uint8, rows in Hugging Face order (a permuted q/k's rows put back). The columns
        must fall on block boundaries (GGUFFile.read_raw)."""
        index = tuple(index or ())
        rows = index[0] if index else None
        cols = index[1] if len(index) > 1 else None
        if name in self._heads:
            return self._read_permuted(name, rows, cols, self._heads[name], reader=self._raw)
        return self._raw(name, rows, cols)

    def _raw(self, name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        self.bytes_read += self.file.bytes_of(name, rows, cols)
        return self.file.read_raw(name, rows, cols)

    def _read_permuted(
        self, name: str, rows: slice | None, cols: slice | None, heads: int, *, reader=None
    ) -> torch.Tensor:
        """Rows in Hugging Face order of a q/k tensor stored permuted per head: within a head
        of d rows, our row a * d/2 + j is stored at row 2 * j + a. The whole heads asked for
        are one read of exactly their rows; a head asked for in part (a block of rows from
        read_shard_rows) is read per half, which touches at most twice the rows asked."""
        reader = reader or self._read
        total = self.tensors[name].shape[0]
        hd = total // heads
        ours = torch.arange(total)[rows or slice(None)]
        if ours.numel() == 0:
            return reader(name, slice(0, 0), cols)
        within = ours % hd
        stored = ours - within + (within % (hd // 2)) * 2 + within // (hd // 2)
        head = ours // hd
        whole = torch.bincount(head, minlength=heads)[head] == hd
        key = torch.where(whole, -1, ours // (hd // 2))  # runs: whole heads, or one half of a head
        ends = [*(torch.nonzero(key[1:] != key[:-1]).flatten() + 1).tolist(), len(key)]
        parts, start = [], 0
        for end in ends:
            sel = stored[start:end]
            lo, hi = int(sel.min()), int(sel.max()) + 1
            parts.append(reader(name, slice(lo, hi), cols)[sel - lo])
            start = end
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        self.file.close()
