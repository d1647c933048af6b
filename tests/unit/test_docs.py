"""The docs stay true: the flag reference is current, links resolve, runnable examples run."""

from __future__ import annotations

from shardwise.cli import reference


def test_reference_is_current():
    """docs/reference.md is what the argparse definitions say today."""
    current = reference.REFERENCE.read_text() if reference.REFERENCE.exists() else ""
    assert current == reference.render(), "docs/reference.md is stale: python -m shardwise.cli.reference"
