"""Plain single-device models. Nothing here imports shardwise.comm or torch.distributed.

One config (ModelConfig, with a tiny `ModelConfig.debug()` preset for tests and the
demo), one decoder for every decoder family, one encoder (BERT), built from the shared
blocks in shardwise.models.modules.
"""

from shardwise.models.bert import BertEncoder, BertLayer
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLayer, DecoderLM
from shardwise.models.modules import KVCache
from shardwise.models.pooling import mean_pool

__all__ = ["ModelConfig", "DecoderLM", "DecoderLayer", "BertEncoder", "BertLayer", "KVCache", "mean_pool"]
