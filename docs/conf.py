"""Sphinx configuration: the API reference (autodoc over the public packages) and the markdown docs.

Build: ``python3 -m sphinx -W --keep-going -b html docs build/docs`` (tests/test_docs_build.py
runs the same build with warnings as errors).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Document the checkout these docs belong to, not whatever aiospec happens to be installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

project = "aiospec"
author = "the aiospec authors"
copyright = "the aiospec authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "build"]

# The reference follows each package's ``__all__`` (automodule's default when it is set), so it
# documents the public names where users import them from, whichever private module defines them.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"

# A type hint such as ``bytes`` is looked up fuzzily and also matches attributes of that name
# (``TopLogprob.bytes``); Sphinx >= 8 warns of the ambiguity, which is no mistake in the docstrings.
suppress_warnings = ["ref.python"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

myst_heading_anchors = 3

html_theme = "alabaster"


# ``aiospec`` re-exports the ring's names (``aiospec.Ring``, the errors); they are documented once,
# under ``shm`` where they are defined, so that each object has one entry to link to.
_documenting: list[str] = [""]


def _note_module(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    if what == "module":
        _documenting[0] = name


def _skip_reexport(app: object, what: str, name: str, obj: object, skip: bool, options: object) -> bool | None:
    if what != "module":
        return None
    here, there = _documenting[0].partition(".")[0], str(getattr(obj, "__module__", "")).partition(".")[0]
    return True if there in {"shm", "aiospec"} and there != here else None


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _note_module)
    app.connect("autodoc-skip-member", _skip_reexport)
