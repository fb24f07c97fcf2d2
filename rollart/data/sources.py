"""Prompt datasets read offline with the ``datasets`` library: JSONL (``.jsonl``/``.json``), Parquet
(``.parquet``) or a folder written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split
is chosen by the caller). Rows are read from the memory-mapped Arrow table on demand."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_CACHE: dict[tuple[str, str | None, int], Any] = {}


class DataError(ValueError):
    """A dataset that cannot be used; the message names the config field and the fix."""


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach the Hub
    try:
        import datasets
    except ImportError as err:
        raise DataError("data: reading datasets needs the `datasets` library: pip install 'rollart[data]'") from err
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_rows(path: str | Path, *, field: str, splits: tuple[str, ...] = ("train",)) -> Any:
    """The ``datasets.Dataset`` at ``path``; ``field`` (e.g. ``data[0].train``) names the config entry in
    errors; ``splits`` are the split names tried, in order, when ``path`` is a ``DatasetDict`` folder."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{field}: {p} does not exist; give the path of a .jsonl, .parquet or save_to_disk folder")
    key = (str(p.resolve()), ",".join(splits), p.stat().st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    ds = _datasets()
    if p.is_dir():
        try:
            loaded = ds.load_from_disk(str(p))
        except FileNotFoundError as err:
            raise DataError(f"{field}: {p} is a folder but not one written by Dataset.save_to_disk ({err})") from None
        if isinstance(loaded, ds.DatasetDict):
            split = next((s for s in splits if s in loaded), None)
            if split is None:
                raise DataError(
                    f"{field}: {p} is a DatasetDict with splits {sorted(loaded)}, none of {list(splits)}; "
                    "save the split you want with save_to_disk, or rename it"
                )
            loaded = loaded[split]
    elif p.suffix in (".jsonl", ".json"):
        loaded = _load_file(ds, "json", p, field)
    elif p.suffix == ".parquet":
        loaded = _load_file(ds, "parquet", p, field)
    else:
        raise DataError(f"{field}: {p.name} has an unknown format; use .jsonl, .parquet or a save_to_disk folder")
    if len(loaded) == 0:
        raise DataError(f"{field}: {p} has no rows")
    _CACHE[key] = loaded
    return loaded


def _load_file(ds: Any, builder: str, p: Path, field: str) -> Any:
    try:
        return ds.load_dataset(builder, data_files=str(p), split="train")
    except Exception as err:  # the datasets library wraps parse errors in several types
        cause = err.__cause__ or err
        raise DataError(f"{field}: cannot read {p} as {builder}: {type(cause).__name__}: {cause}") from None


def check_columns(rows: Any, field: str, path: str | Path, **keys: str) -> None:
    """Raise naming ``{field}.{name}`` when a configured column is missing (e.g. ``prompt_key``)."""
    for name, column in keys.items():
        if column not in rows.column_names:
            raise DataError(
                f"{field}.{name}: {column!r} is not a column of {path} (columns: {rows.column_names}); "
                f"set {name} to the column that holds it"
            )
