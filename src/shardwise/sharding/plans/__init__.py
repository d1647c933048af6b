"""Sharding plans for shardwise's own model families, written as data, and the tp sizes
they can split a model by."""

from shardwise.sharding.plans.bert import bert_plan
from shardwise.sharding.plans.decoder import attention_plan, decoder_plan, layer_plan, mlp_plan
from shardwise.sharding.plans.tp import Balance, balance, check_tp, even_tp_sizes, model_tp_sizes

__all__ = [
    "attention_plan",
    "mlp_plan",
    "layer_plan",
    "decoder_plan",
    "bert_plan",
    "model_tp_sizes",
    "even_tp_sizes",
    "check_tp",
    "Balance",
    "balance",
]
