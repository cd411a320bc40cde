"""Merge: every planned row exactly once, in input order; refuses gaps, repeats and mixed configs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen.errors import MergeError
from shardgen.merge import merge
from shardgen.outputs import output_schema

INPUT = pa.schema([pa.field("text", pa.string())])
PLAN = [("00000", 0, 4), ("00001", 4, 8), ("00002", 8, 10)]


def write_plan(tmp_path, plan=PLAN):
    manifest = {
        "version": 1,
        "source": {"kind": "parquet", "files": []},
        "total_rows": plan[-1][2],
        "rows_per_shard": 4,
        "shards": [{"id": i, "start": a, "stop": b, "segments": []} for i, a, b in plan],
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def write_shard(shard_dir, shard_id, indexes, config_fp="cfg"):
    shard_dir.mkdir(parents=True, exist_ok=True)
    schema = output_schema(INPUT, f"fp-{shard_id}", config_fp, shard_id)
    rows = [
        {
            "text": f"t{i}",
            "row_index": i,
            "generation": f"g{i}",
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "generated_tokens": 3,
            "error": None,
        }
        for i in indexes
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), shard_dir / f"{shard_id}.parquet")
    stats = {
        "shard": shard_id,
        "rows": len(rows),
        "errors": 0,
        "prompt_tokens": 5 * len(rows),
        "generated_tokens": 3 * len(rows),
        "attempt_generated_tokens": 3 * len(rows),
        "attempt_prompt_tokens": 5 * len(rows),
        "attempt_requests": len(rows),
        "generation_seconds": 2.0,
        "wall_seconds": 3.0,
        "gpu_hours": 0.001,
        "histograms": {"ttft_s": {"10": len(rows)}},
    }
    (shard_dir / f"{shard_id}.stats.json").write_text(json.dumps(stats))


def complete(tmp_path):
    for shard_id, a, b in PLAN:
        write_shard(tmp_path / "shards", shard_id, range(a, b))


def test_merge_writes_every_row_once_in_input_order_with_summed_stats(tmp_path):
    complete(tmp_path)
    stats = merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("row_index").to_pylist() == list(range(10))
    assert table.column("text").to_pylist()[3] == "t3"
    assert stats["rows"] == 10 and stats["generated_tokens"] == 30
    assert stats["output_tokens_per_s"] == pytest.approx(30 / 6.0)
    assert len(stats["shards"]) == 3
    assert json.loads((tmp_path / "stats.json").read_text())["rows"] == 10


def test_merge_refuses_a_missing_row_and_names_the_shard(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00001", [4, 5, 7])
    with pytest.raises(MergeError, match="shard 00001: 1 rows missing, 0 rows repeated"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    assert not (tmp_path / "out.parquet").exists()


def test_merge_refuses_a_repeated_row(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00002", [8, 9, 9])
    with pytest.raises(MergeError, match="shard 00002: 0 rows missing, 1 rows repeated"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_merge_refuses_a_missing_shard(tmp_path):
    complete(tmp_path)
    (tmp_path / "shards" / "00000.parquet").unlink()
    with pytest.raises(MergeError, match=r"shard 00000: output missing \(4 rows\)"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_merge_refuses_shards_of_mixed_configurations(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00001", range(4, 8), config_fp="other")
    with pytest.raises(MergeError, match="2 different configurations"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
