"""Reading a dataset file: the `datasets` loaders for each format, and the JSON pre-scan that
numbers lines, so a malformed row is named by its file line (datasets' own error is not).

Part of the `dataset` task (`tasks/dataset.py`), which validates rows and builds the stream.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}
ROW_EXAMPLE = '{"prompt": ..., "answer": ...}'


def describe_type(value: Any) -> str:
    """A value for an error message: its type and a short repr."""
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


@dataclass(frozen=True, slots=True)
class Table:
    """One split as read: the `datasets.Dataset` and how to name it and its rows in errors."""

    data: Any
    label: str  # the path as configured, or "dir (split 'test')"
    key: str  # the config key that named it (task.dataset.path / eval_path)
    lines: list[int] | None = None  # JSON lines: the 1-based file line of each row
    header: bool = False  # CSV: rows are counted after the header line

    def where(self, k: int) -> str:
        """Row k (0-based) as a user finds it: "data.jsonl line 7", "data.csv row 3 (after the header)"."""
        if self.lines is not None:
            return f"{self.label} line {self.lines[k]}"
        return f"{self.label} row {k + 1}{' (after the header)' if self.header else ''}"


def _datasets() -> Any:
    """The `datasets` module, imported offline (a run never reaches the hub)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    return datasets


def _format(path: Path, shown: str, fmt: str, key: str) -> str:
    if fmt == "auto":
        if path.is_dir():
            return "disk"
        found = SUFFIXES.get(path.suffix.lower())
        if found is None:
            raise ValueError(
                f"{key} = {shown!r}: can't tell the format from the suffix {path.suffix!r}; use a .jsonl, .json, "
                ".csv or .parquet file or a save_to_disk directory, or set task.dataset.format to one of "
                "jsonl, json, csv, parquet, disk"
            )
        return found
    if (fmt == "disk") != path.is_dir():
        what = "a directory" if path.is_dir() else "a file"
        raise ValueError(
            f"{key} = {shown!r} is {what}, but task.dataset.format = {fmt!r}; set task.dataset.format = 'auto' "
            "('disk' is for save_to_disk directories, the others for files)"
        )
    return fmt


def _scan_json_lines(path: Path, shown: str) -> list[int]:
    """The file line of each row of a JSON lines file; ValueError naming the first bad line."""
    lines = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{shown} line {n} is not UTF-8 text; re-save the file as UTF-8") from None
            if not text.strip():
                continue
            hint = ""
            if n == 1 and text.lstrip().startswith("["):
                hint = (
                    " (it looks like a JSON array: name the file .json or set task.dataset.format = 'json')"
                )
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{shown} line {n} is not valid JSON ({e.msg}, column {e.colno}){hint}; fix or remove that line"
                ) from None
            if not isinstance(value, dict):
                raise ValueError(
                    f"{shown} line {n} is {describe_type(value)}, not an object{hint}; each line must be one row "
                    f"like {ROW_EXAMPLE}"
                )
            lines.append(n)
    if not lines:
        raise ValueError(f"{shown} has no rows (only blank lines); add prompts or point the path elsewhere")
    return lines


def _scan_json(path: Path, shown: str) -> list[int] | None:
    """A .json file: a list of row objects (None: rows are list elements) or JSON lines (their lines)."""
    try:
        text = path.read_text(encoding="utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        return _scan_json_lines(path, shown)  # names the line
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise ValueError(
                f"{shown} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the file"
            ) from None
        return _scan_json_lines(path, shown)  # JSON lines, or a broken line it names
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{shown} is an empty list; fix the file or point the path elsewhere")
        for k, item in enumerate(value, 1):
            if not isinstance(item, dict):
                raise ValueError(
                    f"{shown} row {k} is {describe_type(item)}, not an object; the list must hold rows like "
                    f"{ROW_EXAMPLE}"
                )
        return None
    if isinstance(value, dict) and "\n" not in text.strip():
        return _scan_json_lines(path, shown)  # one row of JSON lines
    raise ValueError(
        f"{shown} holds {describe_type(value)}; a .json file must be a list of rows [{ROW_EXAMPLE}, ...] or "
        "one row object per line"
    )


def _read(path: Path, shown: str, fmt: str, key: str, text_fields: list[str]) -> Any:
    """`datasets` reads the file in memory (a temporary cache, so the user's HF cache stays clean)."""
    datasets = _datasets()
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if fmt == "disk":
            return datasets.load_from_disk(str(path), keep_in_memory=True)
        # CSV: the prompt and answer stay text ("007" is not 7, "2.50" not 2.5).
        options = {"converters": {name: str for name in text_fields}} if fmt == "csv" else {}
        with tempfile.TemporaryDirectory(prefix="asyncrl-dataset-") as cache:
            return datasets.load_dataset(
                BUILDERS[fmt],
                data_files=str(path),
                split="train",
                keep_in_memory=True,
                cache_dir=cache,
                **options,
            )
    except Exception as e:
        cause = e.__cause__ or e
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        if "corresponds to no data" in detail:  # datasets' word for a file with a header and no rows
            raise ValueError(f"{shown} has no rows; point {key} at a file with prompts") from e
        how = "a save_to_disk directory" if fmt == "disk" else fmt
        raise ValueError(
            f"{shown} could not be read as {how} ({type(cause).__name__}: {detail}); check it, or set "
            "task.dataset.format"
        ) from e
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def load_tables(shown: str, fmt: str, *, key: str, text_fields: list[str]) -> tuple[dict[str, Table], bool]:
    """The splits of a data file or save_to_disk directory ({"train": ...} for a file), and whether it
    holds named splits (a DatasetDict). JSON is pre-scanned here so a bad line is named."""
    path = Path(shown).expanduser()
    if not path.exists():
        raise ValueError(
            f"{key} = {shown!r}: no such file or directory; point it at a .jsonl/.json/.csv/.parquet file or "
            "a save_to_disk directory"
        )
    fmt = _format(path, shown, fmt, key)
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{key} = {shown!r} is an empty file; point it at a file with prompts")
    lines = None
    if fmt == "jsonl":
        lines = _scan_json_lines(path, shown)
    elif fmt == "json":
        lines = _scan_json(path, shown)
    data = _read(path, shown, fmt, key, text_fields)
    if isinstance(data, _datasets().DatasetDict):
        return {name: Table(split, f"{shown} (split {name!r})", key) for name, split in data.items()}, True
    if lines is not None and len(lines) != len(data):
        lines = None  # the reader saw other rows than the scan; number them instead
    return {"train": Table(data, shown, key, lines, header=fmt == "csv")}, False
