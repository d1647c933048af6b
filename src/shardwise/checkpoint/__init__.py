"""Sharded checkpoints: atomic save, load at any tp x pp x dp size, offline reshard, Hugging Face export."""

from shardwise.checkpoint.files import SafetensorsWriter
from shardwise.checkpoint.load import check_compatible, load_checkpoint
from shardwise.checkpoint.manager import Checkpointer
from shardwise.checkpoint.manifest import FORMAT, FORMAT_VERSION, CheckpointError, Chunk, Manifest, TensorEntry
from shardwise.checkpoint.reader import CheckpointReader, resolve_checkpoint
from shardwise.checkpoint.reshard import Read, assemble, check_cover, plan_reads
from shardwise.checkpoint.save import committed_steps, save_checkpoint

__all__ = [
    "SafetensorsWriter",
    "check_compatible",
    "load_checkpoint",
    "Checkpointer",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "Chunk",
    "Manifest",
    "TensorEntry",
    "CheckpointReader",
    "resolve_checkpoint",
    "Read",
    "assemble",
    "check_cover",
    "plan_reads",
    "committed_steps",
    "save_checkpoint",
]
