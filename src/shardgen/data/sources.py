"""Input datasets: Parquet files or a Hugging Face dataset, read in place, and the kinds of input
features add (``register_source``), which the core asks what it needs to know of them (``SourceKind``).

A source is described by metadata alone (file sizes, Parquet footers, the
dataset's length), which is what planning needs. A generate job reads only
its shard's rows, streaming record batches; nothing is copied.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from shardgen.base import storage
from shardgen.base.registry import Registry
from shardgen.data.manifest import Segment
from shardgen.errors import InputError

if TYPE_CHECKING:
    from shardgen.config import InputConfig, RunConfig

log = logging.getLogger(__name__)

BATCH_ROWS = 1024


@dataclass(frozen=True)
class ParquetFileInfo:
    """What planning records of one Parquet file, and what a job checks again."""

    path: str  # a local path, or an object's s3:// URL
    size: int
    mtime_ns: int  # (0 for an object: its ETag says whether it changed)
    rows: int
    row_groups: list[int] = field(default_factory=list)
    etag: str | None = None  # an object's


def expand_parquet_patterns(patterns: list[str]) -> list[str]:
    return expand_patterns(patterns, "input.parquet")


def expand_inputs(patterns: list[str], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """``input.parquet``: local paths and ``s3://`` URLs (each with globs), in config order."""
    out: list[str] = []
    for pattern in patterns:
        if storage.is_url(pattern):
            out += storage.expand([pattern], storage_options, "input.parquet")
        else:
            out += expand_parquet_patterns([pattern])
    if len(set(out)) < len(out):
        twice = next(p for p in out if out.count(p) > 1)
        raise InputError(f"input.parquet: '{twice}' is listed twice; its rows would be processed twice")
    return out


def expand_patterns(patterns: list[str], key: str) -> list[str]:
    """Paths in config order; each glob's matches sorted by name.

    Raises:
        InputError: a path does not exist or a glob matches nothing (naming ``key``).
    """
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            # (a set: glob.glob returns a file once for each way a 'a/**/**' pattern reaches it)
            matches = sorted({p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)})
            if not matches:
                raise InputError(f"{key}: the pattern '{pattern}' matches no file")
            files.extend(matches)
        elif os.path.isfile(pattern):
            files.append(pattern)
        elif os.path.exists(pattern):
            raise InputError(f"{key}: '{pattern}' is not a file")
        else:
            raise InputError(f"{key}: no such file: '{pattern}'")
    seen: set[str] = set()
    for f in files:
        real = os.path.realpath(f)
        if real in seen:
            raise InputError(f"{key}: the file '{f}' is listed twice; its rows would be processed twice")
        seen.add(real)
    return files


def _parquet_file(path: str, options: Mapping[str, Any] | None = None, opened: Any = None) -> pq.ParquetFile:
    try:
        if storage.is_url(path):  # its footer and row groups are ranged reads
            return pq.ParquetFile(opened if opened is not None else storage.open_input(path, options))
        return pq.ParquetFile(path)
    except PermissionError as e:
        raise InputError(f"input: cannot read '{path}': permission denied") from e
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"input: '{path}' is not a valid Parquet file ({e})") from e


def describe_parquet(
    path: str, options: Mapping[str, Any] | None = None, reads: list[int] | None = None
) -> tuple[ParquetFileInfo, pa.Schema]:
    """Read one file's footer: row counts per row group and the schema (an object's: and its size and
    ETag, from the HEAD that opened it; the bytes its footer took are appended to ``reads``)."""
    opened = storage.open_input(path, options) if storage.is_url(path) else None
    counted = storage.CountingFile(opened) if opened is not None else None
    pf = _parquet_file(path, options, counted)
    md = pf.metadata
    groups = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    if opened is not None and counted is not None:
        info = ParquetFileInfo(path, opened.size(), 0, md.num_rows, groups, storage.etag(opened))
        if reads is not None:
            reads.append(counted.read_bytes)
        counted.close()
        return info, pf.schema_arrow
    st = os.stat(path)
    return ParquetFileInfo(path, st.st_size, st.st_mtime_ns, md.num_rows, groups), pf.schema_arrow


def _check_object(info: ParquetFileInfo, size: int, etag: str | None, when: str) -> None:
    """Refuse an object whose size or ETag (a HEAD's: ``size``, ``etag``) is not the planned one.

    Raises:
        InputError: naming it, and ``when`` it changed (after planning, while it was read).
    """
    if (size, etag) != (info.size, info.etag):
        raise InputError(
            f"input: the object '{info.path}' changed {when} (size {info.size} -> {size}, ETag {info.etag} -> "
            f"{etag}); rerun the workflow to plan it again"
        )


def plain_type(t: pa.DataType, column: str, where: str) -> pa.DataType:
    """``t`` without Arrow's view types, which the output's sorts and writers cannot take: a
    ``string_view`` (what recent writers such as Polars produce) is read as ``large_string``, a
    ``binary_view`` as ``large_binary``, inside lists, structs and maps too.

    Raises:
        InputError: a list view (pyarrow cannot convert it correctly), naming the column and file.
    """
    if pa.types.is_string_view(t):
        return pa.large_string()
    if pa.types.is_binary_view(t):
        return pa.large_binary()
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        raise InputError(
            f"input: column '{column}' of {where} has the Arrow type {t}, which shardgen cannot read correctly; "
            "write the file with list types (in pyarrow: cast the column to pa.list_(...))"
        )
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(plain_type(f.type, column, where)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(plain_type(t.key_type, column, where), plain_type(t.item_type, column, where))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type, column, where)), t.list_size)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        make = pa.list_ if pa.types.is_list(t) else pa.large_list
        return make(t.value_field.with_type(plain_type(t.value_type, column, where)))
    return t


def plain_schema(schema: pa.Schema, where: str) -> pa.Schema:
    """``schema`` without view types (``plain_type``)."""
    return pa.schema([f.with_type(plain_type(f.type, f.name, where)) for f in schema], schema.metadata)


class ParquetSource:
    """Parquet files, in a fixed order, as one table of rows. Columns of Arrow's view types are read
    as their plain types (``plain_type``)."""

    kind = "parquet"

    def __init__(
        self, files: list[ParquetFileInfo], schema: pa.Schema, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self.files = files
        self.storage_options = dict(storage_options or {})  # where s3:// objects are (input.storage_options)
        self.schema = plain_schema(schema, f"'{files[0].path}'" if files else "the input")
        # global index of each file's first row, and the total at the end
        self._offsets = list(itertools.accumulate((f.rows for f in files), initial=0))
        # planning's reads of objects: (objects, bytes read, their bytes), set by ``scan``
        self.objects_read: tuple[int, int, int] | None = None

    @classmethod
    def scan(cls, patterns: list[str], storage_options: Mapping[str, Any] | None = None) -> ParquetSource:
        """Describe the files (and ``s3://`` objects) the patterns name, from their footers only (an
        object's: ranged reads, several objects at once).

        Raises:
            InputError: a file is missing, not Parquet, or its columns differ
                from the first file's.
        """
        infos: list[ParquetFileInfo] = []
        schema: pa.Schema | None = None
        first = ""
        paths = expand_inputs(patterns, storage_options)
        reads: list[int] = []  # what each object's footer took (local files: not counted)
        described = storage.parallel(lambda p: describe_parquet(p, storage_options, reads), paths)
        for path, (info, file_schema) in zip(paths, described, strict=True):
            if schema is None:
                schema, first = file_schema, path
            elif not file_schema.remove_metadata().equals(schema.remove_metadata()):
                raise InputError(
                    f"input: '{path}' has other columns or types than '{first}': {_schema_diff(schema, file_schema)}"
                )
            infos.append(info)
        assert schema is not None
        source = cls(infos, schema.remove_metadata(), storage_options)
        if reads:
            size = sum(f.size for f in infos if storage.is_url(f.path))
            source.objects_read = (len(reads), sum(reads), size)
            log.info("planned %d object(s) from their footers: read %d of their %d bytes (%.2f%%)", len(reads),
                     sum(reads), size, 100 * sum(reads) / max(size, 1))  # fmt: skip
        return source

    @property
    def num_rows(self) -> int:
        return sum(f.rows for f in self.files)

    def describe(self) -> str:
        names = ", ".join(f"'{f.path}'" for f in self.files[:3])
        return f"input.{self.kind} ({len(self.files)} file(s): {names}{', ...' if len(self.files) > 3 else ''})"

    def to_manifest(self) -> dict[str, Any]:
        out = {"kind": self.kind, "files": [asdict(f) for f in self.files]}
        return out | ({"storage_options": self.storage_options} if self.storage_options else {})

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> ParquetSource:
        files = [ParquetFileInfo(**f) for f in entry["files"]]
        options = entry.get("storage_options")
        _, schema = describe_parquet(files[0].path, options)
        return cls(files, schema.remove_metadata(), options)

    def segments(self, start: int, stop: int) -> list[Segment]:
        """Split global rows ``[start, stop)`` into per-file segments (a bisect: planning
        10,000 shards over 1,000 files must not walk every file for every shard)."""
        segs: list[Segment] = []
        off = self._offsets
        i = max(bisect.bisect_right(off, start) - 1, 0)
        while i < len(self.files) and off[i] < stop:
            lo, hi = max(start, off[i]), min(stop, off[i + 1])
            if lo < hi:
                segs.append(Segment(i, lo - off[i], hi - off[i]))
            i += 1
        return segs

    def check_unchanged(self, indexes: set[int] | None = None) -> None:
        """Refuse files (these indexes, or all) whose size or modification time changed since planning."""
        for i in sorted(range(len(self.files)) if indexes is None else indexes):
            f = self.files[i]
            if storage.is_url(f.path):
                _check_object(f, *storage.head(f.path, self.storage_options), "after planning")
                continue
            try:
                st = os.stat(f.path)
            except OSError as e:
                raise InputError(f"input: '{f.path}' is gone since planning ({e})") from e
            if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
                raise InputError(
                    f"input: '{f.path}' changed after planning (size {f.size} -> {st.st_size}, "
                    "modification time changed); rerun the workflow to plan it again"
                )

    def read(
        self, segments: list[Segment], batch_rows: int = BATCH_ROWS, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Stream the rows of the segments (only ``columns`` if given), reading only the row groups they touch."""
        self.check_unchanged({s.file for s in segments})
        for seg in segments:
            info = self.files[seg.file]
            if storage.is_url(info.path):
                yield from self._read_object(info, seg, batch_rows, columns)
                continue
            yield from self._read_file(info, seg, batch_rows, columns)

    def _read_file(
        self, info: ParquetFileInfo, seg: Segment, batch_rows: int, columns: list[str] | None, opened: Any = None
    ) -> Iterator[pa.RecordBatch]:
        """The rows of one segment of a file (of an object: ``opened``), reading only the row groups it touches."""
        pf = _parquet_file(info.path, self.storage_options, opened)
        groups, first_row = [], 0
        offset = 0
        for g, n in enumerate(info.row_groups):
            if offset + n > seg.start and offset < seg.stop:
                if not groups:
                    first_row = offset
                groups.append(g)
            offset += n
        pos = first_row
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=groups, columns=columns, use_threads=False)
        for batch in map(self._plain, batches):
            lo, hi = max(seg.start, pos), min(seg.stop, pos + batch.num_rows)
            if lo < hi:
                yield batch.slice(lo - pos, hi - lo)
            pos += batch.num_rows
            if pos >= seg.stop:
                break

    def _read_object(
        self, info: ParquetFileInfo, seg: Segment, batch_rows: int, columns: list[str] | None
    ) -> Iterator[pa.RecordBatch]:
        """``_read_file`` of an object, never across two versions of it: its ranged reads carry no
        If-Match, so an object rewritten after the HEAD that opened it would give the rows read after the
        rewrite from the new bytes. The handle's ETag (the opening HEAD's) must be the planned one, and
        before rows are yielded, a HEAD must still find it whenever anything was read since the last one.

        Raises:
            InputError: the object changed after planning, or while it was read, naming it.
        """
        options = self.storage_options
        opened = storage.open_input(info.path, options)
        with contextlib.closing(storage.CountingFile(opened)) as counted:
            _check_object(info, opened.size(), storage.etag(opened), "after planning")
            checked = 0  # what was read (footer, row groups, prefetched ranges) before the last HEAD
            rows = self._read_file(info, seg, batch_rows, columns, counted)
            while True:
                try:
                    batch = next(rows, None)
                except (pa.ArrowException, InputError):  # the bytes of two versions may not even decode
                    _check_object(info, *storage.head(info.path, options), "while it was read")
                    raise
                if batch is None:
                    return
                read = counted.read_bytes  # (before the HEAD: a read that ends during it is checked next time)
                if read != checked:
                    _check_object(info, *storage.head(info.path, options), "while it was read")
                    checked = read
                yield batch

    def _plain(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch in the source's types (views read as plain types)."""
        if all(batch.schema.field(i).type == self.schema.field(name).type for i, name in enumerate(batch.schema.names)):
            return batch
        types = [self.schema.field(name).type for name in batch.schema.names]
        return pa.RecordBatch.from_arrays([c.cast(t) for c, t in zip(batch.columns, types, strict=True)],
                                          names=batch.schema.names)  # fmt: skip

    def byte_blocks(self, columns: list[str]) -> Iterator[tuple[int, int]]:
        """``(rows, bytes)`` of each row group in row order: the uncompressed size of the ``columns``
        (every leaf of a nested one), from the files' footers only."""
        wanted = set(columns)
        for info in self.files:
            md = _parquet_file(info.path, self.storage_options).metadata
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                size = sum(
                    rg.column(c).total_uncompressed_size
                    for c in range(rg.num_columns)
                    if rg.column(c).path_in_schema.split(".")[0] in wanted
                )
                yield rg.num_rows, size


class HFSource:
    """A Hugging Face ``datasets.Dataset``: from ``load_dataset`` or ``load_from_disk``.

    The dataset's Arrow files are memory-mapped; a shard is a contiguous
    ``select`` of it, which copies nothing.
    """

    def __init__(self, kind: str, args: dict[str, Any], fingerprint: str, num_rows: int) -> None:
        self.kind = kind
        self.args = args
        self.fingerprint = fingerprint
        self._num_rows = num_rows
        self._dataset = None

    @staticmethod
    def _load(kind: str, args: dict[str, Any]):
        import datasets

        try:
            if kind == "disk":
                ds = datasets.load_from_disk(args["path"])
            else:
                kwargs = {k: v for k, v in args.items() if v is not None}
                ds = datasets.load_dataset(**kwargs)
        except FileNotFoundError as e:
            raise InputError(f"input.{kind}: cannot load '{args['path']}': {e}") from e
        except Exception as e:
            raise InputError(f"input.{kind}: cannot load '{args['path']}': {type(e).__name__}: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            raise InputError(
                f"input.{kind}: '{args['path']}' holds several splits ({', '.join(ds)}); "
                + ("point input.disk at one split's directory" if kind == "disk" else "set input.hf.split")
            )
        return ds

    @classmethod
    def open(cls, kind: str, args: dict[str, Any]) -> HFSource:
        ds = cls._load(kind, args)
        src = cls(kind, args, ds._fingerprint, len(ds))
        src._dataset = ds
        return src

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = self._load(self.kind, self.args)
            if self._dataset._fingerprint != self.fingerprint or len(self._dataset) != self._num_rows:
                local = self.kind == "disk" or hf_local_files(self.args)
                raise InputError(
                    f"input.{self.kind}: the dataset '{self.args['path']}' changed after planning; "
                    + ("rerun the workflow to plan it again" if local else
                       "a hub dataset without input.hf.revision follows its branch: pin input.hf.revision, or plan "
                       "it again with `snakemake --profile ... --forcerun plan_shards`")
                )  # fmt: skip
        return self._dataset

    @property
    def schema(self) -> pa.Schema:
        return self.dataset.features.arrow_schema.remove_metadata()

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def describe(self) -> str:
        return f"input.{self.kind} ('{self.args['path']}')"

    def to_manifest(self) -> dict[str, Any]:
        return {"kind": self.kind, "args": self.args, "fingerprint": self.fingerprint, "rows": self._num_rows}

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> HFSource:
        return cls(entry["kind"], entry["args"], entry["fingerprint"], entry["rows"])

    def segments(self, start: int, stop: int) -> list[Segment]:
        return [Segment(0, start, stop)] if start < stop else []

    def check_unchanged(self, indexes: set[int] | None = None) -> None:
        """Refuse a dataset whose fingerprint or length changed since planning."""
        _ = self.dataset

    def read(
        self, segments: list[Segment], batch_rows: int = BATCH_ROWS, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        ds = self.dataset if columns is None else self.dataset.select_columns(columns)
        for seg in segments:
            part = ds.select(range(seg.start, seg.stop)).with_format("arrow")
            for table in part.iter(batch_size=batch_rows):
                yield from table.to_batches()

    def byte_blocks(self, columns: list[str], block_rows: int = BATCH_ROWS) -> Iterator[tuple[int, int]]:
        """``(rows, bytes)`` of each block of ``block_rows`` rows: the Arrow buffer sizes of the
        ``columns`` in the memory-mapped dataset (sizes come from offsets, no value is decoded)."""
        for batch in self.read(self.segments(0, self.num_rows), block_rows, columns):
            yield batch.num_rows, batch.nbytes


class Source(Protocol):
    """What planning, the jobs and the merge ask of an input: ``ParquetSource``, ``HFSource``, or a
    kind a feature adds (``KINDS``)."""

    kind: str
    schema: pa.Schema

    @property
    def num_rows(self) -> int: ...

    def describe(self) -> str: ...

    def to_manifest(self) -> dict[str, Any]: ...

    def segments(self, start: int, stop: int) -> list[Segment]: ...

    def check_unchanged(self, indexes: set[int] | None = None) -> None: ...

    def read(
        self, segments: list[Segment], batch_rows: int = BATCH_ROWS, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]: ...

    def byte_blocks(self, columns: list[str]) -> Iterator[tuple[int, int]]: ...


@dataclass(frozen=True)
class SourceKind:
    """A source kind a feature adds, known by the name its manifest entry records: how a plan's entry is
    read back, and, for one that an input key selects (``key``), how planning opens it and which local
    files it reads (``input_signature``). The core asks it the rest instead of naming the feature:

    - ``row_check``: for a run's config, the check of each row before it becomes a request (raising the
      row's ``RowError``: a request that is not valid, or for a url the run does not serve); None: none;
    - ``drops_rows``: its rows may carry ``results.DROPPED``, why a row is not this run's (a row the run
      before did not pass on): a job passes such a row by without an error, the merge leaves it out;
    - ``read_at_preflight``: its rows exist when the preflight runs, which reads them (checked unchanged,
      sampled); false for rows a run before this one makes after its preflight;
    - ``ids_planned``: planning read every row's id (``input.id_column``) and refused a missing or
      repeated one, so the preflight does not read them again (several rows of one request share it);
    - ``rows_identity``: what identifies a plan's shard's rows (``identity.shard_fingerprint``), from the
      source and the shard (``manifest.Shard``), for an entry without ``files``; None: the entry's
      ``fingerprint`` and the shard's bounds.
    """

    from_manifest: Callable[[dict[str, Any]], Source]
    key: str | None = None
    open: Callable[[InputConfig, bool], Source] | None = None
    files: Callable[[InputConfig], list[str]] | None = None
    row_check: Callable[[RunConfig], Callable[[dict[str, Any]], None] | None] | None = None
    drops_rows: bool = False
    read_at_preflight: bool = True
    ids_planned: bool = False
    rows_identity: Callable[[Any, Any], Any] | None = None


# The source kinds features add, by the name their manifest entries record (register_source).
KINDS: dict[str, SourceKind] = Registry()


def register_source(name: str, kind: SourceKind) -> None:
    KINDS[name] = kind


def _selected(input_cfg: InputConfig) -> SourceKind | None:
    """The feature's source kind that ``input`` selects, if any."""
    return next((k for k in KINDS.values() if k.key and getattr(input_cfg, k.key, None)), None)


def source_kind(name: str) -> SourceKind:
    """What the core asks of a source of kind ``name`` (a ``Source``'s ``kind``, a manifest entry's): a
    feature's registered kind, or the answers of the core's own (Parquet files, a Hugging Face dataset)."""
    return KINDS.get(name) or _CORE_KIND


def row_checks(config: RunConfig, kind: SourceKind) -> tuple[Callable[[dict[str, Any]], None], ...]:
    """The checks of each row of a run of ``config`` over a source of ``kind`` (``feed.RowInputs``)."""
    check = kind.row_check(config) if kind.row_check is not None else None
    return (check,) if check is not None else ()


def open_source(input_cfg: InputConfig, pairs: bool = False) -> Source:
    """Open the source that ``input`` in the config names (metadata only for Parquet); ``pairs``: the
    task scores pairs of texts (``tasks.Task.pairs``), which a batch file's requests hold several of."""
    if input_cfg.parquet:
        return ParquetSource.scan(list(input_cfg.parquet), input_cfg.storage_options)
    if (kind := _selected(input_cfg)) is not None and kind.open is not None:
        return kind.open(input_cfg, pairs)
    if input_cfg.hf:
        return HFSource.open("hf", dict(input_cfg.hf))
    if input_cfg.disk:
        path = input_cfg.disk
        if not Path(path).is_dir():
            raise InputError(f"input.disk: no such directory: '{path}'")
        return HFSource.open("disk", {"path": path})
    keys = ", ".join(f"input.{k}" for k in ("parquet", *(kind.key for kind in KINDS.values() if kind.key), "hf"))
    raise InputError(f"input: set one of {keys} or input.disk")


def input_signature(input_cfg: InputConfig) -> list[list[Any]]:
    """Size and modification time of every local input file, from ``stat`` alone (cheap enough for
    every Snakefile parse): a file edited in place changes it, so the run plans again instead of
    refusing the changed input in every job. Paths that do not exist are left to planning to name."""
    paths: list[str] = []
    kind = _selected(input_cfg)
    if input_cfg.parquet or (kind is not None and kind.files is not None):
        try:
            if input_cfg.parquet and any(storage.is_url(p) for p in input_cfg.parquet):
                return _object_signature(list(input_cfg.parquet), input_cfg.storage_options)
            paths = expand_parquet_patterns(list(input_cfg.parquet)) if input_cfg.parquet else kind.files(input_cfg)
        except InputError:
            return []
    elif input_cfg.disk and os.path.isdir(input_cfg.disk):
        paths = sorted(str(p) for p in Path(input_cfg.disk).iterdir() if p.is_file())
    elif input_cfg.hf:
        paths = hf_local_files(input_cfg.hf)
    out = []
    for path in paths:
        st = os.stat(path)
        out.append([path, st.st_size, st.st_mtime_ns])
    return out


def _object_signature(patterns: list[str], options: Mapping[str, Any] | None) -> list[list[Any]]:
    """``input_signature`` of Parquet input with ``s3://`` objects: each object's size and modification
    time from a listing (a request per pattern, not one per object), each local file's from ``stat``."""
    out = []
    for path in expand_inputs(patterns, options):
        if storage.is_url(path):
            info = storage.filesystem(options).get_file_info(storage.path_of(path))
            out.append([path, info.size, info.mtime_ns])
        else:
            st = os.stat(path)
            out.append([path, st.st_size, st.st_mtime_ns])
    return out


def hf_local_files(args: Mapping[str, Any]) -> list[str]:
    """The local files an ``input.hf`` dataset is built from: its ``data_files`` (a path or pattern,
    a list, or a dict of split to those; relative to ``path`` when that is a local directory), and
    the files of a local ``path`` directory. A hub dataset has none: pin ``input.hf.revision`` to
    plan it again when it changes."""
    base = Path(args["path"])
    local_dir = base.is_dir()
    data_files = args.get("data_files")
    patterns: list[str] = []
    for value in data_files.values() if isinstance(data_files, Mapping) else [data_files]:
        patterns += [value] if isinstance(value, str) else list(value or [])
    found: set[str] = set()
    for pattern in patterns:
        full = str(base / pattern) if local_dir and not os.path.isabs(pattern) else pattern
        found.update(p for p in glob.glob(full, recursive=True) if os.path.isfile(p))
    if local_dir and not patterns:
        found.update(str(p) for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))
    return sorted(found)


def source_from_manifest(entry: dict[str, Any]) -> Source:
    if entry["kind"] == "parquet":
        return ParquetSource.from_manifest(entry)
    if entry["kind"] in KINDS:
        return KINDS[entry["kind"]].from_manifest(entry)
    return HFSource.from_manifest(entry)


# The answers of the core's own kinds: every question's default.
_CORE_KIND = SourceKind(source_from_manifest)


def _schema_diff(a: pa.Schema, b: pa.Schema) -> str:
    fa = {f.name: str(f.type) for f in a}
    fb = {f.name: str(f.type) for f in b}
    parts = []
    if missing := sorted(set(fa) - set(fb)):
        parts.append(f"missing {missing}")
    if extra := sorted(set(fb) - set(fa)):
        parts.append(f"extra {extra}")
    if changed := sorted(n for n in set(fa) & set(fb) if fa[n] != fb[n]):
        parts.append("types differ for " + ", ".join(f"'{n}' ({fa[n]} vs {fb[n]})" for n in changed))
    if not parts:
        parts.append("column order differs")
    return "; ".join(parts)
