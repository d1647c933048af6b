"""A decode step's decoder layers in one native call (csrc/step.c).

    prog = StepProgram(specs, hidden=576, batch=4, allreduce=tp.native_all_reduce())
    prog.set_layout(layout)                       # the caches' strides (kernels.decode.DecodeLayout)
    x = prog.run(x, rope, mask, layout)           # (B, 1, hidden) -> the last layer's output

The per-op fused path (kernels.decode) returns to Python between its ~10 calls a layer, and at
tp > 1 each of a layer's two all-reduces is a Python call into the shared-memory
communicator: on a small, deep model that fixed cost does not shrink with tp. A StepProgram
holds the layers as int64 words (every weight's blocks, the norms, the cache tensors, the
scratch rows, the tp group's segment), and one call a step runs them all: RMSNorm,
activation quantization, the linears (block formats, or fp32), rotary + KV write + attention, the gated
activation, the residual adds and, at tp > 1, both all-reduces by comm/shm.py's protocol.
Same kernels, same order: on block formats a step computes what the per-op fused path
computes, bit for bit; fp32 projections run csrc/f32.c (the per-op path: MKL), the same to
summation order (tests/multiproc/test_native_step.py, tests/unit/test_step_program.py).

A layer is described as data (`LayerSpec`); shardwise.models.step reads them off a model.
A peer that has not arrived at an all-reduce within a short spin (SPIN_NS) hands control back
here: the communicator waits for it (its timeout, its peer checks, its diagnosis of a stuck
rank), counted as one of its all-reduces, and the step resumes where it stopped. A tp group
across hosts (shardwise.comm.tcp: no segment) stops the step at every all-reduce, runs it
over its connections, and resumes: the layers stay native, the exchange is Python's.
SHARDWISE_NATIVE_STEP=0 (or `off()` in code) turns the program off everywhere.
"""

from __future__ import annotations

import array
import contextlib
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardwise.kernels import native
from shardwise.kernels.block import _ACT_BYTES, GGML_IDS, BlockWeight, act_block
from shardwise.kernels.blocks import FORMATS
from shardwise.kernels.decode import GLU_KINDS, DecodeLayout, rope_mask_args

__all__ = ["LayerSpec", "StepProgram", "Unsupported", "enabled", "off", "SPIN_NS", "MAX_PARTS"]

ENABLED = os.environ.get("SHARDWISE_NATIVE_STEP", "1") != "0"
"""SHARDWISE_NATIVE_STEP=0: every decode step on the per-op path (`off()` in code)."""
SPIN_NS = 50_000
"""How long the native all-reduce spins for its peers before it hands the wait to Python (read
when a program is built; negative: no spin at all, every late peer's wait in Python)."""
MAX_PARTS = 4
"""Parts (formats stacked along the output rows) a projection may have."""
PROFILE = os.environ.get("SHARDWISE_STEP_PROFILE", "0") == "1"
"""SHARDWISE_STEP_PROFILE=1 (read when a program is built): time each step's parts in C
(StepProgram.times; benchmarks/bench_native_step.py reads them). A few clock reads a layer."""
_ST = 12  # the resume state's words (csrc/step.c)
TIMES = ("linears", "attention", "other", "allreduce", "spin", "wait")
"""StepProgram.times' keys, ns: in the linears, attention, everything else between them, the
all-reduces in C (copy in, spin, sum), of that the spinning for late peers, and the waits for
them handed to Python (wall time, outside the rest)."""

# the words of csrc/step.c (header, linear, layer), in its order
_H = (
    "isa nlayers B hidden x hn qa qkv att oa y up g ga words mine npeers "
    + " ".join(f"peer{i}" for i in range(8))
    + " slots slot_floats rank size period spin_ns profile external"
).split()
H = {name: i for i, name in enumerate(_H)}
_PART = 5  # type, weight, row bytes, rows, kblocks
LIN = 4 + MAX_PARTS * _PART  # block, nparts, out, bias, then the parts
_Y = ["norm1", "eps1", ("qkv", LIN), "nq", "nkv", "hd", "groups", "kc", "vc", "pos_stride", "head_stride", "scale"]
_Y += ["rrow", ("o", LIN), "norm2", "eps2", ("up", LIN), "glu", "inter", ("down", LIN), "obias", "dbias"]
Y: dict[str, int] = {}
LAYER = 0
for _e in _Y:
    _name, _n = (_e, 1) if isinstance(_e, str) else _e
    Y[_name], LAYER = LAYER, LAYER + _n


def _layout_ok() -> bool:
    lib = native.lib
    return (
        lib is not None
        and hasattr(lib, "step")
        and (len(_H), LAYER, LIN) == (lib.STEP_HEADER_WORDS, lib.STEP_LAYER_WORDS, lib.STEP_LIN_WORDS)
    )


def enabled() -> bool:
    """The program may run: not turned off, and the native module has it (the same layout)."""
    return ENABLED and _layout_ok()


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Inside the block decode steps take the per-op path (what the program is tested against)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


class Unsupported(Exception):
    """What a layer or group has that the program cannot run (one line, for a log or a test)."""


def need(cond: bool, why: str) -> None:
    if not cond:
        raise Unsupported(why)


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm decoder layer as the program runs it:
    x += o(attend(qkv(norm1(x)))) [all-reduced] + obias; x += down(glu(up(norm2(x)))) [all-reduced] + dbias.
    Weights are native block-format BlockWeights or fp32 matrices (out, in); qkv's and up's biases are added before any
    reduce (column-parallel), obias and dbias after it (row-parallel); k, v: this layer's cache."""

    norm1: torch.Tensor
    eps1: float
    qkv: BlockWeight | torch.Tensor
    qkv_bias: torch.Tensor | None
    nq: int
    nkv: int
    head_dim: int
    groups: torch.Tensor | None  # (nkv,) int64 query heads per KV head when they differ
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    o: BlockWeight | torch.Tensor
    obias: torch.Tensor | None
    norm2: torch.Tensor
    eps2: float
    up: BlockWeight | torch.Tensor  # [gate | up]
    up_bias: torch.Tensor | None
    glu: str
    inter: int
    down: BlockWeight | torch.Tensor
    dbias: torch.Tensor | None


def _f64(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _vector(t: torch.Tensor | None, n: int, what: str) -> None:
    need(
        t is None or (t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n),
        f"{what} that is not {n} contiguous fp32 values on CPU",
    )


def _lin_words(w, bias: torch.Tensor | None, k: int, what: str) -> tuple[list[int], int]:
    """A projection's words, and its output width: native blocks (BlockWeight) or an fp32 matrix."""
    if isinstance(w, torch.Tensor):
        rows, cols = w.dim() == 2 and w.stride(1) == 1, w.dim() == 2 and w.stride(0) == 1  # row- or column-major
        need(
            w.dtype is torch.float32 and w.device.type == "cpu" and (rows or cols),
            f"{what}: a float weight that is not fp32 rows or columns on CPU",
        )
        need(w.shape[1] == k, f"{what}: {tuple(w.shape)} does not take rows of {k}")
        _vector(bias, w.shape[0], f"{what}: a bias")
        kind, ld = (0, w.stride(0)) if rows else (-1, w.stride(1))  # -1: column-major (quant/layout.py's order)
        words = [0, 1, w.shape[0], _ptr(bias), kind, w.data_ptr(), ld * 4, w.shape[0], k]
        return words + [0] * (LIN - len(words)), w.shape[0]
    block = act_block(w)
    need(
        isinstance(w, BlockWeight) and block is not None and len(w.parts) <= MAX_PARTS,
        f"{what}: a weight not in native blocks of one activation length (of at most {MAX_PARTS} parts)",
    )
    need(w.shape[1] == k and w.device.type == "cpu", f"{what}: {tuple(w.shape)} does not take rows of {k}")
    _vector(bias, w.shape[0], f"{what}: a bias")
    words = [block, len(w.parts), w.shape[0], _ptr(bias)]
    for p in w.parts:
        f = FORMATS[p.fmt]
        words += [GGML_IDS[p.fmt], p.data.data_ptr(), p.data.stride(0), p.rows, w.padded_in // f.block]
    return words + [0] * (LIN - len(words)), w.shape[0]


def _layer_words(s: LayerSpec, hid: int) -> tuple[list[int], dict[str, int]]:
    """A layer's words and the scratch widths it needs."""
    need(s.glu in GLU_KINDS, f"a gated activation ({s.glu}) the kernel does not compute")
    need(s.nq >= 1 and s.nkv >= 1 and (s.groups is not None or s.nq % s.nkv == 0), "heads that do not group")
    for t, n, what in ((s.norm1, hid, "a norm"), (s.norm2, hid, "a norm"), (s.obias, hid, "a bias")):
        _vector(t, n, what)
    _vector(s.dbias, hid, "a bias")
    need(s.k.dtype is torch.float32 and s.k.is_contiguous() and s.v.is_contiguous(), "a cache not fp32 contiguous")
    att = s.nq * s.head_dim
    q, nqkv = _lin_words(s.qkv, s.qkv_bias, hid, "qkv")
    need(nqkv == att + 2 * s.nkv * s.head_dim, f"qkv's {nqkv} outputs for {s.nq} + 2 x {s.nkv} heads")
    o, _ = _lin_words(s.o, None, att, "o")
    u, nup = _lin_words(s.up, s.up_bias, hid, "up")
    need(nup == 2 * s.inter, f"up's {nup} outputs for [gate | up] of {s.inter}")
    d, _ = _lin_words(s.down, None, s.inter, "down")
    need(s.o.shape[0] == hid and s.down.shape[0] == hid, "o or down not back to the hidden width")
    words = [s.norm1.data_ptr(), _f64(s.eps1), *q, s.nq, s.nkv, s.head_dim, _ptr(s.groups)]
    words += [s.k.data_ptr(), s.v.data_ptr(), 0, 0, _f64(s.scale), 0]  # strides and rrow: set_layout
    words += [*o, s.norm2.data_ptr(), _f64(s.eps2), *u, GLU_KINDS[s.glu], s.inter, *d, _ptr(s.obias), _ptr(s.dbias)]
    assert len(words) == LAYER
    return words, {"qkv": nqkv, "att": att, "inter": s.inter}


class StepProgram:
    """One decode step through `specs` for `batch` rows (see the module docstring). allreduce:
    the tp group's native all-reduce (Communicator.native_all_reduce) when tp > 1, else None."""

    def __init__(self, specs: list[LayerSpec], *, hidden: int, batch: int, allreduce=None) -> None:
        need(bool(specs) and batch >= 1, "no layers, or no rows")
        B, hid = batch, hidden
        words, widths = [], {"qkv": 0, "att": 0, "inter": 0}
        for s in specs:
            w, need_w = _layer_words(s, hid)
            words += w
            widths = {k: max(widths[k], need_w[k]) for k in widths}
        ar = allreduce
        external = ar is not None and getattr(ar, "external", False)  # Python runs each (comm.tcp)
        if ar is not None:
            need(ar.size - 1 <= 8, f"a tp group of {ar.size} ranks (at most 9 here)")
            if not external:
                need(ar.slot_floats >= B * hid, f"an all-reduce slot of {ar.slot_floats} floats for {B} x {hid}")

        def acts(width: int) -> torch.Tensor:  # room for either activation block format
            return torch.empty(B * max(width // b * _ACT_BYTES[b] for b in (32, 256)) + 64, dtype=torch.uint8)

        self.x = torch.empty(B, hid)
        self._bufs = {
            "x": self.x, "hn": torch.empty(B, hid), "qa": acts(hid), "qkv": torch.empty(B, widths["qkv"]),
            "att": torch.empty(B, widths["att"]), "oa": acts(widths["att"]), "y": torch.empty(B, hid),
            "up": torch.empty(B, 2 * widths["inter"]), "g": torch.empty(B, widths["inter"]),
            "ga": acts(widths["inter"]),
        }  # fmt: skip
        head = [0] * len(_H)
        head[H["isa"]], head[H["nlayers"]], head[H["B"]], head[H["hidden"]] = native.isa(), len(specs), B, hid
        for name, t in self._bufs.items():
            head[H[name]] = t.data_ptr()
        head[H["size"]], head[H["spin_ns"]], head[H["profile"]] = 1 if ar is None else ar.size, SPIN_NS, int(PROFILE)
        head[H["external"]] = int(external)
        if ar is not None and not external:
            head[H["words"]], head[H["mine"]], head[H["slots"]] = ar.words, ar.mine, ar.slots
            head[H["slot_floats"]], head[H["rank"]], head[H["period"]] = ar.slot_floats, ar.rank, ar.period
            head[H["npeers"]] = len(ar.peers)
            for j, line in enumerate(ar.peers):
                head[H["peer0"] + j] = line
        self.specs, self.allreduce, self.batch, self.hidden, self.external = specs, ar, B, hid, external
        self.head = array.array("q", head)
        self.layers = array.array("q", words)
        self.st = array.array("q", [0] * _ST)
        self.times = dict.fromkeys(TIMES, 0)  # ns over every step run, with PROFILE (all-reduces: always)
        self._layout_key: tuple | None = None
        self._addrs = (self.head.buffer_info()[0], self.layers.buffer_info()[0], self.st.buffer_info()[0])
        self.waits = 0  # all-reduces whose late peers were waited for in Python (external: every one)
        self.nbytes = B * hid * 4  # one all-reduce's payload

    def set_layout(self, lay: DecodeLayout) -> None:
        """The per-layer words a cache layout sets (the same in every layer: one pool or cache shape)."""
        key = (lay.pos_stride, lay.head_stride, lay.rrow)
        if key == self._layout_key:
            return
        words = self.layers
        for base in range(0, len(words), LAYER):
            words[base + Y["pos_stride"]], words[base + Y["head_stride"]], words[base + Y["rrow"]] = key
        self._layout_key = key

    def run(self, x: torch.Tensor, rope, mask: torch.Tensor | None, lay: DecodeLayout) -> torch.Tensor:
        """x (B, 1, hidden) fp32 -> the last layer's output (B, 1, hidden); rope (cos, sin, ...) of
        (B or 1, 1, 1, rot) or None; mask (B or 1, 1, 1, K) bool or None; lay: the first layer's
        cache layout this step (every layer's is the same but for its tensors)."""
        B, hid = self.batch, self.hidden
        self.set_layout(lay)
        self.x.copy_(x.view(B, hid))
        cos_p, sin_p, ldr, rot, mask_p, ldm = rope_mask_args(rope, mask, B, lay.K)
        st = self.st
        for j in range(_ST):
            st[j] = 0
        ar = self.allreduce
        head, layers, st_p = self._addrs  # NOTE: the arrays never resize: their addresses hold
        args = (head, layers, cos_p, sin_p, ldr, rot, mask_p, ldm, lay.K, lay.wbase, _ptr(lay.widx), _ptr(lay.ridx),
                0 if ar is None else ar.calls(), st_p)  # fmt: skip
        noted, times = 0, self.times  # all-reduces already counted
        while native.lib.step(*args):  # a peer is late: wait through the communicator, then resume
            ar.done(st[2] - noted, self.nbytes, st[4] * 1e-9)
            times["allreduce"] += st[4]
            st[4] = 0
            t0 = time.perf_counter_ns()
            if self.external:
                ar.reduce(self._bufs["y"])  # the step stopped at it: y (B, hid), reduced in place
            else:
                ar.wait(st[3], self.nbytes)
            times["wait"] += time.perf_counter_ns() - t0
            noted = st[2] + 1
            self.waits += 1
        if ar is not None:
            ar.done(st[2] - noted, self.nbytes, st[4] * 1e-9)
            times["allreduce"] += st[4]
        times["linears"] += st[5]
        times["attention"] += st[6]
        times["other"] += st[7]
        times["spin"] += st[8]
        return self.x.clone().view(B, 1, hid)
