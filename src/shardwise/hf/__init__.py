"""Hugging Face checkpoints: config and name adapters, and sharded loading from safetensors."""

import shardwise.hf.bert  # noqa: F401  (registers the BERT family)
from shardwise.hf.checkpoint import Checkpoint, CheckpointError
from shardwise.hf.families import FAMILIES, Family, family_for, supported_model_types
from shardwise.hf.load import LoadReport, check_tp, load_pretrained, read_config

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "FAMILIES",
    "Family",
    "family_for",
    "supported_model_types",
    "LoadReport",
    "check_tp",
    "load_pretrained",
    "read_config",
]
