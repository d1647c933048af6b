"""The checkpoint manifest: what a checkpoint holds and how to reassemble it, as JSON.

    step-00000010/
      manifest.json           written last: its presence marks a committed checkpoint
      rank-00000.safetensors  rank 0's chunks (and RNG states)
      rank-00001.safetensors  ...
      tokenizer.json          optional

Every tensor (a parameter, or an AdamW moment of one) is recorded with its global
(unsharded) shape, dtype, split dim, and the chunks that cover it: each chunk is the
global rows [start, start + length) along the split dim, stored under one key of one
file. The chunks of a tensor cover its rows exactly once, so loading at any tp size is a
pure function of this metadata (shardwise.checkpoint.reshard). No pickle: JSON and
safetensors only; RNG states are uint8 tensors.

Parameters keep their global names at every pipeline size, so a checkpoint saved at pp > 1
holds the same tensors as one saved at pp = 1 (each written by the stage that owns it);
`layout` records tp, pp and dp, and `pipeline` the layer split (StageLayout.to_dict()).
A manifest written before pipelines (no pp, no pipeline) reads as pp = 1.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from shardwise.hf.checkpoint import CheckpointError
from shardwise.models.config import ModelConfig
from shardwise.pipeline.stage import StageError, StageLayout

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Chunk",
    "TensorEntry",
    "Manifest",
    "CheckpointError",
    "tensor_key",
    "KINDS",
    "layout_text",
]

FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1
KINDS = ("param", "exp_avg", "exp_avg_sq")
"""Tensor kinds: the parameter, and the AdamW moments shaped and sharded like it."""


def tensor_key(kind: str, name: str) -> str:
    """The manifest name of a parameter's tensor of one kind: "param/layers.0.attn.o.weight"."""
    return f"{kind}/{name}"


@dataclass(frozen=True)
class Chunk:
    """Global rows [start, start + length) along the tensor's split dim, stored in file[key].
    A tensor with no split dim has one chunk, the whole tensor (start 0)."""

    file: str
    key: str
    start: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    global_shape: tuple[int, ...]
    dtype: str
    """torch dtype name, e.g. "float32"."""
    dim: int | None
    """The split dim of the chunks; None = one chunk holding the whole tensor."""
    chunks: tuple[Chunk, ...]


@dataclass
class Manifest:
    step: int
    """Optimizer steps taken."""
    model: dict
    """The ModelConfig, as a dict: the architecture this checkpoint is for."""
    plan: dict[str, str]
    """The sharding plan (module pattern -> style) the chunks were cut by."""
    layout: dict[str, int]
    """The tp, pp and dp sizes of the job that wrote it ({"tp": 2, "pp": 2, "dp": 1}), and
    "ep" when it ran expert parallelism (its expert tensors are row blocks by ep)."""
    tensors: dict[str, TensorEntry]
    """tensor_key(kind, parameter name) -> entry."""
    files: dict[str, dict]
    """File name -> {"bytes": size, "sha256": hex digest}, for every other file of the checkpoint."""
    optimizer: dict = field(default_factory=dict)
    """Optimizer type, hyperparameters, param groups (by parameter name), state keys, step."""
    rng: dict | None = None
    """{"seed": s, "files": {world rank: file}, "keys": [...]}, or None (re-seeded on load)."""
    extra: dict = field(default_factory=dict)
    """Run information: loss history, data settings, tokenizer, token ids, the training config."""
    pipeline: dict | None = None
    """The layer split it was saved with: {"pp", "virtual_stages", "layers": [per virtual stage]};
    None = one stage (a manifest from before pipelines)."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = asdict(self)
        out = {"format": d.pop("format"), "format_version": d.pop("format_version")}
        pipeline = d.pop("pipeline")
        for k, v in d.items():
            out[k] = v
            if k == "layout":
                out["pipeline"] = pipeline  # beside the sizes it splits
        return json.dumps(out, indent=1, sort_keys=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse and check a manifest.json; CheckpointError names the file and the problem."""
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist: not a committed checkpoint")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt manifest, not valid JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a shardwise checkpoint manifest (format {raw.get('format')!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {raw.get('format_version')} is not supported; this shardwise reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            tensors = {
                name: TensorEntry(
                    tuple(e["global_shape"]),
                    e["dtype"],
                    e["dim"],
                    tuple(Chunk(c["file"], c["key"], int(c["start"]), int(c["length"])) for c in e["chunks"]),
                )
                for name, e in raw["tensors"].items()
            }
            return cls(
                step=int(raw["step"]),
                model=dict(raw["model"]),
                plan=dict(raw["plan"]),
                layout={"tp": 1, "pp": 1, "dp": 1} | {k: int(v) for k, v in raw["layout"].items()},
                tensors=tensors,
                files={k: dict(v) for k, v in raw["files"].items()},
                optimizer=dict(raw.get("optimizer") or {}),
                rng=raw.get("rng"),
                extra=dict(raw.get("extra") or {}),
                pipeline=_pipeline(raw.get("pipeline")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: corrupt manifest: missing or malformed field {e}") from None

    def stage_layout(self) -> StageLayout:
        """The layer split the checkpoint was saved with (one stage for a manifest from before pipelines)."""
        num_layers = int(self.model.get("num_layers", 1))
        p = self.pipeline or {"pp": 1, "virtual_stages": 1, "layers": None}
        try:
            return StageLayout.build(num_layers, p["pp"], p["virtual_stages"], p["layers"])
        except StageError as e:
            raise CheckpointError(f"manifest pipeline section does not fit the model: {e}") from None

    def architecture_diff(self, expected: dict) -> list[str]:
        """Fields where this checkpoint's model differs from `expected` (a ModelConfig dict)."""
        keys = sorted(set(self.model) | set(expected))
        # a field the checkpoint predates reads as its default (a model field added since)
        defaults = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
        keys = [k for k in keys if k in self.model or _norm(expected.get(k)) != _norm(defaults.get(k, MISSING))]
        return [
            f"{k}={self.model.get(k)!r} in the checkpoint, {expected.get(k)!r} expected"
            for k in keys
            if _norm(self.model.get(k)) != _norm(expected.get(k))
        ]


def layout_text(layout: dict[str, int], sep: str = " x ") -> str:
    """ "tp=2 x pp=2 x dp=1"; pp is left out when 1 ("tp=2 x dp=1"), as a job without a pipeline reads."""
    keys = ("tp", "pp", "dp") if layout.get("pp", 1) != 1 else ("tp", "dp")
    keys += ("ep",) if layout.get("ep", 1) != 1 else ()
    return sep.join(f"{k}={layout.get(k, 1)}" for k in keys)


def _pipeline(raw) -> dict | None:
    if raw is None:
        return None
    return {
        "pp": int(raw["pp"]),
        "virtual_stages": int(raw["virtual_stages"]),
        "layers": [int(n) for n in raw["layers"]],
    }


def _norm(value):
    """JSON round-trips tuples as lists; compare them alike."""
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    return value
