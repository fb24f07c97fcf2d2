"""Tables of ``rollart status`` and ``rollart jobs``: readable in an 80-column terminal.

By default each table shows its short columns, one line per row: a cell too long for the terminal is cut
with an ellipsis, never wrapped. ``--wide`` shows every column, wrapping long cells; ``--json`` prints
every field.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Cell = Callable[[dict[str, Any]], str]


def short_time(value: Any) -> str:
    """An epoch time as ``MM-DD HH:MM`` (local time); '' for none."""
    if value in (None, "", 0):
        return ""
    try:
        return time.strftime("%m-%d %H:%M", time.localtime(float(value)))
    except (TypeError, ValueError, OverflowError):
        return str(value)


def full_time(value: Any) -> str:
    """An epoch time as ``YYYY-MM-DD HH:MM:SS`` (local time); '' for none."""
    if value in (None, "", 0):
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(value)))
    except (TypeError, ValueError, OverflowError):
        return str(value)


def short_path(path: Any) -> str:
    """A folder as the user would type it here: relative to the working directory when under it, else
    ``~/...`` under the home folder, else as it is."""
    if not path:
        return ""
    p = Path(str(path))
    for base, shown in ((Path.cwd(), ""), (Path.home(), "~")):
        try:
            rel = p.relative_to(base)
        except ValueError:
            continue
        text = str(rel) if not shown else f"~/{rel}"
        return text if text not in ("", ".") else (shown or ".")
    return str(p)


@dataclass(frozen=True)
class Column:
    """A table column: its header, its cell of a row, and whether it gives way (cut with an ellipsis)
    when the table is wider than the terminal (a name, a folder, a message: never an id or a state)."""

    header: str
    cell: Cell
    flex: bool = False


def terminal_width() -> int:
    """``$COLUMNS``, else the terminal's width, else 80."""
    return shutil.get_terminal_size((80, 24)).columns


def fit_widths(natural: list[int], minimum: list[int], flex: list[bool], limit: int, gap: int = 2) -> list[int]:
    """Column widths within ``limit`` (with ``gap`` between columns): the flexible columns give way, the
    widest first, down to their ``minimum``; the others keep their ``natural`` width."""
    widths = list(natural)
    excess = sum(widths) + gap * (len(widths) - 1) - limit
    while excess > 0:
        shrinkable = [i for i, f in enumerate(flex) if f and widths[i] > minimum[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        others = [widths[i] for i in shrinkable if i != widest]
        step = min(excess, widths[widest] - max(minimum[widest], max(others, default=0)) or 1)
        widths[widest] -= step
        excess -= step
    return widths


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def print_table(
    console: Any,
    title: str,
    rows: Sequence[dict[str, Any]],
    short: Sequence[Column],
    wide: Sequence[Column] = (),
    *,
    show_wide: bool = False,
    width: int | None = None,
) -> None:
    """``rows`` as a table titled ``title``. By default the ``short`` columns, one line per row within
    ``width`` (default: the terminal's): the flexible columns are cut with an ellipsis. ``show_wide``:
    the ``short`` and ``wide`` columns, long cells wrapped whole. No rows: ``TITLE: (none)``."""
    if not rows:
        console.print(f"{title}: (none)", soft_wrap=True)
        return
    if show_wide:
        from rich import box
        from rich.table import Table

        table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False)
        for c in [*short, *wide]:
            table.add_column(c.header, overflow="fold")
        for row in rows:
            table.add_row(*[c.cell(row) for c in [*short, *wide]])
        console.print(table)
        return
    cells = [[" ".join(c.cell(row).split()) for c in short] for row in rows]  # one line per cell
    natural = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(short)]
    minimum = [min(n, max(len(c.header), 5)) for n, c in zip(natural, short)]
    widths = fit_widths(natural, minimum, [c.flex for c in short], width or terminal_width())
    lines = [title, "  ".join(c.header.ljust(w) for c, w in zip(short, widths)).rstrip()]
    lines += ["  ".join(_cut(x, w).ljust(w) for x, w in zip(r, widths)).rstrip() for r in cells]
    console.print("\n".join(lines), soft_wrap=True, markup=False, highlight=False)


def col(key: str, fmt: Callable[[Any], str] | None = None) -> Cell:
    """A cell of ``row[key]``: ``fmt(value)``, else ``str(value)`` ('' for none)."""

    def cell(row: dict[str, Any]) -> str:
        value = row.get(key)
        if fmt is not None:
            return fmt(value)
        return "" if value is None else str(value)

    return cell
