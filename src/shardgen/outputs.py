"""Shard outputs: the row schema, checkpoint part files, and the committed shard file.

While a shard runs, finished rows go to part files under
``<output.dir>/checkpoints/<shard>/``, each written atomically and stamped with
the shard's fingerprint. A restarted job keeps the rows of every intact part
whose fingerprint matches and generates only the rest. The shard's output
file is assembled from the parts, in input order, and the parts are removed
only after it is committed.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardgen.errors import InputError
from shardgen.io import atomic_write

log = logging.getLogger(__name__)

# The shard's fingerprint: its input rows and everything that decides their text.
FINGERPRINT_KEY = b"shardgen.fingerprint"
# The content config's fingerprint, which all shards of one run share.
CONFIG_KEY = b"shardgen.config_fingerprint"
SHARD_KEY = b"shardgen.shard"
# Output rows per input row: sampling.n with output.samples "rows", else 1.
ROWS_PER_INPUT_KEY = b"shardgen.rows_per_input"
# Where the rows came from: config fingerprint, model, vLLM version, engine settings (JSON).
PROVENANCE_KEY = b"shardgen.provenance"


def check_input_columns(
    schema: pa.Schema,
    prompt_columns: Iterable[str],
    id_column: str | None,
    result_columns: Iterable[str],
    prompt_key: str = "prompt.template",
) -> None:
    """Check the columns the run reads exist and none clashes with a result column.

    Raises:
        InputError: naming the column.
    """
    names = set(schema.names)
    available = ", ".join(schema.names)
    for col in sorted(prompt_columns):
        if col not in names:
            raise InputError(f"{prompt_key} uses the column '{col}', which the input lacks (it has: {available})")
    if id_column and id_column not in names:
        raise InputError(f"input.id_column: the input has no column '{id_column}' (it has: {available})")
    if clash := sorted(names & set(result_columns)):
        raise InputError(f"input: the column(s) {clash} clash with the columns shardgen adds; rename them in the input")


def output_schema(
    input_schema: pa.Schema,
    fingerprint: str,
    config_fingerprint: str,
    shard_id: str,
    result_fields: list[pa.Field] | None = None,
    rows_per_input: int = 1,
) -> pa.Schema:
    """The shard file's schema: the input's columns, then the result columns (by default those of one plain sample)."""
    if result_fields is None:
        from shardgen.results import ResultSpec

        result_fields = ResultSpec({}, {}).fields()
    meta = {
        FINGERPRINT_KEY: fingerprint.encode(),
        CONFIG_KEY: config_fingerprint.encode(),
        SHARD_KEY: shard_id.encode(),
        ROWS_PER_INPUT_KEY: str(rows_per_input).encode(),
    }
    return pa.schema(list(input_schema) + result_fields, metadata=meta)


def rows_per_input(schema: pa.Schema) -> int:
    return int((schema.metadata or {}).get(ROWS_PER_INPUT_KEY, b"1"))


def count_problems(row_index: np.ndarray, start: int, stop: int, per_row: int) -> tuple[int, int]:
    """Input rows of ``[start, stop)`` missing from ``row_index``, and output rows too many.

    Each input row must appear exactly ``per_row`` times (once per sample in
    ``output.samples: rows`` mode); a row outside the range is one too many.
    """
    inside = row_index[(row_index >= start) & (row_index < stop)] - start
    counts = np.bincount(inside, minlength=stop - start) if len(inside) else np.zeros(stop - start, dtype=np.int64)
    missing = int(np.count_nonzero(counts < per_row))
    extra = int(np.clip(counts - per_row, 0, None).sum()) + (len(row_index) - len(inside))
    return missing, extra


def write_table(table: pa.Table, path: str | Path) -> None:
    """Write a Parquet file atomically."""
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


class ShardCheckpoint:
    """The part files of one shard in progress.

    Args:
        directory: ``<output.dir>/checkpoints/<shard>``.
        start, stop: the shard's global row range.
        schema: the output schema, carrying the fingerprint.
    """

    def __init__(self, directory: str | Path, start: int, stop: int, schema: pa.Schema) -> None:
        self.dir = Path(directory)
        self.start, self.stop = start, stop
        self.schema = schema
        self.fingerprint = schema.metadata[FINGERPRINT_KEY].decode()
        self.per_row = rows_per_input(schema)
        self.rows = stop - start
        self._tables: list[pa.Table] = []
        self._next = 0
        self.discarded: list[str] = []
        # per-row errors among the resumed rows
        self.resumed_errors = 0
        self.first_error: str | None = None

    def resume(self) -> set[int]:
        """Load every usable part; return the row indexes already done.

        A part that cannot be read (the job died while writing it, or the disk
        filled), that has another fingerprint (the config changed), or whose
        rows fall outside the shard is removed, so its rows are generated again.
        """
        done: set[int] = set()
        for part in sorted(self.dir.glob("part-*.parquet")):
            self._next = max(self._next, int(part.stem.split("-")[1]) + 1)
            reason = None
            try:
                table = pq.read_table(part)
            except (pa.ArrowInvalid, OSError) as e:
                reason = f"unreadable ({e})"
            else:
                fp = (table.schema.metadata or {}).get(FINGERPRINT_KEY, b"").decode()
                idx = table.column("row_index").to_numpy() if "row_index" in table.column_names else np.array([])
                rows = set(idx.tolist())
                if fp != self.fingerprint:
                    reason = "made with another configuration"
                elif not table.schema.remove_metadata().equals(self.schema.remove_metadata()):
                    reason = "has other columns"
                elif count_problems(idx, self.start, self.stop, self.per_row) != (self.rows - len(rows), 0):
                    reason = "has rows outside the shard or repeated rows"
                elif done.intersection(rows):
                    reason = "repeats rows of an earlier part"
            if reason:
                log.warning("checkpoint %s %s: its rows will be generated again", part, reason)
                self.discarded.append(f"{part.name}: {reason}")
                part.unlink(missing_ok=True)
                continue
            done.update(rows)
            self._tables.append(table)
            bad = table.filter(table.column("error").is_valid())
            self.resumed_errors += len(set(bad.column("row_index").to_pylist()))
            if self.first_error is None and bad.num_rows:
                self.first_error = f"row {bad.column('row_index')[0]}: {bad.column('error')[0]}"
        for stale in self.dir.glob(".part-*.tmp"):  # a write the job died in
            stale.unlink(missing_ok=True)
        return done

    def flush(self, rows: list[dict[str, Any]]) -> None:
        """Write finished rows as one new part file."""
        if not rows:
            return
        table = pa.Table.from_pylist(rows, schema=self.schema)
        write_table(table, self.dir / f"part-{self._next:06d}.parquet")
        self._next += 1
        self._tables.append(table)

    def commit(self, path: str | Path) -> pa.Table:
        """Assemble the shard file from the parts, in input order, then remove the parts.

        Raises:
            InputError: the parts do not hold every row of the shard exactly once.
        """
        table = pa.concat_tables(self._tables) if self._tables else self.schema.empty_table()
        keys = [k for k in ("row_index", "sample_index") if k in table.column_names]
        table = table.sort_by([(k, "ascending") for k in keys])
        missing, extra = count_problems(table.column("row_index").to_numpy(), self.start, self.stop, self.per_row)
        if missing or extra:
            raise InputError(f"shard rows [{self.start}, {self.stop}): {missing} missing, {extra} repeated")
        write_table(table.replace_schema_metadata(self.schema.metadata), path)
        shutil.rmtree(self.dir, ignore_errors=True)
        return table
