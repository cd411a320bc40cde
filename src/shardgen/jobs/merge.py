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

import datetime
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardgen.base import cost, storage
from shardgen.base.io import Dir, atomic_write_text
from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig, published_sampling
from shardgen.data import formats
from shardgen.data.card import card_path, write_card
from shardgen.data.manifest import Manifest, Shard, run_shards
from shardgen.data.outputs import CONFIG_KEY, SHARD_KEY, count_problems, rows_per_input
from shardgen.data.stats import RunTotals, summary_text
from shardgen.errors import MergeError
from shardgen.models import heads
from shardgen.models.fetch import load_record
from shardgen.requests.results import DROPPED, result_spec
from shardgen.requests.rowsampling import logprobs_of
from shardgen.version import __version__

BATCH_ROWS = 8192


def _check_shards(
    shards: list[Shard], run_dir: RunDir, expected: Callable[[str | None], str]
) -> tuple[RunTotals, dict[str, Any], str | None, dict[str, tuple[int, ...]]]:
    """Check every shard file against the plan (``shards``: the plan's shards, or the pieces of those an
    idle worker split, ``splits``) and the run's config fingerprint, summing their stats.

    ``expected(version)`` is the run's fingerprint with the vLLM version a shard's stats record it was
    made with: what decides the merge comes from the run, not from the merging process, which may
    have no vLLM (the light environment of a conda run). One output comes from one vLLM version.

    Returns the run's totals, the first shard's stats (for the provenance), the shared config
    fingerprint, and each shard file's identity as it was checked (``_identity``), which the copy
    holds it to.

    Raises:
        MergeError: naming every shard that is missing, incomplete, repeated, foreign, or made with
            another configuration or another vLLM version than the others or than this run's.
    """
    problems: list[str] = []
    fingerprints: dict[str, list[str]] = {}
    versions: dict[str, list[str]] = {}
    foreign: list[str] = []
    identities: dict[str, tuple[int, ...]] = {}
    run = RunTotals()
    first: dict[str, Any] = {}
    for shard in shards:
        path = run_dir.shard_file(shard.id)
        try:
            f = open(path, "rb")  # one open for every check of this file
        except FileNotFoundError:
            problems.append(f"shard {shard.id}: output missing ({shard.rows} rows)")
            continue
        with f:
            identities[shard.id] = _identity(f)
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            index = pf.read(columns=["row_index"]).column(0).to_numpy()
        if len(set(schema.names)) < len(schema.names):  # an input column a result column overwrote
            twice = sorted({n for n in schema.names if schema.names.count(n) > 1})
            problems.append(f"shard {shard.id}: the file {path} has more than one column named {twice}")
        meta = schema.metadata or {}
        fp = meta.get(CONFIG_KEY, b"").decode()
        if meta.get(SHARD_KEY, b"").decode() != shard.id:
            problems.append(f"shard {shard.id}: the file {path} belongs to another shard")
        fingerprints.setdefault(fp, []).append(shard.id)
        missing, repeated = count_problems(index, shard.start, shard.stop, rows_per_input(schema))
        if missing or repeated:
            problems.append(f"shard {shard.id}: {missing} rows missing, {repeated} rows repeated")
        stats_file = run_dir.shard_stats(shard.id)
        if not stats_file.exists():
            problems.append(f"shard {shard.id}: stats file {stats_file} missing")
            continue
        stats = json.loads(stats_file.read_text())
        version = stats.get("engine", {}).get("vllm_version")
        versions.setdefault(version or "unknown", []).append(shard.id)
        if fp != expected(version):
            foreign.append(shard.id)
        first = first or stats
        run.add(stats)
        if stats.get("engine", {}).get("args") != first.get("engine", {}).get("args"):
            # an attempt after running out of memory uses lower memory settings
            run.shards[-1]["engine_args"] = stats.get("engine", {}).get("args")
    if len(versions) > 1:
        problems.append(f"the shards were made with {len(versions)} versions of vLLM ({_groups(versions)}); "
                        "one output comes from one engine: rerun the workflow with one vLLM, which redoes the "
                        "others")  # fmt: skip
    elif len(fingerprints) > 1:
        problems.append(f"the shards were made with {len(fingerprints)} different configurations "
                        f"({_groups(fingerprints)})")  # fmt: skip
    elif foreign:
        problems.append(
            f"the shards were made with another configuration ({next(iter(fingerprints)) or 'none'}) than this run's "
            f"({expected(next(iter(versions), None))}): shards {_ids(foreign)}; rerun the workflow with this config, "
            "which redoes them"
        )
    if problems:
        raise MergeError("merge refused:\n  " + "\n  ".join(problems))
    return run, first, next(iter(fingerprints), None), identities


def _identity(f: Any) -> tuple[int, ...]:
    """What tells one file from its replacement: shards are replaced by a rename, a new inode."""
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _ids(ids: list[str]) -> str:
    return f"{', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"


def _groups(groups: dict[str, list[str]]) -> str:
    return "; ".join(f"{key or 'none'}: shards {_ids(ids)}" for key, ids in groups.items())


def provenance(config: RunConfig, first: dict[str, Any], run: RunTotals, config_fp: str | None) -> dict[str, Any]:
    """Where the rows came from: enough to rerun them, or to tell two outputs apart. Local paths are
    named by their last component only, unless ``output.provenance_paths``."""
    model = config.model
    engine = first.get("engine", {})
    differ = [s["shard"] for s in run.shards if "engine_args" in s]
    prov = {
        "shardgen_version": __version__,
        "config_fingerprint": config_fp,
        "model": model.get("model"),
        "model_revision": first.get("model_source", {}).get("commit") or model.get("revision"),
        "model_digest": first.get("model_source", {}).get("digest"),
        "vllm_version": engine.get("vllm_version"),
        "engine_args": engine.get("args"),
        # an attempt after running out of memory uses lower memory settings
        "shards_with_other_engine_args": differ,
        "task": config.task,
        "lora_adapters": first.get("lora_adapters") or None,
        "sampling": published_sampling(dict(config.sampling)) if config.kind.generates else None,
        "pooling": dict(config.raw["pooling"]) if not config.kind.generates else None,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    own = config.kind.provenance(config.raw)  # the code the task called (a Python function's, a rollout's tools)
    prov.update(own)
    if not config.kind.uses_engine:  # no model: the function instead
        prov.update(model=None, pooling=None)
    extra = tuple(own)
    if not config.output.provenance_paths:  # the fields that hold paths; sampling values are the user's text
        prov.update({k: _no_paths(prov[k]) for k in ("model", "engine_args", "lora_adapters", *extra)})
    return prov


def _no_paths(value: Any) -> Any:
    """``value`` with every absolute path (a string that starts with ``/`` or ``~``) replaced by
    ``<local>/`` and its last component: what the provenance says of a local model directory."""
    if isinstance(value, dict):
        return {k: _no_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_paths(v) for v in value]
    if isinstance(value, str) and value.startswith(("/", "~")):
        return f"<local>/{Path(value).name}"
    return value


def _batches(
    shards: list[Shard], run_dir: RunDir, checked: dict[str, tuple[int, ...]], dropped: list[int] | None = None
) -> Iterator[tuple[pa.Schema, pa.RecordBatch]]:
    """The shards' rows, from the very files ``_check_shards`` checked: a file replaced since (another
    run committing the shard) stops the merge, which then writes nothing. Over a source that drops rows
    (``dropped`` given) it leaves out the rows it dropped (the run before did not pass them on), and counts them."""
    for shard in shards:
        path = run_dir.shard_file(shard.id)
        with open(path, "rb") as f:
            if _identity(f) != checked[shard.id]:
                raise MergeError(
                    f"merge refused: shard {shard.id}: its file {path} was replaced "
                    "while the merge ran (another run of this output directory?); nothing was written. Rerun"
                )
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow.remove_metadata()
            if dropped is None:
                yield from ((schema, batch) for batch in pf.iter_batches(batch_size=BATCH_ROWS))
                continue
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                kept = batch.filter(pc.is_null(batch.column(DROPPED)))
                dropped[0] += batch.num_rows - kept.num_rows
                yield schema.remove(schema.get_field_index(DROPPED)), kept.drop_columns([DROPPED])


def merge(
    config: RunConfig,
    manifest_path: str | Path,
    output: str | Path,
    stats_path: str | Path,
    model_record: str | Path | None = None,
) -> dict:
    """Merge the shard files of a plan (in the run directory) into ``output`` (in ``output.format``) and ``stats_path``.
    ``model_record`` (the fetch step's) gives a pooling task's columns when there are no shard files.

    Raises:
        MergeError: a shard file is missing, holds other rows than planned,
            or was made with another fingerprint than the others or than the
            run's config; the message names the shards and counts.
    """
    manifest = Manifest.load(manifest_path)
    run_dir = RunDir(config.output.dir)
    shards = run_shards(manifest, run_dir, bool(config.shards.workers))
    run, first, config_fp, checked = _check_shards(
        shards, run_dir, lambda version: config.fingerprint_with(version) if version else config.fingerprint
    )
    prov = provenance(config, first, run, config_fp)
    drops_rows = manifest.source_kind.drops_rows  # rows its input says are not this run's

    def empty() -> pa.Schema:  # the schema of an output without rows (input.allow_empty)

        head = heads.read_for(load_record(model_record)) if model_record and config.kind.needs_head else None
        schema = result_spec(config, head).schema(manifest.source().schema).remove_metadata()
        return schema.remove(schema.get_field_index(DROPPED)) if drops_rows else schema

    output = Path(output)
    with Dir.open(output.parent) as d:  # what a killed merge left: this merge is the output's one writer
        for name in (output.name, f"{output.name}{formats.PROVENANCE_SUFFIX}", Path(stats_path).name):
            d.remove_leftovers(name)
    dropped = [0] if drops_rows else None
    formats.write(
        config.output.format, output, _batches(shards, run_dir, checked, dropped), empty, prov,
        config.input.id_column, logprobs_of(config.sampling, config.input.sampling_column),
    )  # fmt: skip
    stats = run.result()
    if dropped is not None:  # rows the run before did not pass on: not this run's rows
        # counted as "rows" (input rows); each had its rows_per_input places in the shard files
        stats["rows_not_passed_on"] = dropped[0] // result_spec(config).rows_per_input
        stats["output_rows"] -= dropped[0]  # the rows of this step's output
    if "function_calls" in stats:  # and the preflight's calls of the function, from its report
        pre = json.loads(run_dir.preflight.read_text()).get("function_calls", 0) if run_dir.preflight.exists() else 0
        stats["function_calls"] |= {"preflight": pre, "total": pre + stats["function_calls"]["shards"]}
    stats["cost"] = cost.run_cost(stats, config.cost)
    for shard in stats["shards"]:
        shard["cost"] = cost.shard_cost(shard, config.cost)
    stats["config_fingerprint"] = config_fp
    stats["provenance"] = prov
    stats["output"] = {"path": str(output), "format": config.output.format}
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    write_card(config.raw, stats, summary_text(stats), output)
    return stats


def push(
    config: RunConfig, dataset_path: str | Path, stats_path: str | Path, record_path: str | Path
) -> dict[str, Any]:
    """Push the merged output to ``output.push_to_hub``; the token comes from the environment only.
    The commit names the fingerprint the merge recorded (``stats_path``): the shards', made where vLLM
    ran, not this process's, which may have no vLLM (the light environment of a conda run).

    ``huggingface_hub`` reads ``HF_TOKEN`` (or the login token) itself; no
    token is passed, logged or written here.
    """
    repo = config.output.push_to_hub
    ds = formats.load(dataset_path)
    fingerprint = json.loads(Path(stats_path).read_text()).get("config_fingerprint")
    # a new repo is created private: the rows may be sensitive; an existing one keeps its visibility
    message = f"shardgen output, config fingerprint {fingerprint}"
    info = ds.push_to_hub(repo, private=True, commit_message=message)
    record = {"repo_id": repo, "rows": ds.num_rows, "commit": getattr(info, "oid", None)}
    if (card := card_path(dataset_path)).exists():  # the merge's card, as the dataset's, over the one the push made
        record["card"] = push_card(repo, card.read_text(), message)
    atomic_write_text(record_path, json.dumps(record, indent=1) + "\n")
    return record


def push_card(repo: str, text: str, message: str) -> str | None:
    """Push the dataset card ``text`` to the dataset ``repo``, keeping the metadata the hub's card has
    from the dataset's push (its files' ``configs``, ``dataset_info``); return the commit."""
    from huggingface_hub import DatasetCard  # (a push's only)

    card = DatasetCard(text)
    pushed = DatasetCard.load(repo, repo_type="dataset").data.to_dict()
    for key in ("configs", "dataset_info"):
        if key in pushed:
            card.data[key] = pushed[key]
    info = card.push_to_hub(repo, repo_type="dataset", commit_message=f"{message}: dataset card")
    return getattr(info, "oid", info)  # (a CommitInfo, which is its URL, a str, with the commit's oid)


def upload(config: RunConfig, dataset_path: str | Path, stats_path: str | Path, record_path: str | Path) -> dict:
    """Upload the merged output (a directory's every file) and its stats to ``output.upload``
    (``storage.upload``: verified; what the last upload left there unchanged is skipped); the record
    names each object and what was skipped.

    Raises:
        StorageError: naming the object.
    """
    prefix = config.output.upload
    dataset = Path(dataset_path)
    files = [(p, str(Path(dataset.name) / p.relative_to(dataset))) for p in sorted(dataset.rglob("*")) if p.is_file()]
    if not dataset.is_dir():  # a file, and the provenance beside it where its format keeps it there
        beside = dataset.with_name(dataset.name + formats.PROVENANCE_SUFFIX)
        files = [(dataset, dataset.name)] + ([(beside, beside.name)] if beside.exists() else [])
    files.append((Path(stats_path), Path(stats_path).name))
    if not dataset.is_dir() and (card := card_path(dataset)).exists():  # (a directory's is in it)
        files.append((card, card.name))
    state = RunDir(config.output.dir).upload_state
    done = storage.upload(files, prefix, config.input.storage_options, state)
    record = {"prefix": prefix, **done}
    atomic_write_text(record_path, json.dumps(record, indent=1) + "\n")
    return record


def main_merge(config, manifest, output, stats_path, model_record=None) -> int:
    stats = merge(config, manifest, output, stats_path, model_record)
    if stats["num_shards"] == 0:
        print("the input has no rows (input.allow_empty is true): wrote an empty output")
    print(summary_text(stats))
    print(f"output: {output}\nstats:  {stats_path}")
    return 0
