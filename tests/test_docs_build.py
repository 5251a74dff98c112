"""The API reference builds from the docstrings with warnings as errors, and covers the public surface.

``docs/conf.py`` configures Sphinx (autodoc + napoleon over the public packages, myst-parser for
the markdown documents); ``docs/api.rst`` is the reference. A docstring that is not valid
reStructuredText, a document left out of the toctree or a public name the reference does not
show fails here. Sphinx comes with the ``docs`` extra, which ``test`` includes.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Each package whose ``__all__`` the reference documents (docs/api.rst has one section each).
PUBLIC = ("shm", "aiospec", "aiospec.ops", "aiospec.openai", "aiospec.integrations.fastdeploy", "aiospec.bridge")


@pytest.fixture(scope="module")
def html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sphinx", reason="sphinx is not installed: pip install -e '.[docs]' (the test extra has it)")
    pytest.importorskip("myst_parser", reason="myst-parser is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("html")
    # A child process, as a maintainer runs it: -E a fresh environment, -W --keep-going every
    # warning reported and any of them fails the build.
    r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-q", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"sphinx-build failed; fix the rST where it points:\n{r.stderr[-6000:]}"
    return out


def test_the_reference_builds_without_warnings(html: Path) -> None:
    assert (html / "index.html").is_file() and (html / "api.html").is_file()


def test_every_markdown_document_is_in_the_build(html: Path) -> None:
    for md in DOCS.glob("*.md"):
        assert (html / md.with_suffix(".html").name).is_file(), md.name


def test_every_public_name_has_an_entry(html: Path) -> None:
    text = (html / "api.html").read_text()
    ids = set(re.findall(r'<dt class="sig sig-object py" id="([^"]+)"', text))
    ids |= set(re.findall(r'id="module-([^"]+)"', text))
    missing = []
    for package in PUBLIC:
        mod = importlib.import_module(package)
        for name in mod.__all__:
            obj = getattr(mod, name)
            home = "" if isinstance(obj, types.ModuleType) else str(getattr(obj, "__module__", package))
            # aiospec re-exports the ring's names; they are documented once, under shm.
            where = f"shm.{name}" if home.partition(".")[0] == "shm" and package != "shm" else f"{package}.{name}"
            if where not in ids:
                missing.append(where)
    # A constant has no docstring for automodule to find: give it an ``autodata`` line in
    # docs/api.rst; a public submodule (``shm.layout``) its own ``automodule`` section there.
    assert missing == []
