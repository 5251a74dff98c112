"""Sphinx configuration: the API reference (autodoc over the public packages) and the markdown docs.

Build: ``python3 -m sphinx -W --keep-going -b html docs build/docs`` (tests/test_docs_build.py
runs the same build with warnings as errors).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

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
# No undoc-members: a public class or function without a docstring gets no entry, and
# tests/test_docs_build.py names it.
autodoc_default_options = {"members": True, "show-inheritance": True}
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
# under ``shm`` where they are defined, so that each object has one entry to link to. Constants
# are left to ``public-extras`` below: automodule finds one only where a ``#:`` comment precedes
# its definition in the package itself, and never one imported from a private module.
_documenting: list[str] = [""]


def _note_module(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    if what == "module":
        _documenting[0] = name


def _is_data(obj: object) -> bool:
    return not isinstance(obj, (type, types.ModuleType)) and not callable(obj)


def _skip_reexport(app: object, what: str, name: str, obj: object, skip: bool, options: object) -> bool | None:
    if what != "module":
        return None
    here, there = _documenting[0].partition(".")[0], str(getattr(obj, "__module__", "")).partition(".")[0]
    return True if _is_data(obj) or (there in {"shm", "aiospec"} and there != here) else None


class PublicExtras(SphinxDirective):
    """``.. public-extras:: shm``: an ``autodata`` for each constant in the package's ``__all__``
    (``SHM_DIR``) and an ``automodule`` for each module in it (``shm.layout``), so that a name
    made public is documented without editing api.rst."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        package = importlib.import_module(self.arguments[0])
        source = self.get_source_info()[0]
        lines = StringList()
        for name in package.__all__:
            full, obj = f"{package.__name__}.{name}", getattr(package, name)
            if isinstance(obj, types.ModuleType):
                rst = [f".. rubric:: ``{full}``", "", f".. automodule:: {full}", ""]
            elif _is_data(obj):
                rst = [f".. autodata:: {full}", ""]
            else:
                continue
            for line in rst:
                lines.append(line, source)
        container = nodes.container()
        self.state.nested_parse(lines, self.content_offset, container)
        return list(container.children)


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _note_module)
    app.connect("autodoc-skip-member", _skip_reexport)
    app.add_directive("public-extras", PublicExtras)
