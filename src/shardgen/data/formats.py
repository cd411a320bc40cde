"""The merged output's formats (``output.format``): where each is written, how, and how it is read back.

- ``parquet``: ``<dir>/output.parquet``, one file, its provenance in the
  file's metadata;
- ``jsonl``: ``<dir>/output.jsonl``, one JSON record per line, its provenance
  beside it in ``output.jsonl.provenance.json``;
- ``hf``: ``<dir>/output/``, a directory ``datasets.load_from_disk`` reads,
  its provenance in the dataset's description;
- formats a feature adds (``register``): each a directory of files, with
  the provenance beside them, written and read back by the feature.

Writers take a stream of ``(schema, record batch)`` pairs, so memory stays
flat however large the output is; readers give a few columns batch by batch
(the report) or the whole dataset (``datasets``, for pushing to the hub).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardgen.base.io import atomic_write, atomic_write_text, replace_dir
from shardgen.base.registry import Registry
from shardgen.data.outputs import CONFIG_KEY, PROVENANCE_KEY
from shardgen.errors import ShardgenError

# Row groups of a merged Parquet file: large enough that a 100M-row output
# has a footer of a few thousand entries, small enough to buffer.
ROW_GROUP_ROWS = 128 * 1024
ROW_GROUP_BYTES = 64 << 20

Batches = Iterator[tuple[pa.Schema, pa.RecordBatch]]
ColumnReader = Callable[[list[str]], Iterator[pa.RecordBatch]]


# The file beside a JSON Lines output that holds its provenance.
PROVENANCE_SUFFIX = ".provenance.json"


@dataclass(frozen=True)
class OutputFormat:
    """An output format a feature adds, as a directory of files: how a merge writes it
    (``write(path, batches, provenance, id_column, top_logprobs)``), whether a directory holds it, its
    provenance (checked against the files it describes), and its prompt and generated tokens, batch by
    batch (``read_columns``)."""

    write: Callable[[Path, Batches, dict, str | None, Callable[[dict[str, Any]], int | None]], None]
    holds: Callable[[Path], bool]
    provenance: Callable[[Path], dict[str, Any]]
    read_columns: Callable[[Path, int], tuple[list[str], ColumnReader]]


# The formats features add, by their ``output.format`` name (register).
ADDED: dict[str, OutputFormat] = Registry()


def register(name: str, fmt: OutputFormat) -> None:
    ADDED[name] = fmt


def format_of(path: str | Path) -> str:
    """The format of a merged output, from its path (a directory is ``hf``, or an added format that
    holds it)."""
    p = Path(path)
    if p.is_dir():
        return next((name for name, fmt in ADDED.items() if fmt.holds(p)), "hf")
    return "jsonl" if p.suffix == ".jsonl" else "parquet"


# -- Writing ----------------------------------------------------------------------------------------


def write(
    fmt: str,
    path: str | Path,
    batches: Batches,
    empty: Callable[[], pa.Schema],
    provenance: dict,
    id_column: str | None = None,
    top_logprobs: Callable[[dict[str, Any]], int | None] | None = None,
) -> None:
    """Write ``batches`` as ``fmt`` at ``path``, atomically, with ``provenance``.

    Args:
        empty: the schema of an output without rows (an empty input).
        provenance: where the rows came from; its ``config_fingerprint`` also
            goes into the Parquet metadata.
        id_column: ``input.id_column``, which a format of requests' answers names each answer by.
        top_logprobs: for a format of requests' answers, how many top tokens a row's request asked for
            (``rowsampling.logprobs_of``; None: none).
    """
    meta = {
        CONFIG_KEY: (provenance.get("config_fingerprint") or "").encode(),
        PROVENANCE_KEY: json.dumps(provenance).encode(),
    }
    if fmt == "parquet":
        atomic_write(path, lambda f: _write_parquet(f, batches, empty, meta))
    elif fmt == "jsonl":
        # The rows and their provenance are two files, each replaced whole; the provenance names the
        # digest of the rows it describes, so a merge killed between the two renames cannot leave a
        # pair that seems to agree (``provenance`` checks it).
        digest = hashlib.sha256()
        atomic_write(path, lambda f: _write_jsonl(f, batches, digest))
        text = json.dumps({**provenance, "output_sha256": digest.hexdigest()}, indent=1) + "\n"
        atomic_write_text(f"{path}{PROVENANCE_SUFFIX}", text)
    elif fmt == "hf":
        _write_hf(Path(path), batches, empty, meta, provenance)
    elif fmt in ADDED:
        ADDED[fmt].write(Path(path), batches, provenance, id_column, top_logprobs or (lambda row: None))
    else:
        raise ValueError(f"unknown output format {fmt!r}")


def _write_parquet(sink: Any, batches: Batches, empty: Callable[[], pa.Schema], meta: dict) -> None:
    """Stream the batches into one Parquet file (``sink``: a path or a binary file)."""
    writer = None
    buffer: list[pa.RecordBatch] = []

    def write_buffer() -> None:
        if buffer:
            writer.write_table(pa.Table.from_batches(buffer), row_group_size=ROW_GROUP_ROWS)
            buffer.clear()

    try:
        for schema, batch in batches:
            if writer is None:
                writer = pq.ParquetWriter(sink, schema.with_metadata(meta), compression="zstd")
            buffer.append(batch)
            if sum(b.num_rows for b in buffer) >= ROW_GROUP_ROWS or sum(b.nbytes for b in buffer) >= ROW_GROUP_BYTES:
                write_buffer()
        if writer is not None:
            write_buffer()
        if writer is None:  # an empty input (input.allow_empty) gets a row-less output
            pq.write_table(empty().with_metadata(meta).empty_table(), sink, compression="zstd")
    finally:
        if writer is not None:
            writer.close()


def json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def _write_jsonl(f: IO[bytes], batches: Batches, digest: Any) -> None:
    for _, batch in batches:
        for row in batch.to_pylist():
            line = (json.dumps(row, ensure_ascii=False, default=json_default) + "\n").encode()
            f.write(line)
            digest.update(line)


def _write_hf(path: Path, batches: Batches, empty: Callable[[], pa.Schema], meta: dict, provenance: dict) -> None:
    """A ``datasets`` directory (``save_to_disk``), written beside ``path`` and swapped into place."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        merged = f"{tmp}/merged.parquet"
        _write_parquet(merged, batches, empty, meta)
        info = datasets.DatasetInfo(description=json.dumps({"shardgen_provenance": provenance}))
        ds = datasets.Dataset.from_parquet(merged, cache_dir=f"{tmp}/cache")
        ds.info.update(info)
        ds.save_to_disk(f"{tmp}/out")
        replace_dir(Path(f"{tmp}/out"), path)


# -- Reading back -----------------------------------------------------------------------------------


def load(path: str | Path):
    """The merged output as a ``datasets.Dataset``, whatever its format."""
    import datasets

    fmt = format_of(path)
    if fmt == "hf":
        return datasets.load_from_disk(str(path))
    if fmt in ADDED:
        raise ShardgenError(f"'{path}' holds {fmt} files, not a dataset; read them as JSON Lines")
    return datasets.load_dataset("parquet" if fmt == "parquet" else "json", data_files=str(path), split="train")


def provenance(path: str | Path) -> dict[str, Any]:
    """The provenance a merged output carries, whatever its format."""
    fmt = format_of(path)
    if fmt == "parquet":
        return json.loads((pq.read_schema(path).metadata or {}).get(PROVENANCE_KEY, b"{}"))
    if fmt == "jsonl":
        prov = json.loads(Path(f"{path}{PROVENANCE_SUFFIX}").read_text())
        if prov.get("output_sha256") not in (None, file_sha256(Path(path))):
            raise ShardgenError(
                f"'{path}{PROVENANCE_SUFFIX}' describes other rows than '{path}' holds (a merge stopped between "
                "writing the two?); run the workflow again, which merges again"
            )
        return prov
    if fmt in ADDED:
        return ADDED[fmt].provenance(Path(path))
    return json.loads(load(path).info.description)["shardgen_provenance"]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_columns(path: str | Path, batch_size: int) -> tuple[list[str], ColumnReader]:
    """The merged output's column names, and a reader of some of its columns, batch by batch.

    Parquet is read row group by row group, a ``datasets`` directory's Arrow
    files are memory-mapped, JSON Lines is read line by line.
    """
    path = Path(path)
    fmt = format_of(path)
    if fmt in ADDED:
        return ADDED[fmt].read_columns(path, batch_size)
    if fmt == "hf":  # Dataset.save_to_disk
        files = [path / f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
        names: list[str] = []
        for file in files[:1]:
            with pa.memory_map(str(file)) as src:
                names = pa.ipc.open_stream(src).schema.names

        def arrow_batches(columns: list[str]) -> Iterator[pa.RecordBatch]:
            for file in files:
                with pa.memory_map(str(file)) as src:
                    for batch in pa.ipc.open_stream(src):
                        yield batch.select(columns)

        return names, arrow_batches
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        names = list(json.loads(first)) if first else []
        return names, lambda columns: jsonl_batches(path, columns, batch_size)
    pf = pq.ParquetFile(path)
    return pf.schema_arrow.names, lambda columns: pf.iter_batches(batch_size=batch_size, columns=columns)


def jsonl_batches(path: Path, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
    """Columns of a JSON Lines file, batch by batch (line by line: any column may hold lists)."""
    values: dict[str, list[Any]] = {c: [] for c in columns}

    def flush() -> pa.RecordBatch:
        batch = pa.RecordBatch.from_arrays([pa.array(values[c]) for c in columns], names=columns)
        for v in values.values():
            v.clear()
        return batch

    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                for c in columns:
                    values[c].append(row.get(c))
                if len(values[columns[0]]) >= batch_size:
                    yield flush()
    if values[columns[0]]:
        yield flush()
