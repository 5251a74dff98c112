"""The examples in README.md and docs/*.md run as written, and name only options that exist.

Every fenced block names its language. Each ```python block is run on its own (CPU only, fresh
namespace, a 60 s limit) with top-level ``await`` / ``async with`` / ``async for`` allowed; the
traceback points at the markdown line. Other fences (```text, ```json, ```bash) are not run.

A fragment is completed in the markdown itself, by an HTML comment right before its fence
(invisible when rendered, next to the example when someone edits it)::

    <!-- example
    setup:
        <python run before the block, same namespace: the names the fragment takes as given>
    wrap: async def respond():
    check:
        <python run after the block: what the example must have done>
    -->

``wrap:`` runs the block as the body of that function (for a fragment with ``yield``); ``check``
then calls it. ``raises: <exception>`` says the block ends by raising it (a reading loop that
ends when its producers go away), then ``check`` runs. ``skip: <reason>`` (for example
``skip: needs a CUDA GPU``) skips the block with that reason. What the setups use comes from
tests/_docshelpers.py. Producers and rings an example leaves in its namespace are closed after it.
Each option check below says which wrong option or default it found; fix the document.

Shell examples: every ``--option`` named near an ``aiospec <command>`` (same line, table row or
paragraph, or the section whose heading names the command) or a ``scripts/<name>.py`` must be one
of that command's options, and a default the doc gives for it ("``--opt``, default ``x``",
"``--opt`` (default 3)", "2 ms by default, ``--opt``") must be the parser's default.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the first line of code
    lang: str
    code: str
    marker: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marker(text: str) -> dict[str, str]:
    """The sections of an ``<!-- example ... -->`` comment: ``name: value`` or ``name:`` + an indented body."""
    out: dict[str, str] = {}
    key = None
    body: list[str] = []
    for raw in text.splitlines():
        m = re.match(r"^(setup|wrap|raises|check|skip):\s*(.*)$", raw)
        if m:
            if key is not None:
                out[key] = textwrap.dedent("\n".join(body)).strip("\n")
            key, body = m.group(1), [m.group(2)] if m.group(2) else []
        elif key is not None:
            body.append(raw)
        elif raw.strip():
            raise ValueError(f"example comment: {raw!r} outside a setup/wrap/raises/check/skip section")
    if key is not None:
        out[key] = textwrap.dedent("\n".join(body)).strip("\n")
    return out


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(2).strip()
        j = i + 1
        while j < len(lines) and not _FENCE.match(lines[j]):
            j += 1
        code = textwrap.dedent("\n".join(lines[start + 1 : j]))
        # the comment that ends on the last non-blank line before the fence
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker: dict[str, str] = {}
        if k >= 0 and lines[k].strip() == "-->":
            top = k
            while top >= 0 and not lines[top].lstrip().startswith("<!--"):
                top -= 1
            if top >= 0 and lines[top].strip() == "<!-- example":
                marker = _marker("\n".join(lines[top + 1 : k]))
        yield Block(path, start + 2, lang, code, marker)
        i = j + 1


ALL_BLOCKS = [b for p in DOCUMENTS for b in blocks(p)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]


def test_the_documents_have_python_examples() -> None:
    assert {b.path.name for b in PYTHON} >= {"README.md", "emit-op.md", "streams.md"}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_example_comment_is_read(doc: Path) -> None:
    # one misplaced (not right before its fence) or misspelt would silently not apply
    comments = len(re.findall(r"^<!-- example$", doc.read_text(), flags=re.M))
    assert comments == len(re.findall(r"^\s*<!--\s*example", doc.read_text(), flags=re.M | re.I))
    assert comments == sum(1 for b in ALL_BLOCKS if b.path == doc and b.marker)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_every_fence_names_its_language(block: Block) -> None:
    # A bare fence could hide an example that never runs: say what it is (```text for diagrams
    # and output samples, ```json, ```bash, ```python).
    assert block.lang in {"python", "bash", "text", "json", "c"}, f"{block.id}: fence ```{block.lang}"
    if block.lang == "json":
        import json

        for chunk in _json_values(block.code):
            json.loads(chunk)
    if block.marker:
        assert block.lang == "python", f"{block.id}: an example comment before a ```{block.lang} block"


def _json_values(text: str) -> Iterator[str]:
    """One JSON document, or one per line (the benchmarks print JSON lines; an excerpt of an
    object is its ``"key": value`` lines)."""
    import json

    try:
        json.loads(text)
    except ValueError:
        for line in filter(str.strip, text.splitlines()):
            yield "{" + line.rstrip(",") + "}" if re.match(r'^\s*"[^"]*": ', line) else line
    else:
        yield text


def _source(block: Block) -> tuple[str, int]:
    """The block's code (wrapped when asked), padded so that line numbers are the markdown's."""
    if "wrap" in block.marker:
        return block.marker["wrap"] + "\n" + textwrap.indent(block.code, "    "), block.line - 1
    return block.code, block.line


def _close(ns: dict[str, object]) -> None:
    """Close the producers and rings an example leaves open (a worker keeps them for its life)."""
    from _docshelpers import Engine

    import shm
    from aiospec.ops import Producer

    for value in [v for v in ns.values() if isinstance(v, (Engine, Producer))]:
        value.close()
    for value in [v for v in ns.values() if isinstance(v, shm.Ring) and not v.closed]:
        value.close()


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_example_runs(block: Block) -> None:
    if "skip" in block.marker:
        pytest.skip(f"{block.id}: {block.marker['skip']}")
    code, line = _source(block)
    pieces = [(block.marker.get("setup", ""), "setup"), (code, ""), (block.marker.get("check", ""), "check")]
    ns: dict[str, object] = {"__name__": "__doc_example__"}

    async def execute(src: str, part: str) -> None:
        # the setup and check live in the comment above the fence: point at the fence line
        name = str(block.path) if not part else f"{block.path} (the example's {part}, above line {block.line})"
        padded = "\n" * (line - 1) + src if not part else src
        compiled = compile(padded, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        result = eval(compiled, ns)
        if inspect.iscoroutine(result):
            await result

    async def run() -> None:
        for src, part in pieces:
            if not src:
                continue
            if part or "raises" not in block.marker:
                await execute(src, part)
                continue
            expected = eval(block.marker["raises"], ns)
            with pytest.raises(expected):
                await execute(src, part)

    async def bounded() -> None:
        await asyncio.wait_for(run(), 60)

    try:
        asyncio.run(bounded())
    finally:
        _close(ns)


# -- shell examples: options and defaults -------------------------------------------------------------


def _aiospec_commands() -> dict[str, argparse.ArgumentParser]:
    from aiospec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> dict[str, object]:
    out = {s: a.default for a in p._actions for s in a.option_strings if a.help is not argparse.SUPPRESS}
    for a in p._actions:  # a command with subcommands of its own (`aiospec bridge send`): theirs too
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                for k, v in _options(sub).items():
                    out.setdefault(k, v)
    return out


def _helps(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help text, the subcommands' (as in _options) included."""
    out = {s: a.help or "" for a in p._actions for s in a.option_strings}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                for k, v in _helps(sub).items():
                    out.setdefault(k, v)
    return out


def _script_options(script: Path) -> dict[str, str]:
    """A script's options from its ``--help`` (its parser is built inside ``main``)."""
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, f"{script.name} --help: {r.stderr[-2000:]}"
    return {o: "" for o in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", r.stdout)}


@pytest.fixture(scope="module")
def commands() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {f"aiospec {n}": _options(p) for n, p in _aiospec_commands().items()}
    for script in sorted((ROOT / "scripts").glob("*.py")):
        if "argparse" in script.read_text():
            out[f"scripts/{script.name}"] = dict(_script_options(script))
    return out


_COMMAND = re.compile(r"\baiospec (?P<sub>[a-z][a-z-]*)|\b(?P<script>scripts/[\w]+\.py)")
_LONG = re.compile(r"(?<![\w$-])(--[a-z][a-z0-9-]*)")
_SHORT = re.compile(r"`(-[a-zA-Z])[` ]")
# the same docs mention other programs' options; each with why it is not ours
_FOREIGN = {
    ("docs/emit-op.md", "--version"): "the compiler's --version, hashed into the build cache key",
    ("docs/server.md", "--http2"): "curl's --http2, whose h2c upgrade request the server serves as HTTP/1.1",
}


def _paragraphs(path: Path) -> Iterator[tuple[str, str, str]]:
    """(section, heading, text) per paragraph, list item, table row or code line, in order.

    The section is the last heading of level 1 or 2 (its ``###`` parts belong to it), the
    heading the last one of any level."""
    section = heading = ""
    para: list[str] = []
    in_fence = False
    for line in [*path.read_text().splitlines(), ""]:
        if para and (
            in_fence
            or _FENCE.match(line)
            or not line.strip()
            or line.startswith(("|", "#", "    ", "- ", "* "))
            or re.match(r"^\d+\. ", line)
        ):
            yield section, heading, " ".join(para)
            para = []
        if _FENCE.match(line):
            in_fence = not in_fence
        elif in_fence or line.startswith(("|", "    ")):
            yield section, heading, line
        elif line.startswith("#"):
            heading = line
            if not line.startswith("###"):
                section = line
        elif line.strip():
            para.append(line.strip())


def _named(text: str) -> list[str]:
    return [f"aiospec {m.group('sub')}" if m.group("sub") else m.group("script") for m in _COMMAND.finditer(text)]


def _mentions(path: Path, commands: dict[str, dict[str, object]]) -> Iterator[tuple[str, str, str]]:
    """(option, the text around it, the command it belongs to) for every long option in a document."""
    # Owner of an option: the last command named before it in its paragraph; else the one its
    # heading names; else any command named in its section, or any aiospec command (an option
    # in prose such as "the engine's `--max-batch` slots" belongs to some command).
    section_commands: dict[str, list[str]] = {}
    for section, heading, text in _paragraphs(path):
        seen = section_commands.setdefault(section, [])
        seen += [n for n in _named(section + " " + heading + " " + text) if n in commands and n not in seen]
    everyone = [c for c in commands if c.startswith("aiospec ")]
    for section, heading, text in _paragraphs(path):
        in_heading = [n for n in _named(heading) if n in commands]
        for m in _LONG.finditer(text):
            named = [c for c in _named(text[: m.start()]) if c in commands]
            if named:  # "starts `aiospec serve` ..." in the demo's section may still mean the demo's option
                owner = "|".join(dict.fromkeys([named[-1], *in_heading]))
            elif in_heading:
                owner = in_heading[0]
            else:
                owner = "|".join(dict.fromkeys(section_commands[section] + everyone))
            yield m.group(1), text, owner
        # a short option ("`-c` concurrency") is one only where the heading names the command
        for m in _SHORT.finditer(text) if in_heading else ():
            yield m.group(1), text, "|".join(in_heading)


DOC_NAMES = [str(p.relative_to(ROOT)) for p in DOCUMENTS]


@pytest.mark.parametrize("doc", DOC_NAMES)
def test_every_option_a_document_names_exists(doc: str, commands: dict[str, dict[str, object]]) -> None:
    wrong = []
    for option, text, owner in _mentions(ROOT / doc, commands):
        if (doc, option) in _FOREIGN:
            continue
        if not any(option in commands[c] for c in owner.split("|")):
            wrong.append(f"{option} (for {owner}) in: {text.strip()[:160]}")
    assert wrong == []


# "`--opt`, default `x`", "`--opt` (default 3)", "`--opt` (default: `x`)" and "2 ms by default, ... `--opt`"
# (no other code span in between, so a default is the nearest option's; a number after ":" is a port)
_DEFAULT_AFTER = re.compile(r"`(--[a-z][a-z0-9-]*)`[^`]{0,40}?\bdefault:? (`[^`]+`|-?\d[\d.]*)")
_DEFAULT_BEFORE = re.compile(
    r"(?<![\w:.])(-?\d[\d.]*)(?: ?[a-zA-Z]+)? by default(?:[^.;]|\.\w){0,60}?`(--[a-z][a-z0-9-]*)`"
)


def _same(doc_value: str, default: object, option: str, help_text: str) -> bool:
    value = doc_value.strip("`")
    if value.startswith("$"):  # read from the environment: the help must say which variable
        return value in help_text
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == str(default)


@pytest.mark.parametrize("doc", DOC_NAMES)
def test_every_default_a_document_states_is_the_parsers(doc: str, commands: dict[str, dict[str, object]]) -> None:
    parsers = _aiospec_commands()
    helps = {f"aiospec {n}": _helps(p) for n, p in parsers.items()}
    checked, wrong = 0, []
    for option, text, owner in _mentions(ROOT / doc, commands):
        stated = [m.group(2) for m in _DEFAULT_AFTER.finditer(text) if m.group(1) == option]
        stated += [m.group(1) for m in _DEFAULT_BEFORE.finditer(text) if m.group(2) == option]
        for value in stated:
            for c in owner.split("|"):
                if c in helps and option in commands[c]:  # aiospec commands: the parser's own default
                    checked += 1
                    if not _same(value, commands[c][option], option, helps[c][option]):
                        wrong.append(f"{c} {option}: the doc says {value}, the parser {commands[c][option]!r}")
    assert wrong == []
    if doc == "docs/server.md":
        assert checked >= 3  # the pattern still finds the defaults server.md states
