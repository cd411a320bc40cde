"""Scale: planning, the dry run and merge at up to 10,000 shards, and Slurm submissions per minute.

Every measured step runs as its own process, started from a small launcher
process that reports the step's wall time and peak RSS
(``getrusage(RUSAGE_CHILDREN)``). The launcher is needed because Linux counts
the memory of the process that spawned a child into the child's peak RSS
(the ``exec`` happens in a copy of the parent): measured straight from this
script, every step would appear as big as this script.

Steps (``--steps``, default all but ``slurm``):

- ``plan``: ``shardgen plan`` over Parquet files (full: 100 million rows in
  1,000 files, 10,000 shards of 10,000 rows) and over a tenth of them.
- ``dryrun``: ``snakemake -n`` with the local profile on a real plan of
  1,000 and of 10,000 shards (made first by ``shardgen plan`` where the
  workflow keeps it); the dry run's job table must list every generate job.
- ``merge``: ``shardgen merge`` over committed shard files of D and 10 x D
  rows (full: 2 and 20 million rows with ~100-byte generations), made with
  the package's own plan, schema, fingerprint and stats functions.
- ``slurm`` (``--slurm``; needs the local Slurm cluster): a stand-in
  workflow of K one-second jobs submitted through the Slurm executor plugin;
  jobs submitted per minute, from when each "has been submitted" line
  appears. ``--controller-python`` adds a run from another environment
  (a newer plugin), with this one's ``bin`` first on PATH as the engine.

Input data and merge shards are cached under ``--work`` between runs.

Usage: python bench/scale.py [--size smoke|full] [--out DIR] [--work DIR] [--steps plan,dryrun,merge]
       python bench/scale.py --slurm --steps slurm [--jobs K] [--controller-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardgen import config as cfg  # noqa: E402
from shardgen.engine import engine_kwargs  # noqa: E402
from shardgen.generate import shard_fingerprint  # noqa: E402
from shardgen.io import atomic_write_text  # noqa: E402
from shardgen.outputs import write_table  # noqa: E402
from shardgen.plan import Manifest, write_manifest  # noqa: E402
from shardgen.results import ResultSpec  # noqa: E402
from shardgen.stats import AttemptCounters, shard_stats  # noqa: E402

# The commands of the environment this script runs in (shardgen, snakemake).
BIN = Path(sys.executable).parent
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
DATA_VERSION = 1
MERGE_VERSION = 2


@dataclass(frozen=True)
class Size:
    files: int  # input Parquet files
    rows_per_file: int
    row_groups: int  # per file
    rows_per_shard: int
    plan_files: tuple[int, ...]  # planning runs: the first N files
    dryrun: tuple[tuple[int, int], ...]  # dry runs: (first N files, rows per shard)
    merge_files: tuple[int, int]  # merge runs: D and 10 x D rows (first N files)
    repeats: int  # of the plan and dry-run timings (the best is reported; this machine may be shared)


SIZES = {
    # 1 million rows: plans of 10 and 100 shards, dry runs of 100 and 1,000 shards,
    # merges of 100,000 and 1 million rows; well under a minute.
    "smoke": Size(10, 100_000, 4, 10_000, (1, 10), ((10, 10_000), (10, 1_000)), (1, 10), 1),
    # 100 million rows: plans of 1,000 and 10,000 shards, dry runs of 1,000 and
    # 10,000 shards, merges of 2 and 20 million rows.
    "full": Size(1000, 100_000, 4, 10_000, (100, 1000), ((100, 10_000), (1000, 10_000)), (20, 200), 3),
}

# Runs a command and writes its wall time and peak RSS (its own: this
# launcher is small) as JSON to argv[1].
LAUNCHER = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.call(sys.argv[2:])
secs = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "seconds": secs, "peak_rss_mb": ru.ru_maxrss / 1024,
               "cpu_seconds": ru.ru_utime + ru.ru_stime}, f)
"""


def ratios(small: dict, big: dict, size: str) -> dict:
    """How the larger run compares with the smaller: its size, time, CPU time and peak memory, as ratios."""
    keys = {size: size, "seconds": "seconds", "cpu_seconds": "cpu_seconds", "peak_rss": "peak_rss_mb"}
    return {f"ratio_{name}": round(big[key] / small[key], 2) for name, key in keys.items()}


def child_env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def measure(cmd: list[str], log: Path, cwd: Path | None = None, timeout: float = 3600) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``) from the launcher: rc, seconds, peak_rss_mb, cpu_seconds."""
    out = log.with_suffix(".measure.json")
    out.unlink(missing_ok=True)
    with log.open("w") as f:
        subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(out), *map(str, cmd)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=child_env(),
            timeout=timeout,
            check=True,
        )
    result = json.loads(out.read_text())
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({result['rc']}):\n{log.read_text()[-4000:]}")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k != "rc"}


def best_of(repeats: int, cmd: list[Any], log: Path, cwd: Path | None = None) -> dict[str, Any]:
    """``measure`` ``repeats`` times: the fastest run, with every run's seconds and the largest peak RSS."""
    runs = [measure(cmd, log, cwd) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "seconds_all": [r["seconds"] for r in runs], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def py(code: str, *args: Any) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Input data


def write_inputs(data: Path, size: Size) -> list[Path]:
    """``size.files`` Parquet files of ``n`` (int64, the global row number) and ``topic`` (a short string)."""
    spec = {
        "version": DATA_VERSION,
        "files": size.files,
        "rows_per_file": size.rows_per_file,
        "groups": size.row_groups,
    }
    paths = [data / f"part-{i:05d}.parquet" for i in range(size.files)]
    spec_file = data / "spec.json"
    if spec_file.exists() and json.loads(spec_file.read_text()) == spec and all(p.exists() for p in paths):
        return paths
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    say(f"writing {size.files} input files of {size.rows_per_file:,} rows to {data}")
    topics = pa.array(TOPICS)
    schema = pa.schema([pa.field("n", pa.int64()), pa.field("topic", pa.string())])
    for i, path in enumerate(paths):
        n = np.arange(i * size.rows_per_file, (i + 1) * size.rows_per_file, dtype=np.int64)
        table = pa.table([pa.array(n), pc.take(topics, pa.array(n % len(TOPICS)))], schema=schema)
        write_table_plain(table, path, size.rows_per_file // size.row_groups)
    spec_file.write_text(json.dumps(spec) + "\n")
    return paths


def write_table_plain(table: pa.Table, path: Path, row_group_size: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    os.replace(tmp, path)


def input_patterns(data: Path, paths: list[Path], n: int) -> list[str]:
    """The first ``n`` files: a glob when that is all of them (as users write it), else the paths."""
    return [str(data / "*.parquet")] if n == len(paths) else [str(p) for p in paths[:n]]


def run_config(patterns: list[str], rows_per_shard: int, out_dir: str = "results") -> dict[str, Any]:
    return {
        "input": {"parquet": patterns},
        "shards": {"rows_per_shard": rows_per_shard},
        "prompt": {"system": "Answer in one short sentence.", "template": "Write about {{ topic }}."},
        "model": {
            "model": str(ROOT / "models" / "SmolLM2-135M-Instruct"),
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 1 << 30,
            "enforce_eager": True,
        },
        "sampling": {"temperature": 0.0, "max_tokens": 32},
        "output": {"dir": out_dir},
        "resources": {"mem_mb": 4000, "cpus_per_task": 1, "runtime": 30},
    }


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------------------
# Planning

HOLD_MANIFEST = r"""
import sys
from shardgen.plan import Manifest
m = Manifest.load(sys.argv[1]) if len(sys.argv) > 1 else None
"""


def step_plan(work: Path, size: Size, paths: list[Path]) -> dict[str, Any]:
    runs = []
    base = measure(py(HOLD_MANIFEST), fresh_dir(work / "plan") / "import.log")
    for n_files in size.plan_files:
        d = fresh_dir(work / "plan" / f"files-{n_files}")
        config = run_config(input_patterns(work / "data", paths, n_files), size.rows_per_shard)
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        manifest = d / "manifest.json"
        say(f"plan: {n_files} files, {n_files * size.rows_per_file:,} rows")
        cmd = [BIN / "shardgen", "plan", "--config", d / "config.yaml", "--manifest", manifest]
        m = best_of(size.repeats, cmd, d / "plan.log")
        data = json.loads(manifest.read_text())
        held = measure(py(HOLD_MANIFEST, manifest), d / "hold.log")
        runs.append(
            {
                "files": n_files,
                "rows": data["total_rows"],
                "rows_per_shard": size.rows_per_shard,
                "shards": len(data["shards"]),
                **m,
                "manifest_bytes": manifest.stat().st_size,
                # peak RSS of loading it as a job does (Manifest.load), over the bare imports
                "manifest_load_rss_mb": round(held["peak_rss_mb"] - base["peak_rss_mb"], 1),
            }
        )
        say(f"  {runs[-1]['shards']} shards in {m['seconds']:.2f} s, peak RSS {m['peak_rss_mb']:.0f} MB")
    small, big = runs[0], runs[-1]
    return {
        "what": "`shardgen plan` (process start to exit): Parquet footers only; the manifest is JSON",
        "runs": runs,
        "import_baseline": base,
        **ratios(small, big, "rows"),
    }


# ---------------------------------------------------------------------------
# Dry run

JOB_ROW = re.compile(r"^(\w+)\s+(\d+)\s*$")


def job_stats(log: str) -> dict[str, int]:
    """The ``Job stats`` table of a Snakemake run: job name -> count (``total`` included)."""
    at = log.rfind("Job stats:")
    if at < 0:
        return {}
    jobs: dict[str, int] = {}
    for line in log[at:].splitlines()[3:]:
        m = JOB_ROW.match(line.strip())
        if not m:
            break
        jobs[m.group(1)] = int(m.group(2))
    return jobs


def snakemake_cmd(workdir: Path, configfile: Path, *args: str) -> list[Any]:
    return [
        BIN / "snakemake",
        "--snakefile",
        ROOT / "Snakefile",
        "--directory",
        workdir,
        "--configfile",
        configfile,
        "--profile",
        ROOT / "profiles" / "local",
        *args,
    ]


def step_dryrun(work: Path, size: Size, paths: list[Path]) -> dict[str, Any]:
    runs = []
    for n_files, rows_per_shard in size.dryrun:
        shards = -(-n_files * size.rows_per_file // rows_per_shard)
        d = fresh_dir(work / "dryrun" / f"shards-{shards}")
        configfile = d / "config.yaml"
        configfile.write_text(yaml.safe_dump(run_config(input_patterns(work / "data", paths, n_files), rows_per_shard)))
        # The plan where the workflow keeps it (the checkpoint's output); the
        # dry run then takes the checkpoint as done and lists every shard's job.
        say(f"dry run: planning {shards} shards")
        manifest_path = d / "results" / "plan" / "manifest.json"
        planned = measure(
            [BIN / "shardgen", "plan", "--config", configfile, "--manifest", manifest_path], d / "plan.log"
        )
        manifest = json.loads(manifest_path.read_text())
        say(f"dry run: snakemake -n with {len(manifest['shards'])} shards")
        m = best_of(size.repeats, snakemake_cmd(d, configfile, "-n"), d / "dryrun.log")
        log = (d / "dryrun.log").read_text()
        jobs = job_stats(log)
        listed = len(re.findall(r"^rule generate_shard:", log, re.MULTILINE))
        runs.append(
            {
                "shards": len(manifest["shards"]),
                "rows": manifest["total_rows"],
                **m,
                "jobs": jobs,
                "generate_jobs_listed": listed,
                "plan_seconds": planned["seconds"],
                "log_bytes": len(log),
            }
        )
        say(f"  {jobs.get('generate_shard')} generate jobs, {m['seconds']:.1f} s, peak RSS {m['peak_rss_mb']:.0f} MB")
        if jobs.get("generate_shard") != len(manifest["shards"]):
            raise RuntimeError(f"the dry run lists {jobs} for {len(manifest['shards'])} shards; see {d / 'dryrun.log'}")
    small, big = runs[0], runs[-1]
    return {
        "what": "`snakemake -n --profile profiles/local` on a planned run (process start to exit)",
        "runs": runs,
        **ratios(small, big, "shards"),
    }


# ---------------------------------------------------------------------------
# Merge

WORDS = (
    "the a of and to in is it that was for on are with as his they be at one have this from or had by hot word "
    "but what some we can out other were all there when up use your how said an each she which do their time if"
).split()


def generation_pool(n: int = 4096, seed: int = 0) -> pa.Array:
    """``n`` different texts of about 100 bytes, like short model answers."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        words, length = [], 0
        while length < 100:
            w = WORDS[rng.integers(len(WORDS))]
            words.append(w)
            length += len(w) + 1
        texts.append(" ".join(words).capitalize()[:100] + ".")
    return pa.array(texts)


def shard_schema(config: cfg.RunConfig, manifest: Manifest, shard, source) -> tuple[pa.Schema, str, str]:
    """The output schema and fingerprints of a shard, as the generate job makes them."""
    fingerprint = shard_fingerprint(config, manifest, shard)
    schema = ResultSpec.of(config).schema(source.schema, fingerprint, config.fingerprint, shard.id)
    return schema, fingerprint, config.fingerprint


def committed_shard(config, manifest: Manifest, shard, source, pool: pa.Array, out: Path, rng) -> int:
    """Write ``<shard>.parquet`` and ``<shard>.stats.json`` as a finished generate job leaves them."""
    table = pa.Table.from_batches(list(source.read(shard.segments)))
    n = table.num_rows
    row_index = np.arange(shard.start, shard.stop, dtype=np.int64)
    length = rng.random(n) < 0.1
    error = rng.random(n) < 0.002
    # unique texts, as real generations are (no dictionary encoding to help the merge)
    prefix = pc.cast(pa.array(row_index), pa.string())
    gen = pc.binary_join_element_wise(prefix, pc.take(pool, pa.array((row_index * 7919) % len(pool))), " ")
    results = {
        "row_index": pa.array(row_index),
        "generation": pc.if_else(pa.array(error), pa.nulls(n, pa.string()), gen),
        "finish_reason": pa.array(np.where(error, None, np.where(length, "length", "stop")), pa.string()),
        "prompt_tokens": pa.array(rng.integers(20, 60, n), pa.int32()),
        "generated_tokens": pa.array(rng.integers(10, 33, n), pa.int32()),
        "error": pa.array(np.where(error, "prompt_too_long: the prompt has 1100 tokens", None), pa.string()),
    }
    schema, fingerprint, config_fp = shard_schema(config, manifest, shard, source)
    columns = [
        table.column(f.name) if f.name in table.column_names else results.get(f.name, pa.nulls(n, f.type))
        for f in schema
    ]
    out_table = pa.Table.from_arrays(columns, schema=schema)
    write_table(out_table, out / f"{shard.id}.parquet")

    c = AttemptCounters(
        rows=n,
        requests=n,
        prompt_tokens=int(pc.sum(results["prompt_tokens"]).as_py()),
        cached_tokens=int(pc.sum(results["prompt_tokens"]).as_py()) // 2,
        generated_tokens=int(pc.sum(results["generated_tokens"]).as_py()),
    )
    for t in rng.lognormal(-1.0, 1.0, 300):  # latency histograms of a realistic width
        c.ttft.add(float(t))
        c.latency.add(float(t) * 4)
        c.queue.add(float(t) * 0.9)
        c.ttft_scheduled.add(float(t) * 0.1)
    stats = shard_stats(shard, out_table, 0, c, 50.0, 600.0, 660.0, config.model.gpus)
    # what a real job adds (engine, GPUs, Slurm, ...), so that each shard's stats weigh what they would
    slurm = {"job_id": str(10_000 + int(shard.id)), "node": "gpu-node-017", "partition": "gpu", "attempt": 1}
    stats.update(
        fingerprint=fingerprint,
        config_fingerprint=config_fp,
        feed={"steps": 4100, "max_in_flight": 256, "steps_short": 3, "window": 256, "order": "prefix"},
        checkpoints_discarded=[],
        engine={"vllm_version": "0.32.0", "args": engine_kwargs(config.model)},
        memory_failures=[],
        memory_overrides={},
        gpu_devices=[{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "compute_capability": "9.0"}],
        gpu_model="NVIDIA H100 80GB HBM3",
        precision={"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8", "reason": "native FP8"},
        model_source={"source": "local", "path": config.model.name, "revision": None, "commit": None},
        peak_rss_mib=6144.0,
        host="gpu-node-017",
        slurm=slurm,
        queue_wait_seconds=12.0,
        cuda_visible_devices="0",
        thread_env_removed={"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"},
    )
    atomic_write_text(out / f"{shard.id}.stats.json", json.dumps(stats, indent=1, default=str) + "\n")
    return n


def merge_inputs(d: Path, work: Path, size: Size, paths: list[Path], n_files: int) -> Path:
    """A plan over the first ``n_files`` input files and its committed shards (cached)."""
    spec = {
        "version": MERGE_VERSION,
        "data": json.loads((work / "data" / "spec.json").read_text()),
        "files": n_files,
        "rows_per_shard": size.rows_per_shard,
    }
    spec_file = d / "spec.json"
    if spec_file.exists() and json.loads(spec_file.read_text()) == spec:
        return d
    fresh_dir(d)
    config = cfg.RunConfig.from_dict(
        run_config(input_patterns(work / "data", paths, n_files), size.rows_per_shard, str(d))
    )
    (d / "config.json").write_text(json.dumps(config.raw, indent=1) + "\n")
    write_manifest(config, d / "manifest.json")
    manifest = Manifest.load(d / "manifest.json")
    source = manifest.source()
    pool = generation_pool()
    rng = np.random.default_rng(1)
    say(f"merge: writing {len(manifest.shards)} committed shards ({manifest.total_rows:,} rows) to {d}")
    for shard in manifest.shards:
        committed_shard(config, manifest, shard, source, pool, d / "shards", rng)
    spec_file.write_text(json.dumps(spec) + "\n")
    return d


IMPORT_MERGE = "import shardgen.cli, shardgen.merge"


def step_merge(work: Path, size: Size, paths: list[Path]) -> dict[str, Any]:
    runs = []
    (work / "merge").mkdir(exist_ok=True)
    base = measure(py(IMPORT_MERGE), work / "merge" / "import.log")
    for n_files in size.merge_files:
        d = merge_inputs(work / "merge" / f"files-{n_files}", work, size, paths, n_files)
        output, stats_path = d / "output.parquet", d / "stats.json"
        output.unlink(missing_ok=True)
        stats_path.unlink(missing_ok=True)
        manifest = json.loads((d / "manifest.json").read_text())
        say(f"merge: {manifest['total_rows']:,} rows in {len(manifest['shards'])} shards")
        cmd = [BIN / "shardgen", "merge", "--config", d / "config.json", "--manifest", d / "manifest.json"]
        cmd += ["--shard-dir", d / "shards"]
        m = measure([*cmd, "--output", output, "--stats", stats_path], d / "merge.log")
        md = pq.ParquetFile(output).metadata
        stats = json.loads(stats_path.read_text())
        shard_bytes = sum(p.stat().st_size for p in (d / "shards").glob("*.parquet"))
        runs.append(
            {
                "rows": manifest["total_rows"],
                "shards": len(manifest["shards"]),
                **m,
                "output_rows": md.num_rows,
                "output_row_groups": md.num_row_groups,
                "stats_rows": stats["rows"],
                "stats_shards": stats["num_shards"],
                "shard_bytes": shard_bytes,
                "output_bytes": output.stat().st_size,
            }
        )
        say(f"  {m['seconds']:.1f} s, peak RSS {m['peak_rss_mb']:.0f} MB")
        output.unlink()  # the big copy is not kept
    small, big = runs[0], runs[-1]
    return {
        "what": "`shardgen merge` (process start to exit) over committed shard files of ~100-byte generations",
        "runs": runs,
        "import_baseline": base,
        **ratios(small, big, "rows"),
    }


# ---------------------------------------------------------------------------
# Slurm submissions per minute

STANDIN_SNAKEFILE = """\
# K one-second jobs: only the submission rate of the controller is measured.
rule all:
    input:
        expand("done/{i}.txt", i=range(int(config["count"]))),


rule job:
    output:
        "done/{i}.txt",
    resources:
        runtime=5,
        mem_mb=200,
        cpus_per_task=1,
    shell:
        "sleep 1; sh probe.sh > {output}"
"""

# What a job sees: which shardgen (and so which Python and vLLM) its shell would run.
PROBE = """\
echo "shardgen=$(command -v shardgen || echo none)"
s=$(command -v shardgen) && echo "shardgen_python=$(head -n 1 "$s" | cut -c 3-)"
echo "python=$(command -v python || echo none)"
# the Snakemake process that runs the job's shell: which Python it is
pp=$(awk '/^PPid:/ {print $2}' /proc/$PPID/status 2>/dev/null) &&
    echo "job_step=$(tr '\\0' ' ' < /proc/$pp/cmdline | cut -c 1-200)"
echo "path=$PATH"
"""

SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+)")
RUN_ID = re.compile(r"SLURM run ID: (\S+)")


def slurm_ready() -> str | None:
    """None when the local cluster answers, else why not."""
    if not shutil.which("sinfo"):
        return "no sinfo on PATH"
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if r.returncode != 0 or not any(s in r.stdout for s in ("idle", "mix", "alloc")):
        return f"no usable node: {r.stdout.strip() or r.stderr.strip()}"
    return None


def plugin_versions(python: str) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({d: m.version(d) for d in ('snakemake', 'snakemake-executor-plugin-slurm')}))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def submission_rate(work: Path, label: str, controller_python: str, jobs: int, partition: str) -> dict[str, Any]:
    """Submit ``jobs`` stand-in jobs from ``controller_python``'s Snakemake; time the submissions.

    The engine's ``bin`` (this environment's) is first on PATH, as the
    controller of a two-environment setup would run; the jobs record which
    ``shardgen`` their shell finds.
    """
    d = fresh_dir(work / "slurm" / label)
    (d / "Snakefile").write_text(STANDIN_SNAKEFILE)
    (d / "probe.sh").write_text(PROBE)
    versions = plugin_versions(controller_python)
    cmd = [
        controller_python,
        "-m",
        "snakemake",
        "--snakefile",
        str(d / "Snakefile"),
        "--directory",
        str(d),
        "--executor",
        "slurm",
        "--jobs",
        str(jobs),
        "--config",
        f"count={jobs}",
        "--default-resources",
        f"slurm_partition={partition}",
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "5",
        "--seconds-between-status-checks",
        "10",
        "--latency-wait",
        "30",
    ]
    say(f"slurm [{label}]: submitting {jobs} jobs with plugin {versions['snakemake-executor-plugin-slurm']}")
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=d, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=120 + 15 * jobs)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGINT)  # Snakemake cancels its jobs (scancel)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    reader.join(timeout=10)
    log = "\n".join(f"{t:9.3f} {line}" for t, line in lines)
    (d / "controller.log").write_text(log + "\n")
    run_id = next((m.group(1) for _, line in lines if (m := RUN_ID.search(line))), None)
    if timed_out and run_id:  # nothing of ours stays in the queue
        subprocess.run(["scancel", f"--name={run_id}"], check=False)
    stamps = [t for t, line in lines if SUBMITTED.search(line)]
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) * 60 if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    probe = {}
    done = sorted((d / "done").glob("*.txt"))
    if done:
        probe = dict(line.split("=", 1) for line in done[0].read_text().splitlines() if "=" in line)
    result = {
        "controller_python": controller_python,
        "versions": versions,
        "jobs": jobs,
        "submitted": len(stamps),
        "completed": len(done),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "first_submission_s": round(stamps[0], 2) if stamps else None,
        "last_submission_s": round(stamps[-1], 2) if stamps else None,
        "total_s": round(time.monotonic() - t0, 2),
        "submission_offsets_s": [round(t, 2) for t in stamps],
        "jobs_per_minute": round(rate, 1) if rate else None,
        "hours_for_10000_jobs": round(10_000 / rate / 60, 2) if rate else None,
        "job_probe": probe,
        "log": str(d / "controller.log"),
    }
    say(f"  {len(stamps)} submitted, {result['jobs_per_minute']} jobs/min, {len(done)} completed")
    return result


def step_slurm(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    why = slurm_ready()
    if why:
        return {"skipped": f"Slurm is not available ({why})"}
    runs = [submission_rate(work, "this-env", sys.executable, args.jobs, args.partition)]
    if args.controller_python:
        runs.append(submission_rate(work, "controller", args.controller_python, args.jobs, args.partition))
    return {
        "what": "jobs submitted per minute by the Snakemake Slurm executor plugin (stand-in 1 s jobs)",
        "runs": runs,
    }


# ---------------------------------------------------------------------------
# Results


def machine() -> str:
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, Python {platform.python_version()}"


def versions() -> dict[str, str]:
    from importlib import metadata

    return {d: metadata.version(d) for d in ("snakemake", "snakemake-executor-plugin-slurm", "pyarrow")}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def markdown(result: dict[str, Any]) -> str:
    rows = ["| step | size | seconds | CPU seconds | peak RSS (MB) | notes |", "|---|---|---|---|---|---|"]
    if p := result.get("plan"):
        for r in p["runs"]:
            rows.append(
                f"| plan | {r['rows']:,} rows, {r['files']:,} files, {r['shards']:,} shards | {r['seconds']:.2f} "
                f"| {r['cpu_seconds']:.2f} | {r['peak_rss_mb']:.0f} | manifest {human_bytes(r['manifest_bytes'])}, "
                f"{max(r['manifest_load_rss_mb'], 0):.0f} MB to load |"
            )
        rows.append(
            f"| plan ratio | ×{p['ratio_rows']:g} rows | ×{p['ratio_seconds']:g} | ×{p['ratio_cpu_seconds']:g} "
            f"| ×{p['ratio_peak_rss']:g} | |"
        )
    if dr := result.get("dryrun"):
        for r in dr["runs"]:
            rows.append(
                f"| `snakemake -n` | {r['shards']:,} shards | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} "
                f"| {r['peak_rss_mb']:.0f} "
                f"| {r['jobs'].get('generate_shard', 0):,} generate jobs of {r['jobs'].get('total', 0):,} listed |"
            )
        rows.append(
            f"| dry run ratio | ×{dr['ratio_shards']:g} shards | ×{dr['ratio_seconds']:g} "
            f"| ×{dr['ratio_cpu_seconds']:g} "
            f"| ×{dr['ratio_peak_rss']:g} | linear would be ×{dr['ratio_shards']:g} at most |"
        )
    if mg := result.get("merge"):
        for r in mg["runs"]:
            rows.append(
                f"| merge | {r['rows']:,} rows, {r['shards']:,} shards | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} "
                f"| {r['peak_rss_mb']:.0f} "
                f"| {r['output_rows']:,} rows out, {human_bytes(r['output_bytes'])} |"
            )
        rows.append(
            f"| merge ratio | ×{mg['ratio_rows']:g} rows | ×{mg['ratio_seconds']:g} | ×{mg['ratio_cpu_seconds']:g} "
            f"| ×{mg['ratio_peak_rss']:g} | flat would be ×1 |"
        )
    for r in result.get("slurm", {}).get("runs", []):
        rows.append(
            f"| Slurm submission | {r['jobs']} jobs, plugin {r['versions']['snakemake-executor-plugin-slurm']} "
            f"| {r['total_s']:.0f} | | | {r['submitted']} submitted in "
            f"{r['last_submission_s'] - r['first_submission_s']:.2f} s (first to last; seconds: the whole run): "
            f"{r['jobs_per_minute']:,} jobs/min; 10,000 jobs at that rate: {r['hours_for_10000_jobs']} h |"
        )
    if skipped := result.get("slurm", {}).get("skipped"):
        rows.append(f"| Slurm submission | | | | | skipped: {skipped} |")
    load = result.get("load_average", {}).get("start", ["?"])[0]
    head = (
        f"Scale benchmark (`bench/scale.py --size {result['size']}`), {result['machine']}, {result['date']}; "
        f"load average {load} at the start (seconds are wall time, the best of {result['params']['repeats']} "
        "for plan and dry run; CPU seconds are the step's own).\n\n"
    )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--work", type=Path, help="where data and runs go (default: /tmp/shardgen-scale-<size>)")
    ap.add_argument("--steps", default="plan,dryrun,merge", help="comma-separated: plan, dryrun, merge, slurm")
    ap.add_argument("--slurm", action="store_true", help="also measure Slurm submissions (the local cluster)")
    ap.add_argument("--jobs", type=int, default=30, help="stand-in jobs to submit (--slurm)")
    ap.add_argument("--partition", default="debug", help="Slurm partition (--slurm)")
    ap.add_argument("--controller-python", help="Python of a second controller environment to measure (--slurm)")
    args = ap.parse_args()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if args.slurm and "slurm" not in steps:
        steps.append("slurm")
    if unknown := set(steps) - {"plan", "dryrun", "merge", "slurm"}:
        ap.error(f"unknown steps: {sorted(unknown)}")
    size = SIZES[args.size]
    work = (args.work or Path(f"/tmp/shardgen-scale-{args.size}")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    # Results of steps not run now are kept from an earlier run of the same size.
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "scale.json"
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    result: dict[str, Any] = old if old.get("size") == args.size else {}
    result.update(size=args.size, machine=machine(), date=time.strftime("%Y-%m-%d"), versions=versions())
    result["params"] = asdict(size)

    t = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    paths = write_inputs(work / "data", size) if {"plan", "dryrun", "merge"} & set(steps) else []
    for step in steps:
        if step == "slurm":
            result[step] = step_slurm(work, args)
        else:
            result[step] = {"plan": step_plan, "dryrun": step_dryrun, "merge": step_merge}[step](work, size, paths)
        result[step]["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["seconds_total"] = round(time.monotonic() - t, 1)
    result["load_average"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}

    json_path.write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (args.out / "scale.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
