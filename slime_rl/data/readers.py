"""Reading prompt files: jsonl, json and parquet, with an optional `path@[start:end]` row slice.

One entry point, `read_records(spec)`, returns `(row_number, record)` pairs. Row numbers are
1-based positions of the record in the whole file (before slicing), so an error found later in a
slice still names the row a person would look up in the file. Slices follow Python semantics
(`data.jsonl@[:100]`, `data.parquet@[-50:]`, `data.json@[10:20]`); an empty slice is an error.

Formats, chosen by the file suffix:
- `.jsonl` (also `.ndjson`): one JSON object per line; blank lines are skipped and do not count as rows.
- `.json`: a list of objects, or the HF-style `{"data": [...]}` wrapper.
- `.parquet`: read with pyarrow; nested columns (message lists, dict columns) come back as Python
  lists and dicts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

Record = dict[str, Any]

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>[+-]?\d*):(?P<stop>[+-]?\d*)\]$")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Bad input data; the message names the file and the row."""


def parse_data_spec(spec: str) -> tuple[str, slice | None]:
    """'file.jsonl@[start:end]' -> ('file.jsonl', slice(start, end)); a plain path -> (path, None).

    Only the `[start:end]` form is accepted after '@' (no step): `path@[2:-1]`, `path@[:10]`.
    """
    match = _SLICE.match(spec)
    if match is None:
        if re.search(r"@\[.*\]$", spec):
            raise DataError(f"{spec!r}: bad row slice; expected 'path@[start:end]' with integer bounds")
        return spec, None
    start, stop = match["start"], match["stop"]
    return match["path"], slice(int(start) if start else None, int(stop) if stop else None)


def _check_object(path: Path, row: int, value: Any) -> Record:
    if not isinstance(value, dict):
        raise DataError(f"{path}: row {row}: expected a JSON object, got {type(value).__name__}")
    return value


def _loads(text: str | bytes) -> Any:
    """json.loads, with nesting too deep for the parser (RecursionError) reported as bad JSON."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise json.JSONDecodeError("nested too deeply", "", 0) from exc


def _read_jsonl(path: Path) -> list[Record]:
    rows: list[Record] = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its row, not mid-read
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            row = len(rows) + 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: row {row} (line {lineno}): not valid UTF-8: {exc}") from exc
            try:
                value = _loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {row} (line {lineno}): not valid JSON: {exc}") from exc
            rows.append(_check_object(path, row, value))
    return rows


def _read_json(path: Path) -> list[Record]:
    try:
        value = _loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from exc
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a list of objects or {{\"data\": [...]}}, got "
                        f"{type(value).__name__}" + (f" with keys {sorted(value)}" if isinstance(value, dict) else ""))
    return [_check_object(path, i, v) for i, v in enumerate(value, 1)]


def _read_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pyarrow is a dependency; this guards a broken install
        raise DataError(f"{path}: reading parquet needs pyarrow ({exc})") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types (ArrowInvalid, OSError, ...)
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    return table.to_pylist()


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}


def file_format(path: str | Path) -> str:
    """'jsonl', 'json' or 'parquet' from the suffix; anything else raises naming the file."""
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unknown data format; expected one of {', '.join(sorted(_SUFFIXES))}")
    return fmt


def read_records(spec: str | Path) -> list[tuple[int, Record]]:
    """(row_number, record) pairs of a prompt file, sliced when `spec` ends in `@[start:end]`."""
    path_str, rows_slice = parse_data_spec(str(spec))
    path = Path(path_str)
    fmt = file_format(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = _READERS[fmt](path)
    if not records:
        raise DataError(f"{path}: no rows")
    numbered = list(enumerate(records, 1))
    if rows_slice is not None:
        numbered = numbered[rows_slice]
        if not numbered:
            raise DataError(f"{spec}: the slice [{rows_slice.start}:{rows_slice.stop}] selects no rows "
                            f"(the file has {len(records)})")
    return numbered


def read_jsonl(path: str | Path) -> list[Record]:
    """Rows of a jsonl file (kept for callers of the old reader); errors name the file and row."""
    rows = _read_jsonl(Path(path))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def write_records(rows: list[Record], path: str | Path) -> Path:
    """Write rows in the format the suffix names (the inverse of `read_records` without a slice)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = file_format(path)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path
