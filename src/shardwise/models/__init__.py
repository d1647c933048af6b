"""Plain single-device models. Nothing here imports shardwise.comm or torch.distributed."""

from shardwise.models.blocks import MLP, Attention, BlockConfig, GatedMLP, TinyLM, TransformerBlock

__all__ = ["BlockConfig", "Attention", "GatedMLP", "MLP", "TransformerBlock", "TinyLM"]
