"""Reading a data set as users keep it: the rows of a local file or folder, each with where it was read.

::

    read_table(path, split=None, errors) ──▶ Table(name, rows=[(row number, {column: value}), ...], kind)

    *.jsonl              this project's strict reader (``ckpt_common.records.json_object_lines``): a row's
                         number is its line; invalid JSON or a field given twice is an error naming the line
    *.json               a JSON list of objects, or JSON lines       ┐
    *.parquet, *.csv     one table                                   │ through the ``datasets`` library;
    *.arrow              an Arrow file (``Dataset.save_to_disk``'s)  │ a row's number counts data rows
    a folder             written by ``save_to_disk`` (a Dataset, or  │ from 1 (a CSV's header is not one)
                         a DatasetDict of splits), or of data files  │
                         whose names give their splits (train-*.parquet, test.jsonl, ...)  ┘

Nothing is downloaded: a path that does not exist is an error, and one that looks like a Hub name
(``openai/gsm8k``) says how to fetch it first. Where the source has several splits ``split`` names one
(the error lists them); a single file is one split, "train". ``Table.name`` is how errors name the
source: the path, with ``[split]`` added for a folder's split. Values come as plain Python (nested
structs as dicts, lists as lists, nulls as None); CSV values are strings.

Errors: ``TableError`` (a ValueError) for the source as a whole; bad JSON lines go to ``errors``.
``datasets`` (and pyarrow) are imported only for the formats that need them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from ckpt_common.records import IssueSink, json_object_lines

SUFFIXES: dict[str, str] = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SINGLE_SPLIT = "train"  # the one split of a single file


class TableError(ValueError):
    """The source as a whole cannot be read: missing, a Hub name, an unknown format or split."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(f"{name}: {message}")


@dataclasses.dataclass(frozen=True)
class Table:
    """The rows of one source: ``(number, row)`` (a JSONL row's number is its line, any other's its
    1-based row index), ``kind`` the reader ("jsonl", "parquet", "save_to_disk", ...)."""

    name: str
    kind: str
    rows: Sequence[tuple[int, dict[str, Any]]]
    columns: tuple[str, ...]


def table_name(path: str | os.PathLike[str], split: str | None = None) -> str:
    """How errors name a source: the path, and ``[split]`` when a split of a folder is read."""
    name = os.fspath(path)
    return f"{name}[{split}]" if split is not None and pathlib.Path(name).is_dir() else name


def read_table(path: str | os.PathLike[str], errors: IssueSink, split: str | None = None) -> Table:
    """Every row of the file or folder ``path`` (of ``split`` where it has several). TableError when the
    source cannot be read as a whole; a JSONL line that is not one JSON object goes to ``errors``."""
    source = pathlib.Path(path)
    name = table_name(path, split)
    if not source.exists():
        raise TableError(name, _missing(os.fspath(path)))
    if source.is_dir():
        return _read_folder(source, name, split)
    kind = SUFFIXES.get(source.suffix.lower())
    if kind is None:
        raise TableError(
            name,
            f"unknown file type {source.suffix or '(no suffix)'!r}: expected one of {sorted(SUFFIXES)}, "
            "or a folder written by datasets' save_to_disk",
        )
    if split is not None and split != SINGLE_SPLIT:
        raise TableError(name, f"a single file has one split ({SINGLE_SPLIT!r}), not {split!r}")
    if kind == "jsonl":
        try:
            text = source.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TableError(name, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise TableError(name, f"cannot read it ({e.strerror})") from None
        rows = list(json_object_lines(text.splitlines(), errors))
        columns = tuple(dict.fromkeys(key for _, row in rows for key in row))
        return Table(name, kind, rows, columns)
    return _rows(_load_file(source, kind, name), name, kind)


def _missing(path: str) -> str:
    if _HUB_NAME.match(path):
        return (
            "no such file or folder here; it looks like a Hugging Face Hub name, and nothing is downloaded at "
            'run time: download it first, on a machine with network, e.g. python -c "import datasets; '
            f"datasets.load_dataset('{path}').save_to_disk('{path.split('/')[-1]}')\", and give that folder"
        )
    return "no such file or folder"


def _load_file(source: pathlib.Path, kind: str, name: str) -> Any:
    """The ``datasets.Dataset`` of one file (its cache in a temporary folder, removed after the read)."""
    import datasets

    datasets.disable_progress_bars()
    if kind == "arrow":
        try:
            return datasets.Dataset.from_file(os.fspath(source), in_memory=True)
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for a file that is not Arrow
            raise TableError(name, f"not an Arrow file ({type(e).__name__}: {e})") from None
    cache = tempfile.mkdtemp(prefix="ckpt-table-")
    try:
        reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet}.get(kind)
        if reader is None:
            reader = datasets.Dataset.from_csv
        return reader(os.fspath(source), cache_dir=cache, keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow parse errors have many types; name the file and the cause
        raise TableError(name, f"cannot be read as {kind} ({type(e).__name__}: {_first_line(e)})") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _read_folder(folder: pathlib.Path, name: str, split: str | None) -> Table:
    import datasets

    datasets.disable_progress_bars()
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        try:
            loaded = datasets.load_from_disk(os.fspath(folder), keep_in_memory=True)
        except Exception as e:  # noqa: BLE001 - a damaged save_to_disk folder
            raise TableError(name, f"cannot be read as a save_to_disk folder ({type(e).__name__}: {e})") from None
        if isinstance(loaded, datasets.DatasetDict):
            return _rows(_split_of(loaded, split, name), name, "save_to_disk")
        if split is not None and split != SINGLE_SPLIT:
            raise TableError(name, f"the folder holds one Dataset (no splits), so no split {split!r}")
        return _rows(loaded, name, "save_to_disk")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in _DATA_FILE_SUFFIXES)
    if not files:
        raise TableError(
            name,
            f"the folder holds no data files ({', '.join(_DATA_FILE_SUFFIXES)}) and was not written by save_to_disk",
        )
    cache = tempfile.mkdtemp(prefix="ckpt-table-")
    try:
        loaded = datasets.load_dataset(os.fspath(folder), cache_dir=cache, keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - mixed formats, unreadable files, ...
        raise TableError(
            name, f"cannot be read as a folder of data files ({type(e).__name__}: {_first_line(e)})"
        ) from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return _rows(_split_of(loaded, split, name), name, "data files")


def _split_of(loaded: Any, split: str | None, name: str) -> Any:
    splits = list(loaded)
    if split is None:
        if len(splits) == 1:
            return loaded[splits[0]]
        raise TableError(name, f"the source has splits {splits}: name one (data.train_split / data.heldout_split)")
    if split not in loaded:
        raise TableError(name, f"no split {split!r}; the source has {splits}")
    return loaded[split]


def _rows(dataset: Any, name: str, kind: str) -> Table:
    rows = dataset.with_format(None).to_list()
    return Table(name, kind, [(i, row) for i, row in enumerate(rows, start=1)], tuple(dataset.column_names))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "no message"


MISSING = object()  # what ``column_value`` returns for a column a row does not have


def column_value(row: dict[str, Any], column: str) -> Any:
    """The value of ``column`` in ``row``: a top-level key, else a dotted path into nested objects
    (``reward_model.ground_truth``, as verl's parquet files nest them); ``MISSING`` when absent. A null
    counts as absent (a table's column is there in every row; None marks the rows without a value)."""
    value: Any = row.get(column, MISSING) if column in row else MISSING
    if value is MISSING and "." in column:
        value = row
        for part in column.split("."):
            if not isinstance(value, dict) or part not in value:
                return MISSING
            value = value[part]
    return MISSING if value is None else value
