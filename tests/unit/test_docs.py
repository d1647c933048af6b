"""The docs stay true: the flag reference is current, links resolve, runnable examples run.

A command block in README.md or docs/**/*.md is runnable when the line before its fence is
`<!-- runnable -->` (run by `make test`) or `<!-- runnable full -->` (slower: `make
test-more`). Each `$ shardwise ...` line in it runs as `python -m shardwise ...` from a
scratch folder that has the repository's configs/, data/ and src/, and must exit 0 (or N,
where its output shows a line `(exit status N)`); the
lines after it are its output as shown: each, numbers aside, must appear in the real
output (`...` stands for any text: a line of it for lines left out). Commands of one block run in turn, so a later
one may use what an earlier one wrote.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from processes import run_cli_inline
from shardwise.cli import reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
INLINE = {"info", "plan"}  # answer without starting ranks: run in this process (no interpreter start)


def test_reference_is_current():
    """docs/reference.md is what the argparse definitions say today."""
    current = reference.REFERENCE.read_text() if reference.REFERENCE.exists() else ""
    assert current == reference.render(), "docs/reference.md is stale: python -m shardwise.cli.reference"


# --- links ---------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> list[str]:
    """The file's lines outside fenced code blocks, inline code spans blanked (their brackets
    are not links), other lines kept empty so that line numbers hold."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation
    other than - and _ dropped, spaces as -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_links_resolve():
    """Every relative link and #anchor in README.md and docs/**/*.md points at something."""
    broken = []
    cache: dict[Path, set[str]] = {}
    for doc in DOCS:
        for number, line in enumerate(_prose(doc.read_text()), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (doc.parent / path_part).resolve() if path_part else doc
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_matches_github():
    assert slug("Quantized weights (`--quantize fp16|int8`)") == "quantized-weights---quantize-fp16int8"
    assert slug("Pipeline stages: tp x pp") == "pipeline-stages-tp-x-pp"
    assert slug("GGUF files, loaded sharded (`--model FILE.gguf`)") == "gguf-files-loaded-sharded---model-filegguf"


# --- runnable command blocks -----------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    full: bool
    steps: tuple[tuple[str, tuple[str, ...]], ...]  # (command line, its output as shown)

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def runnable_blocks() -> list[Block]:
    blocks = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            marker = re.fullmatch(r"\s*<!--\s*runnable(\s+full)?\s*-->\s*", line)
            if not marker:
                continue
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{doc}:{i + 1}: a runnable marker needs a fence"
            body = []
            for text in lines[i + 2 :]:
                if FENCE.match(text):
                    break
                body.append(text)
            blocks.append(Block(doc, i + 2, bool(marker.group(1)), _steps(body, f"{doc}:{i + 2}")))
    return blocks


def _steps(body: list[str], where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    steps: list[tuple[str, list[str]]] = []
    pending = ""
    for text in body:
        if pending or text.startswith("$ "):
            command = pending + (text[2:] if not pending else " " + text.strip())
            pending = command[:-1].rstrip() if command.endswith("\\") else ""
            if not pending:
                assert command.startswith("shardwise "), f"{where}: a runnable block runs only shardwise: {command}"
                steps.append((command, []))
            continue
        assert steps, f"{where}: a runnable block starts with a `$ shardwise ...` line"
        steps[-1][1].append(text)
    return tuple((c, tuple(out)) for c, out in steps)


NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?")


def _shape(line: str) -> str:
    """A line with its numbers (timings, sizes) made equal: what a docs example promises."""
    return NUMBER.sub("N", " ".join(line.split()))


def check_output(shown, real: str) -> str | None:
    """None when every shown line appears in the real output, numbers aside, `...` inside a
    line standing for any text (a path, say). stdout and stderr interleave, so order is
    not checked."""
    lines = [_shape(x) for x in real.splitlines()]
    for want in shown:
        if not want.strip() or want.strip() == "...":
            continue
        pattern = re.compile(".*".join(map(re.escape, _shape(want).split("..."))))
        if not any(pattern.search(line) for line in lines):
            return f"shown but not printed: {want!r}"
    return None


EXIT = re.compile(r"\(exit status (\d+)\)")


def expected_status(shown) -> int:
    """A shown line `(exit status N)` says the command exits N (a refusal: 2); else 0."""
    codes = [int(m.group(1)) for x in shown if (m := EXIT.fullmatch(x.strip()))]
    return codes[0] if codes else 0


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    args = shlex.split(command)[1:]
    if args[0] in INLINE:
        old = Path.cwd()
        os.chdir(cwd)
        try:
            return run_cli_inline(*args)
        finally:
            os.chdir(old)
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _params():
    for block in runnable_blocks():
        marks = [pytest.mark.full] if block.full else []
        if any(shlex.split(c)[1] not in INLINE for c, _ in block.steps):
            marks.append(pytest.mark.slow)  # starts ranks: not in `make test-fast`
        yield pytest.param(block, id=block.name, marks=marks)


def test_some_blocks_are_runnable():
    """The README's tour is run (its commands are the ones a newcomer types first)."""
    assert any(b.doc.name == "README.md" for b in runnable_blocks())


_LONE: dict[str, subprocess.CompletedProcess] = {}


@pytest.mark.timeout(600)  # a block may start several jobs (train, then resume)
@pytest.mark.parametrize("block", list(_params()))
def test_runnable_block(block: Block, tmp_path):
    for name in ("configs", "data", "src"):
        (tmp_path / name).symlink_to(ROOT / name)
    for command, shown in block.steps:
        if len(block.steps) == 1:  # the same lone command in two docs (README and a guide) runs once
            if command not in _LONE:
                _LONE[command] = _run(command, tmp_path)
            out = _LONE[command]
        else:
            out = _run(command, tmp_path)
        want = expected_status(shown)
        assert out.returncode == want, f"{block.name}: `{command}` exited {out.returncode}:\n{out.stderr[-3000:]}"
        problem = check_output([x for x in shown if not EXIT.fullmatch(x.strip())], out.stdout + out.stderr)
        assert problem is None, f"{block.name}: `{command}`: {problem}\n--- real output:\n{out.stdout}{out.stderr}"


@pytest.mark.full
@pytest.mark.timeout(300)
def test_the_readme_serve_step_answers_as_shown(tmp_path):
    """The tour's serve step: the README's `$ shardwise serve ...` line starts a server (on a
    free port), and its openai snippet, pointed at it, prints the text its comment shows."""
    pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    import time

    from shardwise.launch import free_port

    text = (ROOT / "README.md").read_text()
    command = next(line[2:] for line in text.splitlines() if line.startswith("$ shardwise serve"))
    snippet = re.search(r"```python\n(from openai import OpenAI\n.*?)```", text, re.S).group(1)
    shown_port = re.search(r"--port (\d+)", command).group(1)
    port = str(free_port())
    argv = [sys.executable, "-m", "shardwise", *shlex.split(command.replace(shown_port, port))[1:]]
    log = tmp_path / "serve.log"
    segments = set(Path("/dev/shm").glob("mpich_shm_*"))
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        out = subprocess.run(
            [sys.executable, "-c", snippet.replace(shown_port, port)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        expected = re.search(r"print\(repr\(out\.choices\[0\]\.text\)\)\s*#\s*('(?:[^'\\]|\\.)*')", snippet).group(1)
        assert out.stdout.strip() == expected, f"the README shows {expected}, the server answered {out.stdout.strip()}"
    finally:
        proc.terminate()
        proc.wait(30)
    # stopped by SIGTERM, its ranks (MPI here, where mpiexec is found) killed before MPI_Finalize:
    # the launcher removes the shared-memory segments they made (2 MB each, left at every run before)
    left = [p.name for p in set(Path("/dev/shm").glob("mpich_shm_*")) - segments if not _mapped(p)]
    assert left == [], f"the stopped server left MPICH segments: {left}"


def _mapped(path: Path) -> bool:
    """Whether any live process maps the file `path`."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if str(path) in maps.read_text():
                return True
        except OSError:
            continue
    return False
