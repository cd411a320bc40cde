"""Sources: a shard's rows are read exactly, streaming, from Parquet and from datasets."""

from __future__ import annotations

import os

import pytest

from shardgen.errors import InputError
from shardgen.plan import Manifest, build_manifest
from shardgen.sources import HFSource, ParquetSource
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
    from shardgen.sources import ParquetFileInfo, ParquetSource

    sizes = [3, 0, 5, 1, 0, 0, 4]
    src = ParquetSource([ParquetFileInfo(f"f{i}", 0, 0, n) for i, n in enumerate(sizes)], None)

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
