"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

The config reference page holds a marker that is replaced, at every build, by the reference generated
from the pydantic models (:mod:`rollart.config_reference`), so the page cannot fall behind the code.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from rollart.config_reference import markdown as reference

    return markdown.replace(MARKER, reference())
