"""The ``shardgen`` command the workflow's rules call.

Every value comes from the config file the command is given, never from the
command line, so no config value is ever part of a shell command.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import NoReturn

from shardgen import config as cfg
from shardgen.base import jobenv
from shardgen.base.io import restrict_umask
from shardgen.errors import ShardgenError

# Each command imports what it runs, when it runs (``python -X importtime``): ``shardgen status`` reads
# a run's files without pyarrow, the engine or the features.


def _ids(text: str) -> list[str]:
    return [i for i in text.split(",") if i]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="split the dataset into shards (metadata only)")
    plan.add_argument("--config", required=True, help="config file (YAML or JSON)")
    plan.add_argument("--manifest", required=True, help="where to write the shard manifest")

    pre = sub.add_parser("preflight", help="check the planned run before any generate job")
    pre.add_argument("--config", required=True)
    pre.add_argument("--manifest", required=True)
    pre.add_argument("--report", required=True, help="where to write the preflight report (JSON)")
    pre.add_argument("--model-record", help="where the fetch step found the model (its JSON record)")
    # (the workflow passes them in the environment: workflow/rules/common.smk, preflight_environment)
    pre.add_argument("--gpu-model", default=os.environ.get("SHARDGEN_JOBS_GPU_MODEL") or None,
                     help="the generate jobs' GPU type (the profile's gpu_model), for the estimate")  # fmt: skip
    pre.add_argument("--time-limit", type=float, default=os.environ.get("SHARDGEN_JOBS_TIME_LIMIT") or None,
                     help="the generate jobs' time limit in minutes, for the estimate")  # fmt: skip

    gen = sub.add_parser(
        "generate", help="run vLLM over one shard, several with one engine start, or as an elastic worker"
    )
    gen.add_argument("--config", required=True)
    gen.add_argument("--manifest", required=True)
    which = gen.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard", help="shard id, or several separated by commas (one engine start)", type=_ids)
    which.add_argument("--worker", type=int, help="elastic worker: claim shards until none is left (shards.workers)")
    gen.add_argument("--output", help="the shard's Parquet output (one shard)")
    gen.add_argument("--stats", help="the shard's stats JSON (one shard)")
    gen.add_argument("--record", help="several shards, or a worker: the job's or the worker's record (JSON)")
    gen.add_argument("--model-record", help="where the fetch step found the model (its JSON record)")

    reach = sub.add_parser("reach-storage", help="from a compute job: the input's objects can be read where jobs run")
    reach.add_argument("--config", required=True)
    reach.add_argument("--manifest", required=True)
    reach.add_argument("--record", required=True, help="where to write what was read, and from where (JSON)")

    up = sub.add_parser("upload", help="upload the merged output and its stats to output.upload (s3://)")
    up.add_argument("--config", required=True)
    up.add_argument("--dataset", required=True, help="the merged output")
    up.add_argument("--stats", required=True, help="the merged stats")
    up.add_argument("--record", required=True, help="where to write what was uploaded (JSON)")
    push = sub.add_parser("push", help="push the merged output to output.push_to_hub (token from HF_TOKEN)")
    push.add_argument("--config", required=True)
    push.add_argument("--dataset", required=True, help="the merged output")
    push.add_argument("--stats", required=True, help="the merged stats (the fingerprint the merge recorded)")
    push.add_argument("--record", required=True, help="where to write what was pushed (JSON)")

    sub.add_parser("engine-version", help="print the installed vLLM's version (without importing it)")
    sub.add_parser(
        "engine-worker",
        help="internal: a job's other node joining its engine (resources.nodes > 1; started by the first node)",
    )

    status = sub.add_parser("status", help="where a run stands: rows, rate, ETA, shards by state, errors")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--configfile", help="the run's config (its output.dir); default config/config.yaml")
    where.add_argument("--dir", help="the run's output directory")
    status.add_argument("--window", type=float, default=10.0, help="minutes over which the rate is measured")
    status.add_argument("--all", action="store_true", help="list every running shard, not only the slowest five")

    cache = sub.add_parser("cache", help="the request store: its entries, size, models and hits; prune it")
    where = cache.add_mutually_exclusive_group()
    where.add_argument("--configfile", help="the run's config (its cache.dir); default config/config.yaml")
    where.add_argument("--dir", help="the store's directory or s3:// prefix")
    cache.add_argument("--older-than", type=float, metavar="DAYS", help="remove the entries older than this")
    cache.add_argument("--model", help="remove the entries of this model (model.model as the config names it)")
    cache.add_argument("--max-size", metavar="SIZE", help="remove the oldest entries until the store fits (500M, 2G)")

    fetch = sub.add_parser("fetch-model", help="find the model on disk, or download it once, before any job")
    fetch.add_argument("--config", required=True)
    fetch.add_argument("--output", required=True, help="where to write the model record (JSON)")

    merge = sub.add_parser("merge", help="merge shard outputs into one dataset and stats")
    merge.add_argument("--config", required=True)
    merge.add_argument("--manifest", required=True)
    merge.add_argument("--output", required=True)
    merge.add_argument("--stats", required=True)
    merge.add_argument("--model-record", help="the fetch step's record (a pooling task's columns need the model)")

    select = sub.add_parser("select", help="a run of steps: the last step's rows after its select, and the stats")
    select.add_argument("--config", required=True)
    select.add_argument("--output", required=True)
    select.add_argument("--stats", required=True)

    plots = sub.add_parser("plots", help="plots and a table of totals of a finished run, for the report")
    plots.add_argument("--stats", required=True, help="the merged stats JSON")
    plots.add_argument("--output", required=True, help="the merged output (only its token counts are read)")
    plots.add_argument("--out-dir", required=True, help="where to write the plots (SVG) and totals.html")
    return p


# The commands that run model code: their environment is jobenv's (no token, no inherited thread
# counts, offline), set before anything of theirs is imported.
_MODEL_CODE_COMMANDS = ("generate", "preflight", "engine-worker")


def _load(path: str) -> cfg.RunConfig:
    """The command's config; from here on, files it creates are not readable by other users unless
    ``output.world_readable`` (``io.restrict_umask``)."""
    config = cfg.RunConfig.load(path)
    restrict_umask(config.output.world_readable)
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in _MODEL_CODE_COMMANDS:
        jobenv.enter(args.command)
    try:
        if args.command == "plan":
            from shardgen.data.plan import write_manifest

            m = write_manifest(_load(args.config), args.manifest)
            print(f"planned {m['total_rows']} rows in {len(m['shards'])} shards -> {args.manifest}", file=sys.stderr)
            return 0
        if args.command == "preflight":
            from shardgen.jobs.preflight import main_preflight

            return main_preflight(_load(args.config), args.manifest, args.report, args.model_record, args.gpu_model,
                                  args.time_limit)  # fmt: skip
        if args.command == "generate":
            from shardgen.jobs import workers

            one = args.record is None
            if args.worker is not None and one:
                raise ShardgenError("generate: a --worker needs --record")
            if args.worker is None and (
                one == (args.output is None or args.stats is None) or (one and len(args.shard) != 1)
            ):
                raise ShardgenError("generate: give --output and --stats for one shard, or --record for several")
            config = _load(args.config)
            if args.worker is not None:
                return workers.main_worker(config, args.manifest, args.worker, args.record, args.model_record)
            if one:
                (shard,) = args.shard
                return workers.main_shard(config, args.manifest, shard, args.output, args.stats, args.model_record)
            return workers.main_shards(config, args.manifest, args.shard, args.record, args.model_record)
        if args.command == "reach-storage":
            from shardgen.jobs.preflight import reach_storage

            record = reach_storage(_load(args.config), args.manifest, args.record)
            print(f"read {len(record['objects'])} object(s) from {record['host']}", file=sys.stderr)
            return 0
        if args.command == "upload":
            from shardgen.jobs.merge import upload

            record = upload(_load(args.config), args.dataset, args.stats, args.record)
            print(f"uploaded {len(record['uploaded'])} object(s) to {record['prefix']}; {len(record['skipped'])} "
                  "unchanged since the last upload", file=sys.stderr)  # fmt: skip
            return 0
        if args.command == "push":
            from shardgen.jobs.merge import push

            record = push(_load(args.config), args.dataset, args.stats, args.record)
            print(f"pushed {record['rows']} rows to {record['repo_id']}", file=sys.stderr)
            return 0
        if args.command == "status":
            from shardgen.commands.status import main_status

            out_dir = args.dir or cfg.load(args.configfile or "config/config.yaml")["output"]["dir"]
            return main_status(out_dir, args.window, args.all)
        if args.command == "cache":
            # numpy and the store's modules: loaded by the command that reads a store, not by every command
            from shardgen.commands.cache import main_cache
            from shardgen.engines.store import store_root

            if args.dir is not None:
                return main_cache(args.dir, {}, args.older_than, args.model, args.max_size)
            config = cfg.RunConfig.load(args.configfile or "config/config.yaml")
            return main_cache(store_root(config), config.input.storage_options, args.older_than, args.model,
                              args.max_size)  # fmt: skip
        if args.command == "engine-worker":
            from shardgen.engines.multinode import main_worker

            return main_worker()
        if args.command == "engine-version":
            print(cfg.engine_version())
            return 0
        if args.command == "fetch-model":
            from shardgen.models.fetch import main_fetch

            return main_fetch(_load(args.config), args.output)
        if args.command == "merge":
            from shardgen.jobs.merge import main_merge

            return main_merge(_load(args.config), args.manifest, args.output, args.stats, args.model_record)
        if args.command == "select":
            from shardgen.features import steps

            stats = steps.finish(cfg.load(args.config), args.output, args.stats)
            print(steps.summary_text(stats))
            return 0
        if args.command == "plots":
            from shardgen.commands.report import main_plots  # matplotlib: a third of every other command's start

            return main_plots(args.stats, args.output, args.out_dir)
    except ShardgenError as e:
        print(f"shardgen: error: {e}", file=sys.stderr)
        return 2
    return 1


def run() -> NoReturn:
    """The ``shardgen`` command: ``main``. A generate job ends at once when it returns, without the
    interpreter's teardown of what vLLM and torch loaded (2 s of a one-minute job, bench/overhead.py):
    its rows and stats are committed, its engine's processes are gone and its log is flushed here."""
    if sys.argv[1:2] in (["generate"], ["engine-worker"]):
        _spawn_without_this_script()
    code = main()
    if sys.argv[1:2] == ["generate"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _spawn_without_this_script() -> None:
    """vLLM spawns its engine core and workers, and multiprocessing's spawn runs the parent's main script
    again in each child before anything else (multiprocessing/spawn.py, ``_fixup_main_from_path``): the
    ``shardgen`` script imports the CLI and the config layer, tenths of a second per process, one after the other
    at each engine start, for nothing the engine's processes use. A package's ``__main__`` is not run again
    (``_fixup_main_from_name``): the script's module is given the spec of shardgen's own, which runs this
    same command (``python -m shardgen``)."""
    script = sys.modules["__main__"]
    if getattr(script, "__spec__", None) is None:
        script.__spec__ = importlib.util.find_spec("shardgen.__main__")


if __name__ == "__main__":
    run()
