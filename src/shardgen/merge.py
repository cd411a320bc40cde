"""Merge: every planned row exactly once, in input order, streamed into one dataset.

Each shard file is checked against the plan (its row range, row for row, and
the fingerprint all shards must share) while it is copied batch by batch into
the merged output, so memory stays flat however large the dataset is. The
output is Parquet, JSON Lines or a ``datasets`` directory (``output.format``),
and carries its provenance: the config fingerprint, the model, the vLLM
version and the engine settings. The merged stats are the sum of the shard
stats.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardgen import __version__
from shardgen.config import content_fingerprint, published_sampling
from shardgen.errors import MergeError
from shardgen.io import atomic_write, atomic_write_text, replace_dir
from shardgen.outputs import CONFIG_KEY, PROVENANCE_KEY, SHARD_KEY, count_problems, output_schema, rows_per_input
from shardgen.plan import Manifest
from shardgen.results import ResultSpec
from shardgen.stats import RunTotals, summary_text

BATCH_ROWS = 8192
# Row groups of the merged Parquet file: large enough that a 100M-row output
# has a footer of a few thousand entries, small enough to buffer.
ROW_GROUP_ROWS = 128 * 1024
ROW_GROUP_BYTES = 64 << 20


def output_path(config: dict[str, Any]) -> str:
    """Where the merged output goes, for ``output.format``."""
    out = config["output"]["dir"]
    return {"parquet": f"{out}/output.parquet", "jsonl": f"{out}/output.jsonl", "hf": f"{out}/output"}[
        config["output"]["format"]
    ]


def _check_shards(manifest: Manifest, shard_dir: Path, expected: str) -> tuple[RunTotals, dict[str, Any], str | None]:
    """Check every shard file against the plan and the run's config fingerprint (``expected``), summing
    their stats.

    Returns the run's totals, the first shard's stats (for the provenance) and
    the shared config fingerprint.

    Raises:
        MergeError: naming every shard that is missing, incomplete, repeated, foreign, or made with
            another configuration than this run's.
    """
    problems: list[str] = []
    fingerprints: dict[str, list[str]] = {}
    run = RunTotals()
    first: dict[str, Any] = {}
    for shard in manifest.shards:
        path = shard_dir / f"{shard.id}.parquet"
        if not path.exists():
            problems.append(f"shard {shard.id}: output missing ({shard.rows} rows)")
            continue
        schema = pq.read_schema(path)
        meta = schema.metadata or {}
        fp = meta.get(CONFIG_KEY, b"").decode()
        if meta.get(SHARD_KEY, b"").decode() != shard.id:
            problems.append(f"shard {shard.id}: the file {path} belongs to another shard")
        fingerprints.setdefault(fp, []).append(shard.id)
        index = pq.read_table(path, columns=["row_index"]).column(0).to_numpy()
        missing, repeated = count_problems(index, shard.start, shard.stop, rows_per_input(schema))
        if missing or repeated:
            problems.append(f"shard {shard.id}: {missing} rows missing, {repeated} rows repeated")
        stats_file = shard_dir / f"{shard.id}.stats.json"
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            first = first or stats
            run.add(stats)
            if stats.get("engine", {}).get("args") != first.get("engine", {}).get("args"):
                # an attempt after running out of memory uses lower memory settings
                run.shards[-1]["engine_args"] = stats.get("engine", {}).get("args")
        else:
            problems.append(f"shard {shard.id}: stats file {stats_file} missing")
    if len(fingerprints) > 1:
        groups = "; ".join(
            f"{fp or 'none'}: shards {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"
            for fp, ids in fingerprints.items()
        )
        problems.append(f"the shards were made with {len(fingerprints)} different configurations ({groups})")
    foreign = [ids for fp, ids in fingerprints.items() if fp != expected]
    if foreign and len(fingerprints) == 1:
        ids = foreign[0]
        problems.append(
            f"the shards were made with another configuration ({next(iter(fingerprints)) or 'none'}) than this run's "
            f"({expected}): shards {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}; rerun the workflow with "
            "this config, which redoes them"
        )
    if problems:
        raise MergeError("merge refused:\n  " + "\n  ".join(problems))
    return run, first, next(iter(fingerprints), None)


def provenance(config: dict[str, Any], first: dict[str, Any], run: RunTotals, config_fp: str | None) -> dict[str, Any]:
    """Where the rows came from: enough to rerun them, or to tell two outputs apart."""
    model = config["model"]
    engine = first.get("engine", {})
    differ = [s["shard"] for s in run.shards if "engine_args" in s]
    return {
        "shardgen_version": __version__,
        "config_fingerprint": config_fp,
        "model": model["model"],
        "model_revision": first.get("model_source", {}).get("commit") or model.get("revision"),
        "vllm_version": engine.get("vllm_version"),
        "engine_args": engine.get("args"),
        # an attempt after running out of memory uses lower memory settings
        "shards_with_other_engine_args": differ,
        "sampling": published_sampling(config["sampling"]),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _batches(manifest: Manifest, shard_dir: Path) -> Iterator[tuple[pa.Schema, pa.RecordBatch]]:
    for shard in manifest.shards:
        pf = pq.ParquetFile(shard_dir / f"{shard.id}.parquet")
        schema = pf.schema_arrow.remove_metadata()
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            yield schema, batch


def _write_parquet(sink: Any, batches: Iterator[tuple[pa.Schema, pa.RecordBatch]], empty: Callable, meta) -> None:
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


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def _write_jsonl(f: IO[bytes], batches: Iterator[tuple[pa.Schema, pa.RecordBatch]]) -> None:
    for _, batch in batches:
        for row in batch.to_pylist():
            f.write((json.dumps(row, ensure_ascii=False, default=_json_default) + "\n").encode())


def _write_hf(path: Path, batches, empty: Callable, meta, prov: dict[str, Any]) -> None:
    """A ``datasets`` directory (``save_to_disk``), written beside ``path`` and renamed into place."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        merged = f"{tmp}/merged.parquet"
        _write_parquet(merged, batches, empty, meta)
        info = datasets.DatasetInfo(description=json.dumps({"shardgen_provenance": prov}))
        ds = datasets.Dataset.from_parquet(merged, cache_dir=f"{tmp}/cache")
        ds.info.update(info)
        ds.save_to_disk(f"{tmp}/out")
        replace_dir(Path(f"{tmp}/out"), path)


def merge(
    config: dict[str, Any], manifest_path: str | Path, shard_dir: str | Path, output: str | Path, stats_path: str | Path
) -> dict:
    """Merge the shard files of a plan into ``output`` (in ``output.format``) and ``stats_path``.

    Raises:
        MergeError: a shard file is missing, holds other rows than planned,
            or was made with another fingerprint than the others; the message
            names the shards and counts.
    """
    manifest = Manifest.load(manifest_path)
    shard_dir = Path(shard_dir)
    run, first, config_fp = _check_shards(manifest, shard_dir, content_fingerprint(config))
    prov = provenance(config, first, run, config_fp)
    meta = {CONFIG_KEY: (config_fp or "").encode(), PROVENANCE_KEY: json.dumps(prov).encode()}

    def empty() -> pa.Schema:  # the schema of an output without rows (input.allow_empty)
        spec = ResultSpec(config["sampling"], config["output"])
        return output_schema(manifest.source().schema, "", "", "", spec.fields()).remove_metadata()

    batches = _batches(manifest, shard_dir)
    fmt = config["output"]["format"]
    if fmt == "parquet":
        atomic_write(output, lambda f: _write_parquet(f, batches, empty, meta))
    elif fmt == "jsonl":
        atomic_write(output, lambda f: _write_jsonl(f, batches))
        atomic_write_text(f"{output}.provenance.json", json.dumps(prov, indent=1) + "\n")
    else:
        _write_hf(Path(output), batches, empty, meta, prov)
    stats = run.result()
    stats["config_fingerprint"] = config_fp
    stats["provenance"] = prov
    stats["output"] = {"path": str(output), "format": fmt}
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    return stats


def load_output(config: dict[str, Any], path: str | Path):
    """The merged output as a ``datasets.Dataset``, whatever ``output.format`` it was written in."""
    import datasets

    fmt = config["output"]["format"]
    if fmt == "hf":
        return datasets.load_from_disk(str(path))
    builder = "parquet" if fmt == "parquet" else "json"
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def push(config: dict[str, Any], dataset_path: str | Path, record_path: str | Path) -> dict[str, Any]:
    """Push the merged output to ``output.push_to_hub``; the token comes from the environment only.

    ``huggingface_hub`` reads ``HF_TOKEN`` (or the login token) itself; no
    token is passed, logged or written here.
    """
    repo = config["output"]["push_to_hub"]
    ds = load_output(config, dataset_path)
    # a new repo is created private: the rows may be sensitive; an existing one keeps its visibility
    message = f"shardgen output, config fingerprint {content_fingerprint(config)}"
    info = ds.push_to_hub(repo, private=True, commit_message=message)
    record = {"repo_id": repo, "rows": ds.num_rows, "commit": getattr(info, "oid", None)}
    atomic_write_text(record_path, json.dumps(record, indent=1) + "\n")
    return record


def main_merge(config, manifest, shard_dir, output, stats_path) -> int:
    stats = merge(config, manifest, shard_dir, output, stats_path)
    if stats["num_shards"] == 0:
        print("the input has no rows (input.allow_empty is true): wrote an empty output")
    print(summary_text(stats))
    print(f"output: {output}\nstats:  {stats_path}")
    return 0
