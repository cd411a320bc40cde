"""The ``shardgen`` command the workflow's rules call.

Every value comes from the config file the command is given, never from the
command line, so no config value is ever part of a shell command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from shardgen import config as cfg
from shardgen.errors import ShardgenError


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

    gen = sub.add_parser("generate", help="run vLLM over one shard")
    gen.add_argument("--config", required=True)
    gen.add_argument("--manifest", required=True)
    gen.add_argument("--shard", required=True, help="shard id, as in the manifest")
    gen.add_argument("--output", required=True, help="the shard's Parquet output")
    gen.add_argument("--stats", required=True, help="the shard's stats JSON")

    merge = sub.add_parser("merge", help="merge shard outputs into one dataset and stats")
    merge.add_argument("--manifest", required=True)
    merge.add_argument("--shard-dir", required=True)
    merge.add_argument("--output", required=True)
    merge.add_argument("--stats", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "plan":
            from shardgen.plan import write_manifest

            m = write_manifest(cfg.load(args.config), args.manifest)
            print(f"planned {m['total_rows']} rows in {len(m['shards'])} shards -> {args.manifest}", file=sys.stderr)
            return 0
        if args.command == "preflight":
            from shardgen.preflight import main_preflight

            return main_preflight(cfg.load(args.config), args.manifest, args.report)
        if args.command == "generate":
            from shardgen.generate import main_generate

            return main_generate(cfg.load(args.config), args.manifest, args.shard, args.output, args.stats)
        if args.command == "merge":
            from shardgen.merge import main_merge

            return main_merge(args.manifest, Path(args.shard_dir), args.output, args.stats)
    except ShardgenError as e:
        print(f"shardgen: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
