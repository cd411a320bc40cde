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
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardgen.base import records
from shardgen.base.io import Dir, LazyDir, atomic_write
from shardgen.base.rundir import ATTEMPTS, DISCARDED, FINGERPRINT_KEY, PROGRESS
from shardgen.errors import InputError, RowError

log = logging.getLogger(__name__)

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
    keyed_columns: Mapping[str, str | None],
    result_columns: Iterable[str],
    prompt_key: str = "prompt.template",
    where: str = "the input",
) -> None:
    """Check the input's column names are unique, the columns the run reads exist, and none clashes
    with a result column (which would overwrite it).

    Args:
        keyed_columns: the columns config keys name (``input.id_column``, ``lora.column``), by key.
        where: the input, as the message names it.

    Raises:
        InputError: naming the column.
    """
    seen: set[str] = set()
    if twice := sorted({n for n in schema.names if n in seen or seen.add(n)}):
        raise InputError(
            f"input: {where} has more than one column named {', '.join(map(repr, twice))}; a row can hold only one "
            "value for a name, so the others would be lost. Rename them in the input"
        )
    names = set(schema.names)
    available = ", ".join(schema.names)
    for col in sorted(prompt_columns):
        if col not in names:
            raise InputError(f"{prompt_key} uses the column '{col}', which the input lacks (it has: {available})")
    for key, col in keyed_columns.items():
        if col and col not in names:
            raise InputError(f"{key}: the input has no column '{col}' (it has: {available})")
    if clash := sorted(names & set(result_columns)):
        raise InputError(
            f"input: {where} has the column(s) {clash}, which this config's output also has (shardgen adds them "
            "for the task and sampling settings); the output would overwrite the input's values. Rename them in "
            "the input"
        )


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


def write_table(table: pa.Table, path: str | Path, below: str | Path | None = None) -> None:
    """Write a Parquet file atomically (``below``: the output directory it sits in, see ``io.Dir.open``)."""
    atomic_write(path, lambda f: pq.write_table(table, f, compression="zstd"), below)


# What a shard's checkpoint directory holds: its parts and rundir's ATTEMPTS, PROGRESS and
# DISCARDED. shardgen reads, moves or removes only these names; anything else there is left alone.
PART_NAME = re.compile(r"part-(\d{6})\.parquet")
# A temporary file of io.Dir.write_atomic for one of the names above (the job died while writing it).
_TMP_NAME = re.compile(r"\.(part-\d{6}\.parquet|attempts\.jsonl|progress\.json)\.[0-9a-f]{8}\.tmp")


def lone_surrogate(text: str) -> int | None:
    """Where the first lone surrogate of ``text`` is, None where there is none. Such text (half an emoji:
    JSON's ``\\ud83d`` escape read alone, or a Python function's or a tool's output) is a Python string
    that UTF-8, and so Arrow and every output file, cannot hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def repaired_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD, as vLLM's detokenizer replaces bytes it cannot
    decode (a pair of halves becomes its character). For text a model reads; a column's text that
    cannot be encoded is its row's error (``arrow_table``)."""
    if lone_surrogate(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _bad_text(value: Any) -> str | None:
    """The first text inside ``value`` (a row's column: a string, or lists and dicts of them) that UTF-8
    cannot encode, described (the character and where it is), None where all of it can."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if (at := lone_surrogate(v)) is not None:
                return f"{v[at]!r} at character {at}"  # repr: escaped
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return None


def arrow_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """The rows as a table of ``schema``: the one place where a row's values become Arrow.

    Text that cannot be encoded (a lone surrogate: a generation's parsed JSON, a function's output, a
    tool's result in ``messages``) makes that row an ``invalid_text`` error naming the column, whose
    value is left out; the row's other columns are kept, and the other rows are untouched. The common
    case costs nothing: rows are looked at one by one only when Arrow refuses the batch.
    """
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except UnicodeEncodeError:
        return pa.Table.from_pylist([_encodable(row) for row in rows], schema=schema)


def _encodable(row: dict[str, Any]) -> dict[str, Any]:
    bad = {c: why for c, v in row.items() if c != "error" and (why := _bad_text(v)) is not None}
    out = {**row, **dict.fromkeys(bad)}
    if bad:
        what = "; ".join(
            f"column {c!r}: text that is not valid Unicode ({why}, half an emoji?)" for c, why in bad.items()
        )
        error = str(RowError("invalid_text", f"{what}; the value is left out"))
        out["error"] = f"{row['error']}; {error}" if row.get("error") else error
    if out.get("error"):  # the error's own text may quote what it is about
        out["error"] = out["error"].encode("utf-8", "backslashreplace").decode("utf-8")
    return out


class ShardCheckpoint(LazyDir):
    """The part files of one shard in progress, and the record of its attempts.

    Args:
        directory: ``<output.dir>/checkpoints/<shard>``.
        start, stop: the shard's global row range.
        schema: the output schema, carrying the fingerprint and the shard id.
        below: the output directory: no directory between it and
            ``directory`` (or the committed shard file) may be a symlink.
    """

    def __init__(
        self, directory: str | Path, start: int, stop: int, schema: pa.Schema, below: str | Path | None = None
    ) -> None:
        super().__init__(directory, below)
        self.start, self.stop = start, stop
        self.schema = schema
        self.fingerprint = schema.metadata[FINGERPRINT_KEY].decode()
        self.shard_id = schema.metadata[SHARD_KEY].decode()
        # called before every write of the shard's files: an elastic worker's claim check
        # (claims.Claim.check), which raises when another worker took the shard over
        self.guard: Callable[[], None] = lambda: None
        self.per_row = rows_per_input(schema)
        self.rows = stop - start
        self._tables: list[pa.Table] = []
        self._parts: list[str] = []
        self._next = 0
        self.discarded: list[str] = []
        self.foreign: list[str] = []
        # input rows in the parts read or written here
        self.saved_inputs = 0
        # per-row errors among the resumed rows
        self.resumed_errors = 0
        self.first_error: str | None = None

    def resume(self) -> set[int]:
        """Load every usable part; return the row indexes already done.

        A part that cannot be read, that has another fingerprint (the config
        changed), other columns, or rows outside the shard is moved aside to
        ``discarded/``, and its rows are generated again. A file shardgen did
        not write (another name, or a part of another shard) is left alone.
        """
        done: set[int] = set()
        d = self.dir
        for name in d.names():
            m = PART_NAME.fullmatch(name)
            if m is None:
                if _TMP_NAME.fullmatch(name):
                    d.unlink(name)  # a write the job died in
                elif name not in (ATTEMPTS, PROGRESS, DISCARDED):
                    self.foreign.append(name)
                continue
            self._next = max(self._next, int(m.group(1)) + 1)
            if not d.is_file(name):
                self.foreign.append(name)
                continue
            reason = None
            try:
                with d.open_read(name) as f:
                    table = pq.read_table(f)
            except (pa.ArrowInvalid, OSError) as e:
                reason = f"unreadable ({e})"
            else:
                meta = table.schema.metadata or {}
                if meta.get(SHARD_KEY, b"").decode() != self.shard_id:
                    self.foreign.append(name)  # not this shard's: not ours to touch
                    continue
                idx = table.column("row_index").to_numpy() if "row_index" in table.column_names else np.array([])
                rows = set(idx.tolist())
                if meta.get(FINGERPRINT_KEY, b"").decode() != self.fingerprint:
                    reason = "made with another configuration"
                elif not table.schema.remove_metadata().equals(self.schema.remove_metadata()):
                    reason = "has other columns"
                elif count_problems(idx, self.start, self.stop, self.per_row) != (self.rows - len(rows), 0):
                    reason = "has rows outside the shard or repeated rows"
                elif done.intersection(rows):
                    reason = "repeats rows of an earlier part"
            if reason:
                self._discard(name, reason)
                continue
            done.update(rows)
            self.saved_inputs += len(rows)
            self._tables.append(table)
            self._parts.append(name)
            bad = table.filter(table.column("error").is_valid())
            self.resumed_errors += len(set(bad.column("row_index").to_pylist()))
            if self.first_error is None and bad.num_rows:
                self.first_error = f"row {bad.column('row_index')[0]}: {bad.column('error')[0]}"
        if self.foreign:
            log.warning("%s holds files shardgen did not write; left alone: %s", self.path, ", ".join(self.foreign))
        return done

    def _discard(self, name: str, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        with self.dir.sub(DISCARDED) as aside:
            new = f"{stamp}-{name}"
            self.dir.move(name, aside, new)
        log.warning("checkpoint %s %s: moved to %s; its rows will be generated again", name, reason, aside.path / new)
        self.discarded.append(f"{name}: {reason} (moved to {DISCARDED}/{new})")

    def narrow(self, stop: int) -> None:
        """The shard now ends at ``stop`` (a split: every row saved so far is below it)."""
        self.stop, self.rows = stop, stop - self.start

    def flush(self, rows: list[dict[str, Any]]) -> None:
        """Write finished rows as one new part file."""
        if not rows:
            return
        self.guard()
        table = arrow_table(rows, self.schema)
        name = f"part-{self._next:06d}.parquet"
        self.dir.write_atomic(name, lambda f: pq.write_table(table, f, compression="zstd"))
        self.saved_inputs += len(set(table.column("row_index").to_pylist()))
        self._next += 1
        self._tables.append(table)
        self._parts.append(name)

    # -- the record of attempts -----------------------------------------------------------------

    def log_attempt(self, record: records.AttemptStart | records.AttemptEnd) -> None:
        """Append one event (an attempt's start or end) to ``attempts.jsonl``; like every write, only while
        the shard is still this attempt's (``guard``): a worker that lost its claim must not end the
        attempt of the worker that took the shard over."""
        self.guard()
        self.dir.append_line(ATTEMPTS, record.line())

    def attempts(self) -> list[records.Attempt]:
        """Each attempt so far (``records.read_attempts``)."""
        return records.read_attempts(self.dir.read_text(ATTEMPTS)) if self.dir.exists(ATTEMPTS) else []

    def write_progress(self, progress: records.Progress) -> None:
        self.guard()
        self.dir.write_atomic(PROGRESS, lambda f: f.write(progress.text().encode()))

    # -- commit -----------------------------------------------------------------------------------

    def commit(self, path: str | Path, write_stats: Callable[[pa.Table], None]) -> pa.Table:
        """Assemble the shard file from the parts, in input order; then ``write_stats(table)``; only then
        remove the parts. A failure before the stats are written (a full disk, a kill) leaves the parts,
        which the next attempt resumes whole: a shard file and its stats are both there before anything
        the retry needs goes.

        Only the parts read or written here and shardgen's own records are
        removed, and the directory only when nothing else is left in it.

        Raises:
            InputError: the parts do not hold every row of the shard exactly once.
        """
        table = pa.concat_tables(self._tables) if self._tables else self.schema.empty_table()
        keys = [k for k in ("row_index", "sample_index") if k in table.column_names]
        table = table.sort_by([(k, "ascending") for k in keys])
        missing, extra = count_problems(table.column("row_index").to_numpy(), self.start, self.stop, self.per_row)
        if missing or extra:
            raise InputError(f"shard rows [{self.start}, {self.stop}): {missing} missing, {extra} repeated")
        self.guard()
        write_table(table.replace_schema_metadata(self.schema.metadata), path, self.below)
        self.guard()
        write_stats(table)
        for name in [*self._parts, ATTEMPTS, PROGRESS]:
            self.dir.unlink(name)
        self.close()
        with Dir.open(self.path.parent, below=self.below) as parent:
            parent.rmdir(self.path.name)
        return table
