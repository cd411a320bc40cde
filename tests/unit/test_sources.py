"""Sources: a shard's rows are read exactly, streaming, from Parquet and from datasets."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from shardgen.data.manifest import Manifest
from shardgen.data.plan import build_manifest
from shardgen.data.sources import HFSource, ParquetSource
from shardgen.errors import InputError
from tests.conftest import base_config, make_rows


def _read_ids(source, shard) -> list[str]:
    return [r["id"] for b in source.read(shard.segments, batch_rows=4) for r in b.to_pylist()]


def test_each_parquet_shard_reads_exactly_its_rows(parquet_files):
    m = Manifest(
        build_manifest(base_config({"parquet": [str(f) for f in parquet_files]}, shards={"rows_per_shard": 6}))
    )
    source = m.source()
    got = [_read_ids(source, s) for s in m.shards]
    assert got == [[f"r{i:05d}" for i in range(s.start, s.stop)] for s in m.shards]


def test_a_changed_input_file_is_refused_after_planning(parquet_files):
    m = Manifest(build_manifest(base_config({"parquet": [str(f) for f in parquet_files]})))
    st = parquet_files[1].stat()
    os.utime(parquet_files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    source = m.source()
    with pytest.raises(InputError, match="part-1.parquet' changed after planning"):
        _read_ids(source, m.shard("00001"))
    # shards that do not touch the changed file still read
    assert len(_read_ids(source, m.shard("00000"))) == 8


def test_a_non_parquet_file_is_named(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(InputError, match="bad.parquet' is not a valid Parquet file"):
        ParquetSource.scan([str(bad)])


def test_a_saved_dataset_shard_reads_exactly_its_rows(tmp_path):
    import datasets

    datasets.Dataset.from_list(make_rows(20)).save_to_disk(tmp_path / "ds")
    m = Manifest(build_manifest(base_config({"disk": str(tmp_path / "ds")}, shards={"rows_per_shard": 7})))
    assert [(s.start, s.stop) for s in m.shards] == [(0, 7), (7, 14), (14, 20)]
    source = m.source()
    assert _read_ids(source, m.shard("00001")) == [f"r{i:05d}" for i in range(7, 14)]


def test_a_dataset_dict_needs_a_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(3))}).save_to_disk(tmp_path / "dd")
    with pytest.raises(InputError, match=r"several splits \(train\)"):
        HFSource.open("disk", {"path": str(tmp_path / "dd")})


def test_load_dataset_arguments_are_passed_through(parquet_files):
    config = base_config({"hf": {"path": "parquet", "data_files": [str(f) for f in parquet_files], "split": "train"}})
    m = Manifest(build_manifest(config))
    assert m.total_rows == 30
    assert _read_ids(m.source(), m.shard("00003")) == [f"r{i:05d}" for i in range(24, 30)]


def test_segments_agree_with_a_walk_over_every_file_for_every_range_including_empty_files():
    from shardgen.data.sources import ParquetFileInfo, ParquetSource

    sizes = [3, 0, 5, 1, 0, 0, 4]
    src = ParquetSource([ParquetFileInfo(f"f{i}", 0, 0, n) for i, n in enumerate(sizes)], pa.schema([]))

    def walk(start, stop):
        segs, offset = [], 0
        for i, n in enumerate(sizes):
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                segs.append((i, lo - offset, hi - offset))
            offset += n
        return segs

    total = sum(sizes)
    for start in range(total + 1):
        for stop in range(start, total + 2):
            assert [(s.file, s.start, s.stop) for s in src.segments(start, stop)] == walk(start, stop)


def test_arrow_view_types_are_read_as_plain_types_and_a_shard_of_them_commits(tmp_path):
    """string_view and binary_view columns (what recent writers produce) would fail the sort at
    commit, after all the GPU work: they are read as large_string and large_binary, nested ones too.
    A list view, which pyarrow cannot convert correctly, is refused when planned, naming the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardgen.data.outputs import ShardCheckpoint
    from shardgen.requests.results import result_spec

    rows = 10
    table = pa.table(
        {
            "topic": pa.array([f"t{i}" for i in range(rows)], pa.string_view()),
            "raw": pa.array([b"x"] * rows, pa.binary_view()),
            "meta": pa.array([{"tag": "a"}] * rows, pa.struct([("tag", pa.string_view())])),
        }
    )
    pq.write_table(table, tmp_path / "views.parquet")
    config = base_config({"parquet": [str(tmp_path / "views.parquet")]}, shards={"rows_per_shard": 10})
    source = Manifest(build_manifest(config)).source()
    assert [str(f.type) for f in source.schema] == ["large_string", "large_binary", "struct<tag: large_string>"]
    (shard,) = Manifest(build_manifest(config)).shards
    batches = list(source.read(shard.segments))
    assert all(b.schema == source.schema for b in batches)
    schema = result_spec(config).schema(source.schema, "fp", "cfg", shard.id)
    ckpt = ShardCheckpoint(tmp_path / "ckpt", 0, rows, schema)
    ckpt.resume()
    done = [
        {**row, "row_index": i, "generation": "g", "finish_reason": "stop", "prompt_tokens": 1,
         "generated_tokens": 1, "error": None}
        for i, row in zip(range(rows - 1, -1, -1), reversed(pa.Table.from_batches(batches).to_pylist()), strict=True)
    ]  # fmt: skip
    ckpt.flush(done)
    out = ckpt.commit(tmp_path / "shard.parquet", lambda table: None)
    assert out.column("topic").to_pylist() == [f"t{i}" for i in range(rows)]

    pq.write_table(pa.table({"topic": pa.array([[1]], pa.list_view(pa.int64()))}), tmp_path / "lv.parquet")
    with pytest.raises(InputError, match=r"column 'topic' of '.*lv.parquet' has the Arrow type list_view"):
        build_manifest(base_config({"parquet": [str(tmp_path / "lv.parquet")]}))


def test_a_local_data_file_of_an_hf_input_decides_replanning_as_a_parquet_file_does(tmp_path):
    """input.hf with data_files: a file edited after planning changes the signature that decides
    whether the plan is made again (jobs compare the dataset's fingerprint, which follows the files),
    whether data_files is a path, a pattern, a list or a dict of splits, and relative to a local path."""
    import time

    from shardgen.config import InputConfig
    from shardgen.data.sources import input_signature

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"topic": "x"}\n' * 8)
    (data / "b.jsonl").write_text('{"topic": "y"}\n')
    forms = [
        {"path": "json", "data_files": str(data / "a.jsonl")},
        {"path": "json", "data_files": str(data / "*.jsonl")},
        {"path": "json", "data_files": [str(data / "a.jsonl"), str(data / "b.jsonl")]},
        {"path": "json", "data_files": {"train": [str(data / "a.jsonl")]}},
        {"path": str(data), "data_files": "a.jsonl"},
        {"path": str(data)},
    ]
    before = [input_signature(InputConfig(hf=args)) for args in forms]
    assert all(any(p.endswith("a.jsonl") for p, *_ in sig) for sig in before), before
    time.sleep(0.01)
    (data / "a.jsonl").write_text('{"topic": "x"}\n' * 10)  # grew from 8 rows to 10
    after = [input_signature(InputConfig(hf=args)) for args in forms]
    assert all(b != a for b, a in zip(before, after, strict=True))
    assert input_signature(InputConfig(hf={"path": "org/some-hub-dataset"})) == []


def test_a_glob_that_reaches_a_file_twice_lists_it_once(tmp_path):
    """glob.glob returns 'data/sub/x' once for each way 'data/**/**' reaches 'data/sub' (as S3's expansion,
    ``storage.glob_match``, does not): the file is named once, not refused as listed twice."""
    from shardgen.data.sources import expand_patterns

    for path in ("data/a.parquet", "data/sub/b.parquet", "data/sub/deeper/c.parquet"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"x")
    got = expand_patterns([str(tmp_path / "data/**/**/*.parquet")], "input.parquet")
    assert [os.path.relpath(p, tmp_path) for p in got] == [
        "data/a.parquet", "data/sub/b.parquet", "data/sub/deeper/c.parquet"]  # fmt: skip


# -- What the core asks of a source kind (sources.SourceKind) ----------------------------------------------


def test_a_source_kinds_row_checks_and_dropped_rows_reach_the_feed_which_names_neither(monkeypatch):
    """The feed asks the source's kind for the checks of each row (a row they refuse is that row's
    error) and whether a row may be one it drops (``dropped`` set: passed by, no request); the core's
    own kinds have neither, so a Parquet column named ``dropped`` is just a column."""
    from types import SimpleNamespace

    from shardgen.data import sources
    from shardgen.errors import RowError
    from shardgen.jobs.feed.requests import RowInputs, prepared_requests

    def row_check(config):
        def check(row):
            if row.get("bad"):
                raise RowError("refused_by_source", f"{config.task} refuses it")

        return check

    probe = sources.SourceKind(lambda entry: None, row_check=row_check, drops_rows=True)
    monkeypatch.setitem(sources.KINDS, "probe", probe)
    config = base_config({"parquet": ["x.parquet"]})
    rows = [{"p": "a"}, {"p": "b", "bad": True}, {"p": "c", "dropped": "not passed on"}, {"p": "d"}]
    renderer = SimpleNamespace(render_batch=lambda rows: [r["p"] for r in rows])
    tokenizer = SimpleNamespace(encode_batch=lambda prompts: [[ord(p)] for p in prompts])
    task = SimpleNamespace(params=lambda index, row: None)

    def feed(kind: str) -> tuple[list[int], list[tuple[int, str]]]:
        errors: list[tuple[int, str]] = []
        inputs = RowInputs.for_run(config, SimpleNamespace(kind=kind))
        requests = prepared_requests(
            iter(enumerate(rows)), renderer, tokenizer, task, lambda i, row, e: errors.append((i, str(e))), None, inputs
        )
        return [r.key for r in requests], errors

    assert feed("probe") == ([0, 3], [(1, "refused_by_source: generate refuses it"), (2, "dropped: not passed on")])
    assert feed("parquet") == ([0, 1, 2, 3], [])
    assert sources.source_kind("parquet").read_at_preflight and not sources.source_kind("hf").ids_planned


def test_the_features_source_kinds_answer_for_their_rows():
    """A batch file's rows are requests checked as such, whose ids planning read; the step before's
    rows may be dropped ones, do not exist at the preflight, and are identified by its shards."""
    from shardgen.data import sources

    batch, step = sources.source_kind("openai_batch"), sources.source_kind("step")
    assert batch.row_check is not None and batch.ids_planned and batch.read_at_preflight and not batch.drops_rows
    assert step.drops_rows and not step.read_at_preflight and step.rows_identity is not None
    assert step.row_check is None and not step.ids_planned
