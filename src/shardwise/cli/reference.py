"""docs/reference.md, every command's flags, written from the argparse definitions.

    python -m shardwise.cli.reference            # rewrite docs/reference.md
    python -m shardwise.cli.reference --check    # exit 1 when docs/reference.md is stale

The guides link here instead of listing flags, so each flag is described once: by its
`help=` where the parser defines it. tests/unit/test_docs.py fails when the file differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from shardwise.cli.main import build_parser

__all__ = ["render", "main"]

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference.md"
WIDTH = 100  # NOTE: fixed, so that the usage lines do not depend on the terminal


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(command words, parser, one-line help) for every subcommand, depth first, in definition order."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            words = (*path, name)
            yield words, sub, helps.get(name, "")
            yield from _commands(sub, words)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action, formatter: argparse.HelpFormatter) -> tuple[str, str, str]:
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
        flag = ", ".join(f"`{s}{metavar}`" for s in action.option_strings)
    else:
        flag = f"`{formatter._format_args(action, action.dest)}`"
    default = action.default
    if action.nargs == 0 or default is None or default is argparse.SUPPRESS or default == []:
        shown = ""
    else:
        shown = f"`{default}`"
    text = formatter._expand_help(action) if action.help else ""
    if action.choices is not None and "{" not in flag:  # choices the metavar does not show
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return flag, shown, _cell(text)


def render() -> str:
    """The whole of docs/reference.md."""
    root = build_parser()
    out = [
        "# Command reference",
        "",
        "Every `shardwise` command and flag, with its default. Generated from the argparse",
        "definitions by `python -m shardwise.cli.reference`; do not edit by hand",
        "(tests/unit/test_docs.py fails when this file is stale). The guides in this folder",
        "show what to type for each task; this page is where each flag is described.",
        "",
    ]
    commands = list(_commands(root))
    out += [f"- [`shardwise {' '.join(w)}`](#{_anchor(w)}): {_cell(h)}" for w, _, h in commands]
    for words, parser, help_text in commands:
        formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
        formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
        out += ["", f"## shardwise {' '.join(words)}", ""]
        if parser.description or help_text:
            out += [_cell(parser.description or help_text), ""]
        out += ["```", formatter.format_help().strip(), "```"]
        rows = [
            _option(a, formatter)
            for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if rows:
            out += ["", "| flag | default | meaning |", "|---|---|---|"]
            out += [f"| {flag} | {default} | {text} |" for flag, default, text in rows]
    return "\n".join(out) + "\n"


def _anchor(words: tuple[str, ...]) -> str:
    """GitHub's anchor for the heading `shardwise <words>`."""
    return "-".join(("shardwise", *words)).lower()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwise.cli.reference", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file is stale; write nothing")
    p.add_argument("--out", type=Path, default=REFERENCE, help="where to write (default: docs/reference.md)")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: python -m shardwise.cli.reference", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
