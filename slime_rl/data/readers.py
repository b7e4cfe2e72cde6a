"""Reading prompt files: jsonl, json and parquet, with an optional `path@[start:end]` row slice.

`read_records(spec)` returns `(row_number, record)` pairs; `located_records(spec)` returns
`(where, record)` pairs, `where` being what a person looks up: "line N" of a jsonl file (1-based, as
editors count, blank lines included) or "row N" of a json list / parquet table. Both count in the
whole file (before slicing), so an error found later in a slice still names the right place. Slices
follow Python semantics over rows (`data.jsonl@[:100]`, `data.parquet@[-50:]`, `data.json@[10:20]`);
an empty slice is an error. Every structurally bad line of a jsonl file is listed (up to
MAX_ERRORS_SHOWN, then a count), not only the first.

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
MAX_ERRORS_SHOWN = 10

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


def _check_object(path: Path, where: str, value: Any) -> Record:
    if not isinstance(value, dict):
        raise DataError(f"{path}: {where}: expected a JSON object, got {type(value).__name__}")
    return value


# a \\uD800-\\uDFFF escape: a surrogate, valid only as half of a pair (an emoji); alone it is not text
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class NotText(ValueError):
    """Valid JSON whose strings are not all text (a lone surrogate)."""


def _loads(text: str | bytes) -> Any:
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise json.JSONDecodeError("nested too deeply", "", 0) from exc
    if _SURROGATE_ESCAPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise NotText(f"a string holds a lone UTF-16 surrogate ({exc.object[exc.start]!a}), which is not "
                          "text a tokenizer takes; fix or drop the row") from None
    return value


def row_position(error: str) -> int:
    """The N of an error's "line N: ..." / "row N: ..." (0 when it names none): to list errors in file order."""
    match = re.match(r"(?:line|row) (\d+)", error)
    return int(match.group(1)) if match else 0


def bad_rows_error(source: str | Path, errors: list[str], total: int) -> DataError:
    """One error listing the bad rows (each 'where: what'), the first MAX_ERRORS_SHOWN of them."""
    shown = "\n  ".join(errors[:MAX_ERRORS_SHOWN])
    more = f"\n  ... and {len(errors) - MAX_ERRORS_SHOWN} more" if len(errors) > MAX_ERRORS_SHOWN else ""
    return DataError(f"{source}: {len(errors)} bad row(s) of {total}:\n  {shown}{more}")


def _read_jsonl(path: Path, bad: list[str] | None = None) -> list[tuple[str, Record]]:
    """The file's rows as (where, record); its bad lines raise together, or, given `bad`, go into it (the
    caller adds the errors it finds in the good rows, and reports them all at once)."""
    rows: list[tuple[str, Record]] = []
    errors: list[str] = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its line, not mid-read
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"line {lineno}"
            try:
                value = _loads(raw.decode("utf-8"))
                rows.append((where, _check_object(path, where, value)))
            except UnicodeDecodeError as exc:
                errors.append(f"{where}: not valid UTF-8: {exc}")
            except json.JSONDecodeError as exc:
                errors.append(f"{where}: not valid JSON: {exc}")
            except NotText as exc:
                errors.append(f"{where}: {exc}")
            except DataError as exc:
                errors.append(str(exc).removeprefix(f"{path}: "))
    if bad is not None:
        bad.extend(errors)
    elif errors:
        raise bad_rows_error(path, errors, len(rows) + len(errors))
    return rows


def _read_json(path: Path) -> list[Record]:
    try:
        value = _loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from exc
    except NotText as exc:
        raise DataError(f"{path}: {exc}") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a list of objects or {{\"data\": [...]}}, got "
                        f"{type(value).__name__}" + (f" with keys {sorted(value)}" if isinstance(value, dict) else ""))
    return [(f"row {i}", _check_object(path, f"row {i}", v)) for i, v in enumerate(value, 1)]


def _read_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pyarrow is a dependency; this guards a broken install
        raise DataError(f"{path}: reading parquet needs pyarrow ({exc})") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types (ArrowInvalid, OSError, ...)
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    return [(f"row {i}", r) for i, r in enumerate(table.to_pylist(), 1)]


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}


def file_format(path: str | Path) -> str:
    """'jsonl', 'json' or 'parquet' from the suffix; anything else raises naming the file."""
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unknown data format; expected one of {', '.join(sorted(_SUFFIXES))}")
    return fmt


def located_records(spec: str | Path, bad: list[str] | None = None) -> list[tuple[str, Record]]:
    """(where, record) pairs of a prompt file, sliced when `spec` ends in `@[start:end]`; `where` is
    "line N" (jsonl) or "row N" (json, parquet). `bad`: a jsonl file's lines that are no record go into it
    instead of raising (PromptDataset reports them with the bad labels of the other rows)."""
    path_str, rows_slice = parse_data_spec(str(spec))
    path = Path(path_str)
    fmt = file_format(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = _read_jsonl(path, bad) if fmt == "jsonl" and bad is not None else _READERS[fmt](path)
    if not records and bad:
        return records  # every line bad: the caller reports them
    if not records:
        raise DataError(f"{path}: no rows")
    if rows_slice is None:
        return records
    sliced = records[rows_slice]
    if not sliced and not bad:  # (with bad lines the caller reports those: the slice counts good rows only)
        raise DataError(f"{spec}: the slice [{rows_slice.start}:{rows_slice.stop}] selects no rows "
                        f"(the file has {len(records)})")
    return sliced


def read_records(spec: str | Path) -> list[tuple[int, Record]]:
    """(row_number, record) pairs of a prompt file (1-based rows of the whole file, blank jsonl lines
    not counted), sliced when `spec` ends in `@[start:end]`."""
    path_str, rows_slice = parse_data_spec(str(spec))
    records = located_records(path_str)
    numbered = list(enumerate((r for _, r in records), 1))
    if rows_slice is not None:
        numbered = numbered[rows_slice]
        if not numbered:
            raise DataError(f"{spec}: the slice [{rows_slice.start}:{rows_slice.stop}] selects no rows "
                            f"(the file has {len(records)})")
    return numbered


def read_jsonl(path: str | Path) -> list[Record]:
    """Rows of a jsonl file (kept for callers of the old reader); errors name the file and row."""
    rows = [r for _, r in _read_jsonl(Path(path))]
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
