"""shardgen from Python: ``generate`` (rows in, rows out, in this process), ``run`` (the whole workflow,
as ``snakemake --profile ...`` runs it) and ``close`` (the engine ``generate`` keeps).

``generate`` is the prompt-iteration loop of a notebook: try a template on 50 rows, look at the table,
change the template, call it again; then scale the same config to the cluster with ``run`` or the
command line. It runs a run's own phases, in this process: the plan (``plan.write_manifest``), the
model's fetch, each shard job (``generate.run_shard``: rendering, the feed, per-row errors,
checkpoints) and the merge, so it returns the rows and columns the workflow's output would hold.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import importlib
import io
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen import config as cfg
from shardgen import trust
from shardgen.base.io import atomic_write_text
from shardgen.base.rundir import RunDir
from shardgen.errors import ConfigError, InputError, ShardgenError

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

# Where ``generate`` keeps its work when no ``workdir`` is given: the data it was given as objects
# (inputs/), each input's run directory (runs/<digest>/: the plan, checkpoints, shards, output) and
# the request store the runs share (cache/), so that a call with an edited template generates only the
# rows whose requests changed.
DEFAULT_WORKDIR = "shardgen-work"
# The keys of ``input`` that name the data; ``generate``'s ``data`` replaces them.
_SOURCE_KEYS = ("parquet", "hf", "disk", "openai_batch", "step")
# The output keys that are the workflow's: ``generate`` returns a table, written nowhere else.
_WORKFLOW_OUTPUT_KEYS = ("dir", "format", "push_to_hub", "upload")

# The engine ``generate`` started, kept for the next call (a notebook calls it again and again):
# (the digest of its config's engine, its handle). One at a time: a new one needs the GPU memory.
_engine: tuple[str, Any] | None = None


def generate(
    data: Any,
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    workdir: str | os.PathLike[str] | None = None,
) -> pa.Table:
    """Run ``config`` over ``data`` in this process and return the output rows, as the workflow's
    merge writes them (its columns and provenance), one per input row (or per sample), in input order.

    Args:
        data: the rows: a list of dicts, a pandas DataFrame, a ``pyarrow.Table``, a
            ``datasets.Dataset``, or a path or glob of Parquet files.
        config: a run config (a dict, or the path of a YAML file) with the keys of the workflow's;
            ``input`` may be left out (``data`` replaces its files, its other keys stay), and
            ``output.dir``, ``output.format``, ``output.push_to_hub`` and ``output.upload`` are the
            workflow's and ignored here. Steps, Python function steps and rollouts run as there.
        workdir: where the calls keep their runs (plan, checkpoints, shards, the request store):
            ``./shardgen-work`` by default. A call interrupted (Ctrl+C) resumes from its checkpoints
            when called again with the same data and config, and a call with an edited config
            generates only the rows whose requests changed (the request store, ``cache``).

    Returns:
        The output table (``pyarrow.Table``; ``.to_pandas()`` for a DataFrame).

    Raises:
        ConfigError: the config is invalid (the message names the key, as the workflow's does).
        InputError: the data cannot be read, or lacks a column the config reads.
        TooManyErrors: more rows failed than ``errors.max_rate`` allows.
    """
    saved = dict(os.environ)  # a job's environment (jobenv: offline, no token) is the job's, not the caller's
    try:
        return _generate(data, config, Path(workdir or DEFAULT_WORKDIR).absolute())
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _generate(data: Any, config: Mapping[str, Any] | str | os.PathLike[str], work: Path) -> pa.Table:
    raw, base = _read_config(config)
    source = _input(data, work)
    raw["input"] = {k: v for k, v in (raw.get("input") or {}).items() if k not in _SOURCE_KEYS} | source
    output = {k: v for k, v in (raw.get("output") or {}).items() if k not in _WORKFLOW_OUTPUT_KEYS}
    raw["output"] = output | {"format": "parquet"}
    cache = raw.setdefault("cache", {})
    if isinstance(cache, dict) and "dir" not in cache:
        cache["dir"] = str(work / "cache")  # every call's: an edited config reuses the rows it did not change
    cfg.resolve_paths(raw, base)
    # one run directory per input, as a workflow's output.dir: a config changed since the last call reruns
    # what it changes there (its rows the request store holds are reused), an interrupted call resumes
    raw["output"]["dir"] = str(work / "runs" / cfg.digest(raw["input"]))
    cfg.validate(raw)
    for warning in cfg.warnings(raw):
        log.warning(warning)
    log.info("shardgen.generate: working directory %s", raw["output"]["dir"])
    if raw.get("steps"):
        return _generate_steps(raw)
    return _read(_one_run(raw))


def _generate_steps(raw: dict[str, Any]) -> pa.Table:
    """A run of steps: each step's run in order, then the last step's rows after its ``select``."""
    from shardgen.features import steps  # (only for a run of steps)

    for step in steps.step_configs(raw):
        log.info("shardgen.generate: step %s", step["step"]["name"])
        _one_run(step)
    run_dir = RunDir(raw["output"]["dir"])
    cfg.write_resolved(raw, run_dir.root)
    steps.finish(raw, run_dir.merged("parquet"), run_dir.stats)
    return _read(run_dir.merged("parquet"))


def _one_run(raw: dict[str, Any]) -> Path:
    """One run's phases in this process: plan, fetch, every shard not committed yet, merge. Returns the
    merged Parquet file."""
    # (the jobs' modules and pyarrow when generate runs: ``shardgen.run`` imports Snakemake only)
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import write_manifest
    from shardgen.jobs.generate import JobContext, committed, run_shard
    from shardgen.jobs.merge import merge
    from shardgen.jobs.stopflag import Interrupted
    from shardgen.models import fetch

    run_dir = RunDir(raw["output"]["dir"])
    cfg.write_resolved(raw, run_dir.root)  # (a step after it reads this one's from there)
    config = cfg.RunConfig.from_dict(raw)
    write_manifest(config, run_dir.manifest)
    record = fetch.write_record(config, run_dir.model_record)  # (the merge reads a pooling model's head there)
    manifest = Manifest.load(run_dir.manifest)
    context = JobContext(engine=_engine_for(config) if config.kind.uses_engine else None, model_record=record)
    for shard in manifest.shards:
        files = run_dir.shard_file(shard.id), run_dir.shard_stats(shard.id)
        if committed(config, manifest, shard, *files):
            continue
        try:
            run_shard(config, run_dir.manifest, shard.id, *files, context)
        except Interrupted:  # Ctrl+C: its rows are saved, and its engine kept for the call that resumes them
            raise
        except BaseException:  # an engine that failed is not kept: the next call starts a new one
            close()
            raise
    merged = run_dir.merged("parquet")
    merge(config, run_dir.manifest, merged, run_dir.stats, run_dir.model_record)
    return merged


def _engine_for(config: cfg.RunConfig) -> Any:
    """The engine handle for ``config``: the one the last call started when its engine section is the
    same (the vLLM handle starts again by itself where the model's settings differ), else a new one
    after the old one is closed."""
    global _engine
    from shardgen.engines.kinds import for_config  # (as the jobs' modules: when generate runs)

    key = cfg.digest(config.raw.get("engine") or {})
    if _engine is not None and _engine[0] != key:
        close()
    if _engine is None:
        _engine = (key, for_config(config))
    return _engine[1]


def close() -> None:
    """Stop the engine ``generate`` keeps between calls (the end of the interpreter stops it too)."""
    global _engine
    if _engine is not None:
        handle, _engine = _engine[1], None
        handle.close()


atexit.register(close)


def _read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """The config as a dict of its own, and the directory its relative paths are relative to."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), Path.cwd()
    path = Path(config)
    return trust.read_mapping(path, "the config"), path.parent


def _input(data: Any, work: Path) -> dict[str, Any]:
    """``input``'s source keys for ``data``: a path or glob as it is; rows given as objects written once
    to ``<work>/inputs/<digest>.parquet`` (the same rows, the same file: a call made again resumes)."""
    if isinstance(data, str | os.PathLike):
        return {"parquet": [str(Path(data).absolute())]}
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = _table(data)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    name = hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=16).hexdigest()
    path = work / "inputs" / f"{name}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        pq.write_table(table, partial)
        partial.replace(path)
    return {"parquet": [str(path)]}


def _table(data: Any) -> pa.Table:
    """``data`` as a ``pyarrow.Table``."""
    import pyarrow as pa

    if isinstance(data, pa.Table):
        return data
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        if not all(isinstance(row, Mapping) for row in data):
            raise InputError("generate: data given as a list must be a list of dicts (one per row)")
        try:
            return pa.Table.from_pylist([dict(row) for row in data])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputError(f"generate: the rows do not make a table (each column one type): {e}") from e
    if type(data).__name__ == "DataFrame" and hasattr(data, "to_dict"):  # pandas, without importing it
        return pa.Table.from_pandas(data, preserve_index=False)
    if hasattr(data, "with_format") and hasattr(data, "features"):  # a datasets.Dataset
        return data.with_format("arrow")[:]
    raise InputError(
        f"generate: data is a {type(data).__name__}; give a list of dicts, a pandas DataFrame, a pyarrow "
        "Table, a datasets.Dataset, or a path or glob of Parquet files"
    )


def _read(path: Path) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(path)


# -- The workflow ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """What ``run`` made: the output's path and the run's stats (``stats.json``, as the summary says it)."""

    output: Path
    stats: dict[str, Any]


def run(
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    profile: str | os.PathLike[str] = "local",
    directory: str | os.PathLike[str] | None = None,
    *,
    args: Sequence[str] = (),
) -> RunResult:
    """Run the whole workflow, as ``snakemake --profile profiles/<profile> --configfile <config>`` does
    in ``directory`` (Snakemake's own command-line entry, in this process), and return the output's path
    and the run's stats.

    Args:
        config: a run config: the path of a YAML file, or a dict (written into the directory as
            ``.shardgen/config-<digest>.yaml``); None: ``config/config.yaml`` there.
        profile: the path of a profile, or the name of one under ``directory``'s ``profiles/`` or the
            shardgen checkout's (``local``, ``slurm``).
        directory: where the run works (its relative paths, ``output.dir`` among them, are relative to
            it): the current directory by default. Its ``Snakefile``, or the shardgen checkout's.
        args: more of Snakemake's arguments (``["--dry-run"]``, ``["--cores", "4"]``).

    Raises:
        ShardgenError: the workflow failed (the message says where Snakemake's log is).
    """
    from snakemake.cli import args_to_api, parse_args

    snakemake_shell = importlib.import_module("snakemake.shell")  # (the module: snakemake.shell is also a class)

    root = Path(directory or Path.cwd()).absolute()
    project = Path(__file__).resolve().parents[2]  # the checkout this package is installed from
    snakefile = next((d / "Snakefile" for d in (root, project) if (d / "Snakefile").exists()), None)
    if snakefile is None:
        raise ConfigError(f"run: neither {root} nor {project} has shardgen's Snakefile; run it from the checkout")
    # a profile's path, or its name under the directory's profiles/, or the checkout's
    places = (Path(profile), root / "profiles" / str(profile), project / "profiles" / str(profile))
    found = next((p.absolute() for p in places if (p / "config.yaml").exists()), None)
    if found is None:
        raise ConfigError(f"run: no profile {str(profile)!r} (a directory with a config.yaml) in {places}")
    config_path = _config_file(config, root) if config is not None else root / "config" / "config.yaml"
    argv = ["--snakefile", str(snakefile), "--directory", str(root), "--profile", str(found),
            "--configfile", str(config_path), *args]  # fmt: skip
    # Snakemake's shell sends its jobs' output to the sys.stdout of its import, by its own rule
    # (snakemake/shell.py: STDOUT); in a process that runs it again, the stream of the time
    before = Path.cwd()
    snakemake_shell.STDOUT = sys.stdout if isinstance(sys.stdout, io.TextIOWrapper) else None
    os.chdir(root)  # where the command line would run it
    try:
        parser, parsed = parse_args(argv)
        ok = args_to_api(parsed, parser)
    finally:
        os.chdir(before)
    if not ok:
        raise ShardgenError(f"run: the workflow failed; Snakemake's log is under {root / '.snakemake' / 'log'}")
    out_dir = Path(cfg.load(config_path)["output"]["dir"])
    stats_path = RunDir(out_dir if out_dir.is_absolute() else root / out_dir).stats
    if not stats_path.exists():  # a dry run
        return RunResult(stats_path.parent, {})
    stats = json.loads(stats_path.read_text())
    output = Path(stats["output"]["path"])
    return RunResult(output if output.is_absolute() else root / output, stats)


def _config_file(config: Mapping[str, Any] | str | os.PathLike[str], root: Path) -> Path:
    """The config's file: its path, or a file written under ``root`` for a dict."""
    if not isinstance(config, Mapping):
        path = Path(config)
        return path if path.is_absolute() else root / path
    import yaml

    text = yaml.safe_dump(json.loads(json.dumps(dict(config))), sort_keys=False)
    path = root / ".shardgen" / f"config-{cfg.digest(dict(config))}.yaml"
    if not path.exists():
        atomic_write_text(path, text)
    return path
