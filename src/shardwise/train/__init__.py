"""Training on a tp x dp mesh: config, data, RNG streams, optimizer (plain or distributed over
dp), dp sync, step and loop."""

from shardwise.train.config import (
    ConfigError,
    DataSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    TrainConfig,
)
from shardwise.train.data import DataError, DPSampler, TokenFile, tokenize_text, write_token_file
from shardwise.train.distopt import DistributedOptimizer, bytes_per_param, held_bytes
from shardwise.train.experts import ExpertLayout, router_aux_loss, unsharded_state
from shardwise.train.layout import all_rank_specs, build_model, full_state, owned_intervals, rank_specs, train_plan
from shardwise.train.loop import Checkpointing, TrainResult, model_config, plot_losses, setup, token_file, train
from shardwise.train.optim import GradNorm, build_optimizer, lr_at
from shardwise.train.rng import RNGTracker
from shardwise.train.step import StepStats, Trainer, train_step
from shardwise.train.sync import BucketedSync, DDPSync, ExpertParallelSync, GradSync, NoSync, make_grad_sync

__all__ = [
    "ConfigError",
    "DataSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "RunSection",
    "TrainConfig",
    "DataError",
    "DPSampler",
    "TokenFile",
    "tokenize_text",
    "write_token_file",
    "DistributedOptimizer",
    "bytes_per_param",
    "held_bytes",
    "all_rank_specs",
    "build_model",
    "full_state",
    "owned_intervals",
    "rank_specs",
    "train_plan",
    "ExpertLayout",
    "router_aux_loss",
    "unsharded_state",
    "Checkpointing",
    "TrainResult",
    "model_config",
    "plot_losses",
    "setup",
    "token_file",
    "train",
    "GradNorm",
    "build_optimizer",
    "lr_at",
    "RNGTracker",
    "StepStats",
    "Trainer",
    "train_step",
    "BucketedSync",
    "DDPSync",
    "ExpertParallelSync",
    "GradSync",
    "NoSync",
    "make_grad_sync",
]
