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

RESULT_FIELDS = [
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("generation", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("generated_tokens", pa.int32()),
    pa.field("error", pa.string()),
]
RESULT_COLUMNS = [f.name for f in RESULT_FIELDS]


def check_input_columns(schema: pa.Schema, template_columns: Iterable[str], id_column: str | None) -> None:
    """Check the columns the run reads exist and none clashes with a result column.

    Raises:
        InputError: naming the column.
    """
    names = set(schema.names)
    available = ", ".join(schema.names)
    for col in sorted(template_columns):
        if col not in names:
            raise InputError(f"prompt.template uses the column '{col}', which the input lacks (it has: {available})")
    if id_column and id_column not in names:
        raise InputError(f"input.id_column: the input has no column '{id_column}' (it has: {available})")
    if clash := sorted(names & set(RESULT_COLUMNS)):
        raise InputError(f"input: the column(s) {clash} clash with the columns shardgen adds; rename them in the input")


def output_schema(input_schema: pa.Schema, fingerprint: str, config_fingerprint: str, shard_id: str) -> pa.Schema:
    meta = {
        FINGERPRINT_KEY: fingerprint.encode(),
        CONFIG_KEY: config_fingerprint.encode(),
        SHARD_KEY: shard_id.encode(),
    }
    return pa.schema(list(input_schema) + RESULT_FIELDS, metadata=meta)


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
                idx = table.column("row_index").to_pylist() if "row_index" in table.column_names else []
                if fp != self.fingerprint:
                    reason = "made with another configuration"
                elif not table.schema.remove_metadata().equals(self.schema.remove_metadata()):
                    reason = "has other columns"
                elif any(not self.start <= i < self.stop for i in idx) or len(set(idx)) != len(idx):
                    reason = "has rows outside the shard or repeated rows"
                elif done.intersection(idx):
                    reason = "repeats rows of an earlier part"
            if reason:
                log.warning("checkpoint %s %s: its rows will be generated again", part, reason)
                self.discarded.append(f"{part.name}: {reason}")
                part.unlink(missing_ok=True)
                continue
            done.update(idx)
            self._tables.append(table)
            bad = table.filter(table.column("error").is_valid())
            self.resumed_errors += bad.num_rows
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
        table = table.sort_by("row_index")
        idx = table.column("row_index").to_pylist()
        if idx != list(range(self.start, self.stop)):
            missing = (self.stop - self.start) - len(set(idx))
            raise InputError(
                f"shard rows [{self.start}, {self.stop}): {missing} missing, {len(idx) - len(set(idx))} repeated"
            )
        write_table(table.replace_schema_metadata(self.schema.metadata), path)
        shutil.rmtree(self.dir, ignore_errors=True)
        return table
