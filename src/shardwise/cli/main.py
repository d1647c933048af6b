"""`shardwise` console script: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from shardwise import __version__
from shardwise.cli import bench, checkpoint, demo, embed, eval_ppl, generate, info, plan, serve, train, verify

__all__ = ["main", "build_parser"]

SUBCOMMANDS = {
    "bench": bench,
    "generate": generate,
    "info": info,
    "demo": demo,
    "verify": verify,
    "embed": embed,
    "serve": serve,
    "train": train,
    "checkpoint": checkpoint,
    "plan": plan,
    "eval-ppl": eval_ppl,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description="Tensor parallelism for PyTorch.")
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
