"""Merge: every planned row exactly once, in input order, streamed into one file.

Each shard file is checked against the plan (its row range, row for row, and
the fingerprint all shards must share) while it is copied batch by batch into
the merged output, so memory stays flat however large the dataset is. The
merged stats are the sum of the shard stats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from shardgen.errors import MergeError
from shardgen.io import atomic_write, atomic_write_text
from shardgen.outputs import CONFIG_KEY, SHARD_KEY, output_schema
from shardgen.plan import Manifest
from shardgen.stats import merge_shard_stats, summary_text


def _check_rows(path: Path, start: int, stop: int) -> tuple[int, int]:
    """Missing and repeated (or out-of-range) row indexes of a shard file against ``[start, stop)``."""
    idx = pq.read_table(path, columns=["row_index"]).column(0).to_numpy()
    unique = np.unique(idx[(idx >= start) & (idx < stop)])
    return (stop - start) - len(unique), len(idx) - len(unique)


def merge(manifest_path: str | Path, shard_dir: str | Path, output: str | Path, stats_path: str | Path) -> dict:
    """Merge the shard files of a plan into ``output`` and ``stats_path``.

    Raises:
        MergeError: a shard file is missing, holds other rows than planned,
            or was made with another fingerprint than the others; the message
            names the shards and counts.
    """
    manifest = Manifest.load(manifest_path)
    shard_dir = Path(shard_dir)
    problems: list[str] = []
    fingerprints: dict[str, list[str]] = {}
    shard_stats: list[dict[str, Any]] = []
    for shard in manifest.shards:
        path = shard_dir / f"{shard.id}.parquet"
        if not path.exists():
            problems.append(f"shard {shard.id}: output missing ({shard.rows} rows)")
            continue
        meta = pq.read_schema(path).metadata or {}
        fp = meta.get(CONFIG_KEY, b"").decode()
        if meta.get(SHARD_KEY, b"").decode() != shard.id:
            problems.append(f"shard {shard.id}: the file {path} belongs to another shard")
        fingerprints.setdefault(fp, []).append(shard.id)
        missing, repeated = _check_rows(path, shard.start, shard.stop)
        if missing or repeated:
            problems.append(f"shard {shard.id}: {missing} rows missing, {repeated} rows repeated")
        stats_file = shard_dir / f"{shard.id}.stats.json"
        if stats_file.exists():
            shard_stats.append(json.loads(stats_file.read_text()))
        else:
            problems.append(f"shard {shard.id}: stats file {stats_file} missing")
    if len(fingerprints) > 1:
        groups = "; ".join(
            f"{fp or 'none'}: shards {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"
            for fp, ids in fingerprints.items()
        )
        problems.append(f"the shards were made with {len(fingerprints)} different configurations ({groups})")
    if problems:
        raise MergeError("merge refused:\n  " + "\n  ".join(problems))

    def write(tmp: str) -> None:
        writer = None
        try:
            for shard in manifest.shards:
                pf = pq.ParquetFile(shard_dir / f"{shard.id}.parquet")
                for batch in pf.iter_batches(batch_size=8192):
                    if writer is None:
                        schema = pf.schema_arrow.remove_metadata().with_metadata(
                            {CONFIG_KEY: next(iter(fingerprints)).encode()}
                        )
                        writer = pq.ParquetWriter(tmp, schema, compression="zstd")
                    writer.write_batch(batch)
            if writer is None:  # an empty input (input.allow_empty) gets a row-less output
                schema = output_schema(manifest.source().schema, "", "", "").remove_metadata()
                pq.write_table(schema.empty_table(), tmp, compression="zstd")
        finally:
            if writer is not None:
                writer.close()

    atomic_write(output, write)
    stats = merge_shard_stats(shard_stats)
    stats["config_fingerprint"] = next(iter(fingerprints), None)
    stats["shards"] = [{k: v for k, v in s.items() if k != "histograms"} for s in shard_stats]
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    return stats


def main_merge(manifest, shard_dir, output, stats_path) -> int:
    stats = merge(manifest, shard_dir, output, stats_path)
    if stats["num_shards"] == 0:
        print("the input has no rows (input.allow_empty is true): wrote an empty output")
    print(summary_text(stats))
    print(f"output: {output}\nstats:  {stats_path}")
    return 0
