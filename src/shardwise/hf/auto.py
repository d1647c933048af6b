"""The automatic plan (DeepSpeed AutoTP's idea) for Hugging Face architectures without
shardwise model code: shardwise.hf.load sends any model_type outside FAMILIES here.

1. transformers builds its own model from config.json on the meta device.
2. The plan is read off the module structure. Decoder layers: the one ModuleList of
   num_hidden_layers blocks. Attention: the module whose nn.Linear children are three
   input projections hidden -> q, k, v widths (split by whole heads, colwise) and one
   output projection back to hidden (rowwise). MLP: the layer's other nn.Linears, 1-2
   hidden -> I (colwise) and one I -> hidden (rowwise). Embedding and LM head: vocab.
   Head-count attributes the forward may read (OPT's `self.num_heads` in a view) are
   set to this rank's counts; another size it reads that tp would change is refused.
3. Everything else in a layer must be safe to replicate (hidden-size or per-head
   norms). Fused qkv or gate/up, Conv1D, whole-width q/k norms, nn.Linear subclasses
   or odd shapes are refused with a ShardError naming the module path.
4. The module's parameter names are the checkpoint names (modulo the base-model
   prefix), so each rank reads exactly its ShardSpec slices from the safetensors files.
   Non-persistent buffers (rotary inv_freq) are rebuilt on CPU from the module's config.

No collective runs here. LoadReport.family is "auto:<model_type>" and LoadReport.config
holds the transformers config object (a PretrainedConfig), not a ModelConfig.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from shardwise.comm import Communicator
from shardwise.hf.checkpoint import Checkpoint, CheckpointError, raw_config
from shardwise.hf.families import supported_model_types
from shardwise.hf.fill import DTYPES, LoadReport, assign, bytes_read, dtype_name, refuse_unexpected
from shardwise.hf.sources import Src, read_shard, segments
from shardwise.layers import ShardError, model_shard_specs, split_sizes, valid_tp_sizes
from shardwise.quant.convert import bytes_by_format, conversion_targets, convert_param, release_freed, weight_bytes
from shardwise.quant.schemes import conversion
from shardwise.sharding import Colwise, Rowwise, Style, Vocab, parallelize

__all__ = ["load_auto", "auto_plan", "check_auto"]

_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head")
_SAFE_INTS = ("head_dim", "layer_idx", "num_key_value_groups", "sliding_window", "max_position_embeddings")
_OUT_NAMES = ("o_proj", "out_proj", "o", "wo", "dense", "c_proj", "out_lin")
_DOWN_NAMES = ("down_proj", "fc2", "w2", "c_proj", "dense_4h_to_h", "fc_out", "lin2")
HeadFix = tuple[str, str, int]
"""(attention module path, attribute, the unsharded head count; each rank sets its own share)."""


def _refuse(path: str, why: str) -> ShardError:
    return ShardError(
        f"{path or '<model>'}: {why}; the automatic plan cannot shard this safely. "
        f"shardwise has model code for: {', '.join(supported_model_types())}"
    )


def _desc(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return f"{type(module).__name__}({module.in_features}->{module.out_features})"
    shapes = ", ".join(str(tuple(p.shape)) for p in module.parameters(recurse=False))
    return f"{type(module).__name__}[{shapes}]"


def _own_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


@functools.cache
def _self_attrs(cls: type) -> frozenset[str] | None:
    """Names `self.X` read in the class's forward source, or None if the source is unreadable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    return frozenset(
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"
    )


def _check_ints(path: str, module: nn.Module, sizes: tuple[int, ...], what: str) -> None:
    """Refuse if the forward reads an int attribute equal to a size that tp changes."""
    used = _self_attrs(type(module))
    if used is None:
        raise _refuse(
            path, f"the forward source of {type(module).__name__} is unreadable, so its {what} cannot be checked"
        )
    for name, value in vars(module).items():
        if type(value) is int and name in used and name not in _SAFE_INTS + _HEAD_COUNTS and value in sizes:
            raise _refuse(path, f"{type(module).__name__}.forward reads self.{name}={value}, a {what} that tp changes")


def _analyse(model: nn.Module, hf_config, tp: int) -> tuple[dict[str, Style], list[HeadFix]]:
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    nh, hidden, n_layers = (getattr(cfg, k, None) for k in ("num_attention_heads", "hidden_size", "num_hidden_layers"))
    if not (nh and hidden and n_layers):
        raise _refuse("", "config has no num_attention_heads, hidden_size and num_hidden_layers")
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    hd = getattr(cfg, "head_dim", None) or hidden // nh
    lists = [p for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise _refuse("", f"found {len(lists)} ModuleLists of num_hidden_layers={n_layers} decoder layers, need 1")
    plan: dict[str, Style] = {}
    heads: list[HeadFix] = []
    for i, layer in enumerate(model.get_submodule(lists[0])):
        lp = f"{lists[0]}.{i}"
        attn_p, attn_plan, attn_heads = _attention(lp, layer, hidden, nh, nkv, hd)
        mlp_plan, inter = _mlp(lp, layer, attn_p, hidden)
        plan |= attn_plan | mlp_plan
        heads += attn_heads
        _check_split(attn_p, lp, nh, nkv, inter, tp)  # before any data is read
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    paths = {id(m): p for p, m in model.named_modules()}
    if type(emb) is not nn.Embedding or emb.max_norm is not None:
        raise _refuse(paths.get(id(emb), ""), f"the input embedding is {type(emb).__name__}, not a plain nn.Embedding")
    plan[paths[id(emb)]] = Vocab()
    if head is not None:
        if type(head) is not nn.Linear or head.out_features != emb.num_embeddings:
            raise _refuse(paths.get(id(head), ""), f"the LM head is {_desc(head)}, not an nn.Linear to the vocabulary")
        plan[paths[id(head)]] = Vocab(gather_output=True)
    return plan, heads


def _check_split(attn_p: str, lp: str, nh: int, nkv: int, inter: int, tp: int) -> None:
    """Any tp up to the heads splits multi-head attention (unevenly where tp does not divide
    them); grouped-query attention must split its KV heads evenly, as transformers' attention
    needs one group size and the automatic plan never replicates key/value heads."""
    if nkv == nh:
        valid = f"1-{min(nh, inter)}"
        if tp > nh:
            raise ShardError(f"{attn_p}: tp={tp} is more than num_attention_heads={nh}; valid tp sizes: {valid}")
        if tp > inter:
            raise ShardError(f"{lp}: tp={tp} is more than intermediate_size={inter}; valid tp sizes: {valid}")
        return
    if nkv % tp:
        valid = ", ".join(map(str, valid_tp_sizes(nkv)))
        raise ShardError(
            f"{attn_p}: num_key_value_heads={nkv} cannot be split over tp={tp} (the automatic plan splits "
            f"grouped-query attention evenly and never replicates key/value heads); valid tp sizes: {valid}"
        )


def _attention(lp: str, layer: nn.Module, hidden: int, nh: int, nkv: int, hd: int):
    """(attention path, its plan, its head-count attributes (path, name, global value)) in one layer."""
    qw, kvw = nh * hd, nkv * hd
    found = []
    for sub, m in layer.named_modules():
        lin = [c for c in m.children() if isinstance(c, nn.Linear)]
        reads = [c for c in lin if c.in_features == hidden and c.out_features in (qw, kvw)]
        if len(reads) >= 3 and any(c.in_features == qw and c.out_features == hidden for c in lin):
            found.append(sub)
    if len(found) != 1:
        leaves = [f"{p} {_desc(m)}" for p, m in layer.named_modules() if _own_params(m)]
        raise _refuse(
            lp,
            f"found {len(found)} attention modules with separate q, k, v and output nn.Linear projections "
            f"(hidden={hidden} -> q={qw}, k=v={kvw}) where 1 is needed; parameterised modules: {', '.join(leaves)}",
        )
    if not found[0]:
        raise _refuse(lp, "the q, k, v and output projections sit directly on the decoder layer, beside its MLP")
    ap = f"{lp}.{found[0]}"
    attn = layer.get_submodule(found[0])
    lin = {n: c for n, c in attn.named_children() if type(c) is nn.Linear}
    outs = [n for n, c in lin.items() if c.in_features == qw and c.out_features == hidden]
    if len(outs) > 1:
        outs = [n for n in outs if n in _OUT_NAMES]
    ins = {n: c for n, c in lin.items() if n not in outs}
    widths = sorted(c.out_features for c in ins.values())
    if len(outs) != 1 or widths != sorted((qw, kvw, kvw)) or any(c.in_features != hidden for c in ins.values()):
        have = ", ".join(f"{n} {_desc(c)}" for n, c in attn.named_children())
        raise _refuse(
            ap,
            f"expected q, k, v projections hidden={hidden} -> {qw}, {kvw}, {kvw} and one output projection {qw} -> {hidden}; found {have}",
        )
    for sub, m in attn.named_modules():
        if sub in lin or not _own_params(m):
            continue
        per_head = sub and hd not in (nh, nkv) and all(d == hd for p in m.parameters(recurse=False) for d in p.shape)
        if not per_head:  # e.g. a q/k norm over all heads at once: it would see only this rank's heads
            raise _refuse(
                f"{ap}.{sub}".rstrip("."), f"{_desc(m)} in the attention is neither a projection nor per-head"
            )
    _check_ints(ap, attn, (nh, nkv, qw, kvw), "head count or width")
    heads: list[HeadFix] = []
    for name in _HEAD_COUNTS:
        value = getattr(attn, name, None)
        if type(value) is int:
            if value not in (nh, nkv):
                raise _refuse(
                    ap, f"self.{name}={value} is neither num_attention_heads={nh} nor num_key_value_heads={nkv}"
                )
            heads.append((ap, name, value))
    plan: dict[str, Style] = {f"{ap}.{n}": Colwise(head_dim=hd) for n in ins}
    plan[f"{ap}.{outs[0]}"] = Rowwise(head_dim=hd)
    return ap, plan, heads


def _mlp(lp: str, layer: nn.Module, attn_p: str, hidden: int) -> tuple[dict[str, Style], int]:
    """(plan, intermediate size) of the MLP: the layer's nn.Linears outside the attention."""
    inside = attn_p[len(lp) + 1 :]
    lin: dict[str, nn.Linear] = {}
    for sub, m in layer.named_modules():
        if not _own_params(m) or sub == inside or sub.startswith(inside + "."):
            continue
        if type(m) is nn.Linear:
            lin[sub] = m
        elif any(p.dim() != 1 or p.shape[0] != hidden for p in m.parameters(recurse=False)):
            raise _refuse(f"{lp}.{sub}", f"{_desc(m)} is neither an nn.Linear nor a norm of hidden_size={hidden}")
    downs = [s for s, m in lin.items() if m.out_features == hidden]
    if len(downs) > 1:
        downs = [s for s in downs if s.rpartition(".")[2] in _DOWN_NAMES]
    ups = [s for s in lin if s not in downs]
    inter = lin[downs[0]].in_features if len(downs) == 1 else 0
    parents = {s.rpartition(".")[0] for s in lin}
    shapes_ok = all(lin[s].in_features == hidden and lin[s].out_features == inter for s in ups)
    if not (inter and 1 <= len(ups) <= 2 and len(parents) == 1 and shapes_ok):
        have = ", ".join(f"{s} {_desc(m)}" for s, m in lin.items()) or "none"
        raise _refuse(
            lp, f"expected an MLP of 1-2 nn.Linear hidden={hidden} -> I and one I -> hidden (not fused); found {have}"
        )
    owner = parents.pop()
    _check_ints(f"{lp}.{owner}".rstrip("."), layer.get_submodule(owner), (inter,), "intermediate size")
    return {f"{lp}.{s}": Colwise() for s in ups} | {f"{lp}.{downs[0]}": Rowwise()}, inter


def auto_plan(model: nn.Module, hf_config, tp: int) -> dict[str, Style]:
    """The plan for a transformers model (unsharded, e.g. on meta); ShardError if unrecognised."""
    return _analyse(model, hf_config, tp)[0]


def _meta_model(path: Path, dtype: str | torch.dtype | None = None) -> tuple[nn.Module, object]:
    """(transformers model on the meta device, its config) for a checkpoint directory."""
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{path / 'config.json'}: transformers cannot build model_type {raw_config(path).get('model_type')!r} "
            f"({e}); shardwise has model code for: {', '.join(supported_model_types())}"
        ) from None
    name = dtype_name(dtype if dtype is not None else hf_config.dtype or "float32")
    lm = type(hf_config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    auto_cls = transformers.AutoModelForCausalLM if lm else transformers.AutoModel
    with torch.device("meta"):
        model = auto_cls.from_config(hf_config, dtype=DTYPES[name])
    return model, hf_config


def check_auto(path: str | Path, tp: int) -> None:
    """Refuse, before any weight is read, a model the automatic plan cannot shard over tp
    (a ShardError naming the module path, or a CheckpointError)."""
    model, hf_config = _meta_model(Path(path))
    _analyse(model, hf_config, tp)


def load_auto(
    path: str | Path,
    *,
    comm: Communicator,
    dtype: str | torch.dtype | None = None,
    progress: bool = False,
    quantize: str | None = None,
) -> tuple[nn.Module, LoadReport]:
    """Build the transformers model on meta, shard it by auto_plan and read this rank's slices."""
    path = Path(path)
    model_type = raw_config(path).get("model_type")
    model, hf_config = _meta_model(path, dtype)
    plan, fixes = _analyse(model, hf_config, comm.size)  # refuses before any data is read
    ckpt = Checkpoint(path)
    parallelize(model, plan, comm=comm)
    for mod_path, attr, count in fixes:  # e.g. OPT's view(bsz, -1, self.num_heads, head_dim)
        setattr(model.get_submodule(mod_path), attr, split_sizes(count, comm.size)[comm.rank])

    specs = model_shard_specs(model)
    to_ckpt = _name_map(ckpt, model, next(iter(specs)))
    names: dict[int, list[str]] = {}  # tied parameters: every name, the checkpoint may hold either
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(to_ckpt(n))
    params = dict(model.named_parameters())
    src = {n: next((c for c in names[id(params[n])] if c in ckpt.tensors), to_ckpt(n)) for n in specs}
    segs = {n: segments(ckpt, n, [Src(src[n])], spec.global_shape) for n, spec in specs.items()}
    ignore = tuple(c for group in names.values() for c in group) + tuple(to_ckpt(n) for n, _ in model.named_buffers())
    refuse_unexpected(
        ckpt, segs, ignore, what=f"a {model_type} model with num_hidden_layers={hf_config.num_hidden_layers}"
    )
    quantize = conversion(quantize)
    convert = conversion_targets(model, quantize) if quantize else {}
    loaded: dict[str, torch.Tensor] = {}
    n_read = 0
    for n, spec in tqdm(specs.items(), desc=f"loading shards (tp={comm.size})", disable=not progress, leave=False):
        t = read_shard(ckpt, segs[n], spec, params[n].dtype)  # (local shape)
        if n in convert:
            convert_param(convert[n], t)  # converted now: the float copy is dropped here
            del t
            release_freed()
        else:
            loaded[n] = t
        n_read += bytes_read(spec, ckpt.info(src[n]).dtype)
    assign(model, loaded)
    _fill_buffers(model, ckpt, to_ckpt)
    ckpt.close()
    left = [f"{p}.{k}".lstrip(".") for p, m in model.named_modules() for k, v in _tensors(m).items() if v.is_meta]
    if left:
        raise CheckpointError(f"{path}: tensors still on the meta device after loading: {', '.join(left)}")
    return model.eval(), LoadReport(
        f"auto:{model_type}", hf_config, weight_bytes(model), n_read, bytes_by_format(model)
    )


def _name_map(ckpt: Checkpoint, model: nn.Module, probe: str):
    """Our parameter name -> checkpoint name: as is, or without/with the base-model prefix."""
    pre = f"{getattr(model, 'base_model_prefix', '')}."
    for f in (lambda n: n, lambda n: n.removeprefix(pre), lambda n: n if n.startswith((pre, "lm_head.")) else pre + n):
        if f(probe) in ckpt.tensors:
            return f
    raise CheckpointError(f"checkpoint {ckpt.path} has no tensor {probe!r}, with or without the prefix {pre!r}")


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters, buffers and plain tensor attributes."""
    items = [*vars(m).items(), *m._parameters.items(), *m._buffers.items()]
    return {k: v for k, v in items if isinstance(v, torch.Tensor)}


def _fill_buffers(model: nn.Module, ckpt: Checkpoint, to_ckpt) -> None:
    """Persistent buffers from the checkpoint; the rest rebuilt on CPU from the module's config."""
    for mp, m in model.named_modules():
        for k, b in list(m._buffers.items()):
            name = to_ckpt(f"{mp}.{k}".lstrip("."))
            if b is not None and b.is_meta and k not in m._non_persistent_buffers_set and name in ckpt.tensors:
                m._buffers[k] = ckpt.read(name).to(b.dtype)
        meta = [k for k, v in _tensors(m).items() if v.is_meta and k not in m._parameters]
        if not meta:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(m)(m.config)  # e.g. a rotary embedding: inv_freq from rope_parameters
        except (AttributeError, TypeError) as e:
            raise CheckpointError(
                f"{mp}: {', '.join(meta)} not in the checkpoint, and {type(m).__name__} cannot be rebuilt from its config ({e})"
            ) from None
        for k in meta:
            value = getattr(fresh, k)
            if k in m._buffers:
                m._buffers[k] = value
            else:
                setattr(m, k, value)
