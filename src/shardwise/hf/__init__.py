"""Hugging Face checkpoints: the family table, config and name adapters, and sharded
loading from safetensors (family code or the automatic plan, decided in one place)."""

from shardwise.hf.checkpoint import Checkpoint, CheckpointError, raw_config
from shardwise.hf.families import FAMILIES, Family, family_for, supported_model_types
from shardwise.hf.fill import DTYPES, LoadReport
from shardwise.hf.load import ResolvedModel, load_pretrained, loaded_config, read_config, resolve_model

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "raw_config",
    "FAMILIES",
    "Family",
    "family_for",
    "supported_model_types",
    "DTYPES",
    "LoadReport",
    "ResolvedModel",
    "resolve_model",
    "read_config",
    "load_pretrained",
    "loaded_config",
]
