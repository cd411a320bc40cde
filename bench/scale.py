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
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
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
from shardgen.base.io import atomic_write_text  # noqa: E402
from shardgen.base.jobinfo import scontrol_jobs  # noqa: E402
from shardgen.data import plan  # noqa: E402
from shardgen.data.identity import shard_fingerprint  # noqa: E402
from shardgen.data.manifest import Manifest, work_order  # noqa: E402
from shardgen.data.outputs import write_table  # noqa: E402
from shardgen.data.plan import write_manifest  # noqa: E402
from shardgen.data.stats import AttemptCounters, shard_stats  # noqa: E402
from shardgen.engines.kinds import engine_kwargs  # noqa: E402
from shardgen.features import splits  # noqa: E402
from shardgen.jobs import feed  # noqa: E402
from shardgen.requests.results import ResultSpec  # noqa: E402

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
from shardgen.data.manifest import Manifest
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


IMPORT_MERGE = "import shardgen.cli, shardgen.jobs.merge"


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
# K jobs submitted held (sbatch --hold): they never run; only the submission
# rate of the controller and its CPU time and memory are measured.
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
        slurm_extra="'--hold'",
    shell:
        "touch {output}"
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


def controller_usage(pid: int) -> dict[str, float]:
    """CPU seconds (its own and its waited-for children's: the sbatch calls) and peak RSS of a live process."""
    import psutil

    p = psutil.Process(pid)
    t = p.cpu_times()
    hwm = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM"))
    return {
        "cpu_seconds": round(t.user + t.system, 1),
        "sbatch_cpu_seconds": round(t.children_user + t.children_system, 1),
        "peak_rss_mb": round(int(hwm.split()[1]) / 1024),
    }


def submission_rate(work: Path, jobs: int, partition: str) -> dict[str, Any]:
    """Submit ``jobs`` held stand-in jobs from this environment's Snakemake; time the submissions.

    When the last is submitted (or the time is up), the controller's CPU time
    and peak memory are read, it is killed and its jobs are cancelled.
    """
    d = fresh_dir(work / "slurm" / f"jobs-{jobs}")
    (d / "Snakefile").write_text(STANDIN_SNAKEFILE)
    from importlib import metadata

    plugin = metadata.version("snakemake-executor-plugin-slurm")
    cmd = [
        str(BIN / "snakemake"),
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
        "--seconds-between-status-checks",
        "60",
    ]
    say(f"slurm: submitting {jobs:,} held jobs with plugin {plugin}")
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=d, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    stamps: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((now := time.monotonic() - t0, line.rstrip("\n")))
            if SUBMITTED.search(line):
                stamps.append(now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + 120 + jobs  # a second a job at the very least
    while len(stamps) < jobs and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    usage = controller_usage(proc.pid) if proc.poll() is None else {}
    proc.kill()
    proc.wait()
    reader.join(timeout=10)
    run_id = next((m.group(1) for _, line in lines if (m := RUN_ID.search(line))), None)
    if run_id:  # the jobs are named after the run
        subprocess.run(["scancel", f"--name={run_id}"], check=False)
    (d / "controller.log").write_text("\n".join(f"{t:9.3f} {line}" for t, line in lines) + "\n")
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0
    rate = (len(stamps) - 1) / span * 60 if span > 0 else None
    result = {
        "jobs": jobs,
        "plugin": plugin,
        "submitted": len(stamps),
        "first_submission_s": round(stamps[0], 1) if stamps else None,
        "last_submission_s": round(stamps[-1], 1) if stamps else None,
        "jobs_per_minute": round(rate) if rate else None,
        "controller": usage,
        "log": str(d / "controller.log"),
    }
    say(f"  {len(stamps):,} submitted, {result['jobs_per_minute']} jobs/min, controller {usage}")
    return result


def step_slurm(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    why = slurm_ready()
    if why:
        return {"skipped": f"Slurm is not available ({why})"}
    counts = [int(n) for n in str(args.jobs).split(",")]
    return {
        "what": "held stand-in jobs submitted by Snakemake through the Slurm executor plugin, this environment",
        "runs": [submission_rate(work, n, args.partition) for n in counts],
    }


# ---------------------------------------------------------------------------
# Makespan and GPU-time efficiency: a simulation


@dataclass(frozen=True)
class Cluster:
    shards: int = 1000  # of the plan without a tail
    gpus: int = 32  # one engine per GPU (e.g. 4 nodes of 8); the elastic workers
    shard_seconds: float = 600.0  # mean generation time of a shard
    sigma: float = 1.0  # log-normal spread of shards' work (median ÷ mean = exp(-sigma²/2))
    engine_start_s: float = 180.0  # weights, CUDA graphs, compile of an 8B model
    queue_s: float = 15.0  # from a GPU freeing to the next job starting on it
    per_job: int = 10
    seed: int = 0
    rows_per_shard: int = 10000  # shards.rows_per_shard's default
    shard_overhead_s: float = 5.0  # a worker between two shards: claim, open the input, commit
    failures_per_gpu_hour: float = 0.01  # a worker's job dies (node lost, ...)
    checkpoint_s: float = 300.0  # a failed shard resumes from its last checkpoint (checkpoint.seconds)
    end_watch_s: float = 90.0  # a worker with no shard left watches the others' claims (1.5 heartbeats)
    split_seconds: float = 60.0  # shards.split_seconds
    held_rows: int = 512  # rows a holder has read and not finished: in flight (2 x max_num_seqs 256)
    order: str = "input"  # prompt.order: prefix also reads rows ahead to sort them (feed.requests.order_window)


def simulate(c: Cluster, mode: str, work: list[float]) -> dict[str, Any]:
    """Makespan and efficiency of one job mode on ``c.gpus`` GPUs, FIFO like Slurm.

    ``per_shard``: a job (engine start + shard) per shard; ``per_job``: jobs of
    ``c.per_job`` consecutive shards, one engine each. (Elastic workers:
    ``simulate_workers``.) Efficiency: generation time ÷ billed job time
    (start to end of every job).
    """
    import heapq

    k = 1 if mode == "per_shard" else c.per_job
    jobs = [sum(work[i : i + k]) for i in range(0, len(work), k)]
    slots = [0.0] * c.gpus
    billed, ends = 0.0, []
    for j, w in enumerate(jobs):
        t = heapq.heappop(slots) + (c.queue_s if j >= c.gpus else 0.0)
        end = t + c.engine_start_s + w
        billed += end - t
        ends.append(end)
        heapq.heappush(slots, end)
    return _summary(c, mode, len(jobs), max(ends), billed, sum(work))


def _summary(c: Cluster, mode: str, starts: int, makespan: float, billed: float, work: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "engine_starts": starts,
        "makespan_h": round(makespan / 3600, 2),
        "billed_gpu_h": round(billed / 3600, 1),
        "efficiency": round(work / billed, 3),
        "gpu_busy_until_end": round(billed / (makespan * c.gpus), 3),
    }


def sim_plan(c: Cluster, density: np.ndarray, tail: bool, estimate: str) -> tuple[Manifest, list[float]]:
    """The plan of ``c.shards`` blocks of ``c.rows_per_shard`` rows, block i's rows ``density[i]``
    seconds each, made by the package's own cutting (``plan.guided_tail`` when ``tail``), as a manifest,
    and each shard's true work (seconds). ``estimate``: rows (the plan knows nothing of the work, as
    with ``balance: rows``, or ``balance: tokens`` when output lengths make the spread) or work (the
    plan's ``estimated_tokens`` is the true work)."""
    rows, total = c.rows_per_shard, c.shards * c.rows_per_shard
    true = plan.WorkCurve([(rows, d * rows * plan.BYTES_PER_TOKEN) for d in density], 0, total)
    curve = true if estimate == "work" else plan.RowCurve(total)
    cuts = [*range(0, total, rows), total]
    if tail:
        cuts = plan.guided_tail(cuts, curve, c.gpus)
    width = plan.shard_id_width(len(cuts) - 1)
    shards = [
        {"id": f"{i:0{width}d}", "start": a, "stop": b, "segments": []}
        for i, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    works = plan.shard_works(true, cuts)
    if estimate == "work":
        for s, w in zip(shards, works, strict=True):
            s["estimated_tokens"] = round(w)
    return Manifest({"version": plan.MANIFEST_VERSION, "total_rows": total, "shards": shards}), works


def simulate_workers(
    c: Cluster, order: list[str], work: dict[str, float], split: bool = False, rows: dict[str, int] | None = None
) -> dict[str, Any]:
    """Elastic workers, one per GPU, taking shards in ``order`` (what ``ClaimBoard.next`` does: the
    first shard nobody claimed), with the engine start, ``c.shard_overhead_s`` per shard, ``c.end_watch_s``
    billed to a worker that found none left, and failures:
    a worker's job dies after an exponential time of generation (``c.failures_per_gpu_hour``); its
    retry queues (``c.queue_s``), starts an engine and takes its claim back first, resuming the shard
    from its last checkpoint (``c.checkpoint_s`` of generation). Billed: every job from its start to
    its end.

    ``split``: a worker that finds no shard left asks for a split as ``splits.Thief`` does, with the
    package's own choice (``splits.victim``: the running piece with the most time left, over
    ``c.split_seconds``; a piece whose holder declined is asked again after that long) and cut
    (``splits.cut_point``: the holder keeps the ``c.held_rows`` rows it has read and not finished, and
    half of the rest go), answered within ``splits.POLL_S``; the new piece is taken like a shard. Rows
    read ahead to be sorted (``c.order`` prefix: ``read_ahead``) are read no more once the holder was
    asked (``feed.shard_loop.ShardFeed._order_window``): they drain as it generates. A shard's work is spread
    evenly over its rows."""
    import heapq

    rng = np.random.default_rng([c.seed, 1])
    rate = c.failures_per_gpu_hour / 3600

    def until_failure() -> float:
        return rng.exponential(1 / rate) if rate else float("inf")

    left = iter(order)
    pieces: list[tuple[float, str, int, int, float]] = []  # unclaimed pieces: (-rows, id, start, stop, s/row)
    events = [(c.engine_start_s, w, 0) for w in range(c.gpus)]  # (time, worker, version): its next look
    version = [0] * c.gpus
    job_start = [0.0] * c.gpus
    budget = [until_failure() for _ in range(c.gpus)]  # generation time until each worker's job dies
    # the piece each worker holds: [id, next row at t0, stop, seconds per row, t0 (generation start)]
    held: list[list[Any] | None] = [None] * c.gpus
    resumed: set[int] = set()  # workers whose retry takes their piece back
    declined: dict[str, float] = {}  # piece -> when its holder gave nothing
    asked_at: dict[str, tuple[float, float]] = {}  # piece -> its rows done and read ahead when first asked
    billed, ends, starts, failures, asked, made = 0.0, [], c.gpus, 0, 0, 0

    def run(w: int, t: float) -> None:  # worker w generates its piece from t
        piece = held[w]
        piece[4] = t
        rest = (piece[2] - piece[1]) * piece[3]
        version[w] += 1
        heapq.heappush(events, (t + min(rest, budget[w]), w, version[w]))

    def rows_done(piece: list[Any], t: float) -> float:
        return min(piece[1] + (t - piece[4]) / piece[3], piece[2])

    def held_rows(piece: list[Any], done: float) -> float:  # read and not finished
        if piece[0] not in asked_at:
            return c.held_rows + read_ahead(c, piece[2] - done, 1 / piece[3])
        was_done, ahead = asked_at[piece[0]]
        return c.held_rows + max(0.0, ahead - (done - was_done))

    while events:
        t, w, v = heapq.heappop(events)
        if v != version[w]:
            continue  # its piece was cut since: a later event stands
        piece = held[w]
        if piece is not None and w not in resumed:  # its piece ends now, or its job dies
            spent = t - piece[4]
            if (piece[2] - piece[1]) * piece[3] <= budget[w] + 1e-9:
                budget[w] -= spent
                held[w] = None
            else:
                failures += 1
                kept = spent // c.checkpoint_s * c.checkpoint_s  # generation saved in checkpoints
                piece[1] += kept / piece[3]
                billed += t - job_start[w]
                job_start[w] = t + c.queue_s
                budget[w] = until_failure()
                starts += 1
                resumed.add(w)
                version[w] += 1
                heapq.heappush(events, (job_start[w] + c.engine_start_s, w, version[w]))
                continue
        if w in resumed:
            resumed.discard(w)
            run(w, t + c.shard_overhead_s)
            continue
        shard = next(left, None)
        if shard is not None:
            n = rows[shard] if rows else c.rows_per_shard
            held[w] = [shard, 0.0, float(n), work[shard] / n, 0.0]
            run(w, t + c.shard_overhead_s)
            continue
        if pieces:
            _, pid, a, b, d = heapq.heappop(pieces)
            held[w] = [pid, float(a), float(b), d, 0.0]
            run(w, t + c.shard_overhead_s)
            continue
        if split:
            running = [
                splits.Running(p[0], int(p[2] - rows_done(p, t)), (p[2] - rows_done(p, t)) * p[3])
                for h, p in enumerate(held)
                if p is not None and h not in resumed
            ]
            askable = [r for r in running if t - declined.get(r.piece, -np.inf) >= c.split_seconds]
            chosen = splits.victim(askable, c.split_seconds)
            if chosen is not None:
                asked += 1
                h = next(h for h, p in enumerate(held) if p is not None and p[0] == chosen.piece)
                p, answer = held[h], t + splits.POLL_S
                done = rows_done(p, answer)
                floor = int(min(done + held_rows(p, done), p[2]))  # rows read: done, and those held
                asked_at.setdefault(p[0], (done, floor - done - c.held_rows))
                cut = splits.cut_point(floor, int(p[2]), int(floor - done))
                if cut is None:
                    declined[p[0]] = t
                else:
                    made += 1
                    heapq.heappush(pieces, (-(p[2] - cut), f"{p[0]}-{cut}", cut, int(p[2]), p[3]))
                    budget[h] -= answer - p[4]
                    p[1], p[2] = done, float(cut)  # the holder goes on to the cut
                    run(h, answer)
                version[w] += 1
                heapq.heappush(events, (answer, w, version[w]))  # look again once answered
                continue
        billed += t - job_start[w]
        ends.append(t)
    billed += sum(min(c.end_watch_s, max(ends) - t) for t in ends)  # until the last claim is gone
    out = _summary(c, "workers", starts, max(ends), billed, sum(work.values()))
    return out | {"failures": failures, "splits_asked": asked, "splits_made": made}


def read_ahead(c: Cluster, rows_left: float, rows_per_s: float) -> float:
    """The rows a holder of ``rows_left`` unfinished rows has read ahead to sort them, beside its requests
    in flight (``c.held_rows``): neither can a split give away (``splits.cut_point``). Prefix order sorts
    ``feed.requests.order_window`` of them at the piece's rate."""
    if c.order != "prefix":
        return 0.0
    return min(feed.requests.order_window(c.held_rows, rows_per_s), max(0.0, rows_left - c.held_rows))


ORDERS = {  # name: (tail cut by the plan, order the workers take shards in, idle workers split: prompt.order)
    "plan order": (False, lambda m: [s.id for s in m.shards], None),
    "longest first": (False, work_order, None),
    "longest first + tail": (True, work_order, None),
    "longest first + tail + split, order input": (True, work_order, "input"),
    "longest first + tail + split, order prefix": (True, work_order, "prefix"),
}


def defaults(c: Cluster) -> tuple[Cluster, tuple[bool, Any, str | None]]:
    """The run a user gets with only ``shards.workers`` set (one per GPU), as the package's config gives
    it: its tail, the order workers take shards in, its splits and their ``prompt.order``."""
    run = cfg.RunConfig.from_dict({"input": {"parquet": ["data.parquet"]}, "model": {"model": "m"},
                                   "prompt": {"template": "{{ text }}"}, "shards": {"workers": c.gpus}})  # fmt: skip
    s = run.shards
    assert s.rows_per_shard == c.rows_per_shard and s.balance == "rows", "the simulated plan is the default one"
    split = run.prompt.order if s.split_seconds > 0 else None
    return replace(c, split_seconds=s.split_seconds), (s.tail == "guided", work_order, split)


def simulate_end(c: Cluster, estimate: str) -> dict[str, Any]:
    """Elastic workers under each order of ``ORDERS`` and the ``defaults``, on the same work (one draw of
    ``c.seed``)."""
    raw = np.random.default_rng(c.seed).lognormal(0.0, c.sigma, c.shards)
    density = raw / raw.mean() * c.shard_seconds / c.rows_per_shard
    total = float(density.sum()) * c.rows_per_shard
    bound = total / c.gpus + c.engine_start_s
    runs = []
    policies = [(name, c, policy) for name, policy in ORDERS.items()]
    policies.append(("defaults", *defaults(c)))
    for name, cluster, (tail, order, split) in policies:
        manifest, works = sim_plan(cluster, density, tail, estimate)
        held = replace(cluster, order=split) if split else cluster
        r = simulate_workers(held, order(manifest), {s.id: w for s, w in zip(manifest.shards, works, strict=True)},
                             split is not None, {s.id: s.rows for s in manifest.shards})  # fmt: skip
        runs.append({"order": name, "shards": len(works)} | r | {"vs_bound": round(r["makespan_h"] * 3600 / bound, 3)})
    largest = float(raw.max() / raw.mean() * c.shard_seconds)
    return {
        "shards": c.shards,
        "gpus": c.gpus,
        "sigma": c.sigma,
        "estimate": estimate,
        "bound_h": round(bound / 3600, 2),
        # no order of whole shards ends before its largest does
        "largest_shard_vs_bound": round((largest + c.engine_start_s) / bound, 3),
        "runs": runs,
    }


END_CASES = [(1000, 32, 0.5), (1000, 32, 1.0), (1000, 32, 1.5), (10000, 256, 0.5), (10000, 256, 1.0), (10000, 256, 1.5)]


def step_simulate(work_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    c = Cluster()
    rng = np.random.default_rng(c.seed)
    raw = rng.lognormal(0.0, c.sigma, c.shards)
    work = list(raw / raw.mean() * c.shard_seconds)
    say(f"simulate: {c.shards} shards on {c.gpus} GPUs")
    runs = [simulate(c, mode, work) for mode in ("per_shard", "per_job")]
    # elastic workers on the same work, with the package's own policy: in plan order, and with the tail
    workers = simulate_end(c, "rows")["runs"]
    runs += [workers[0] | {"mode": "workers"}, workers[2] | {"mode": "workers + tail"},
             workers[3] | {"mode": "workers + tail + split"}, workers[-1] | {"mode": "workers, defaults"}]  # fmt: skip
    base = runs[0]
    for r in runs:
        r["makespan_vs_per_shard"] = round(r["makespan_h"] / base["makespan_h"], 2)
    end = []
    for estimate in ("rows", "work"):
        for shards, gpus, sigma in END_CASES:
            say(f"simulate: {shards} shards on {gpus} GPUs, sigma {sigma}, estimate {estimate}")
            end.append(simulate_end(Cluster(shards=shards, gpus=gpus, sigma=sigma), estimate))
    return {
        "what": "simulated (no engine, no Slurm): shards of log-normal work scheduled FIFO on GPUs; elastic "
        "workers with the package's own plan cutting (plan.guided_tail) and order (work_order)",
        "cluster": asdict(c),
        "work": {
            "max_over_median": round(max(work) / float(np.median(work)), 1),
            "total_gpu_h": round(sum(work) / 3600, 1),
        },
        "runs": runs,
        "tail": {"fraction": plan.TAIL_FRACTION, "floor": plan.TAIL_FLOOR},
        "end": end,
    }


# ---------------------------------------------------------------------------
# The three modes for real: the engine, the workflow and the local Slurm, small

MODES = {"per_shard": {}, "per_job": {"per_job": 3}, "workers": {"workers": 2}}


def slurm_jobs(workdir: Path) -> list[dict[str, str]]:
    """Every job Slurm still lists (finished ones for MinJobAge) that ran in ``workdir``."""
    return [j for j in scontrol_jobs() if j.get("WorkDir") == str(workdir)]


def step_modes(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Each mode once on 12 shards of uneven prompts: one job at a time (the node's 2 CPUs each)."""
    if why := slurm_ready():
        return {"skipped": f"Slurm is not available ({why})"}
    from datetime import datetime

    rng = np.random.default_rng(0)
    words = np.clip(rng.lognormal(3.5, 1.0, 48).astype(int), 2, 600)
    runs = []
    for mode, shards in MODES.items():
        d = fresh_dir(work / "modes" / mode)
        rows = [
            {"id": f"r{i:03d}", "doc": " ".join(TOPICS[(i + k) % 10] for k in range(w))} for i, w in enumerate(words)
        ]
        pq.write_table(pa.Table.from_pylist(rows), d / "in.parquet", row_group_size=4)
        config = {
            "input": {"parquet": [str(d / "in.parquet")], "id_column": "id"},
            "shards": {"rows_per_shard": 4, **shards},
            "prompt": {"template": "Name one thing this list repeats: {{ doc }}"},
            "model": {
                "model": str(ROOT / "models" / "SmolLM2-135M-Instruct"),
                "dtype": "float32",
                "max_model_len": 2048,
                "kv_cache_memory_bytes": 256 * 1024 * 1024,
                "enforce_eager": True,
            },
            "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
            "resources": {"mem_mb": 6000, "cpus_per_task": 2, "runtime": 30},
        }
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        cmd = slurm_workflow(d, args)
        say(f"modes: {mode}, {len(words) // 4} shards on the local Slurm")
        t = time.monotonic()
        with (d / "snakemake.log").open("w") as f:
            rc = subprocess.call(cmd, cwd=d, env=child_env(), stdout=f, stderr=subprocess.STDOUT, timeout=1800)
        wall = time.monotonic() - t
        stats = [json.loads(p.read_text()) for p in sorted((d / "results" / "shards").glob("*.stats.json"))]
        jobs = [
            j for j in slurm_jobs(d) if "generate" in j.get("Comment", "") and j.get("EndTime", "Unknown") != "Unknown"
        ]
        span = [(datetime.fromisoformat(j["StartTime"]), datetime.fromisoformat(j["EndTime"])) for j in jobs]
        billed = sum((b - a).total_seconds() for a, b in span)
        generation = sum(s["generation_seconds"] for s in stats)
        engine = sum(s["engine_start_seconds"] for s in stats)
        runs.append(
            {
                "mode": mode,
                "returncode": rc,
                "shards": len(stats),
                "rows": sum(s["rows"] for s in stats),
                "generate_jobs": len(jobs),
                "engine_starts": sum(1 for s in stats if s["engine_start_seconds"] > 1),  # a reused engine: ~0 s
                "engine_start_seconds": round(engine, 1),
                "generation_seconds": round(generation, 1),
                "billed_job_seconds": round(billed, 1),
                "efficiency": round(generation / billed, 3) if billed else None,
                "generate_makespan_s": round((max(b for _, b in span) - min(a for a, _ in span)).total_seconds())
                if span
                else None,
                "workflow_seconds": round(wall),
            }
        )
        say(f"  {runs[-1]}")
    return {
        "what": "real runs (vLLM CPU build, SmolLM2-135M, local Slurm, one job at a time): 48 rows, 12 shards",
        "runs": runs,
    }


def slurm_workflow(d: Path, args: argparse.Namespace, *options: str) -> list[str]:
    """The workflow on ``d/config.yaml`` in ``d``, through the Slurm profile on ``args.partition``."""
    return [
        str(BIN / "snakemake"),
        "--snakefile", str(ROOT / "Snakefile"),
        "--directory", str(d),
        "--profile", str(ROOT / "profiles" / "slurm"),
        "--default-resources", f"slurm_partition={args.partition}",
        *options,
        "--configfile", str(d / "config.yaml"),
    ]  # fmt: skip


# ---------------------------------------------------------------------------
# The end of a real run: deliberately uneven shards, plan order against the package's policy

UNEVEN = {  # the data: every shard rows_per_shard rows; the first `heavy` shards' rows ask 60x the tokens
    "shards": 8,
    "rows_per_shard": 8,
    "heavy": 1,
    "light_tokens": 4,
    "heavy_tokens": 240,
    "workers": 2,
}
UNEVEN_ORDERS = {  # name: the shards section's additions, and prompt.order (None: the default)
    # balance: rows, shards of equal rows and no estimate: work_order gives plan order (ties)
    "plan order": ({"tail": "none", "split_seconds": 0}, "input"),
    # the plan's policy: longest first (a no-op without an estimate) and the plan's guided tail
    "longest first + tail": ({"tail": "guided", "split_seconds": 0}, "input"),
    # an idle worker splits the running shard with the most time left (the default, 60 s; here 5 s); input
    # order: a split can give away every row not in flight
    "plan order + split": ({"tail": "none", "split_seconds": 5}, "input"),
    # what a user gets with only shards.workers set: the guided tail, splits after 60 s, prefix order
    "defaults": ({}, None),
}


# Imported by every Python process of the uneven runs (PYTHONPATH): a Slurm job keeps to the core of
# its fake GPU (Slurm sets CUDA_VISIBLE_DEVICES to 0 or 1 on the debug node), and vLLM's CPU build binds
# its threads to the cores it is allowed (vllm/utils/cpu_resource_utils.py, get_allowed_cpu_list). Each
# worker is then one device, as a GPU is: one left alone at the end does not get faster, and the time
# the others stand idle is lost, as it is on GPUs.
PIN_TO_GPU_CORE = """\
import os
_gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
if os.environ.get("SLURM_JOB_ID") and _gpus.isdigit():
    os.sched_setaffinity(0, {int(_gpus) % os.cpu_count()})
"""


def uneven_run(d: Path, shards_cfg: dict[str, Any], order: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the workflow on the local Slurm over ``d/in.parquet``: makespan, per-worker tail,
    and every row exactly once in the merged output."""
    from datetime import datetime

    from shardgen.base.rundir import RunDir

    u = UNEVEN
    config = {
        "input": {"parquet": [str(d / "in.parquet")], "id_column": "id", "sampling_column": "sampling"},
        "shards": {"rows_per_shard": u["rows_per_shard"], "workers": u["workers"], **shards_cfg},
        "prompt": {"system": "Answer at length.", "template": "Write about {{ topic }}."}
        | ({"order": order} if order else {}),
        "model": {
            "model": str(ROOT / "models" / "SmolLM2-135M-Instruct"),
            "dtype": "float32",
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 128 * 1024 * 1024,
            "enforce_eager": True,
            # one row at a time: a shard's time is its rows' output tokens, as on a saturated GPU
            "max_num_seqs": 1,
        },
        "sampling": {"temperature": 0.0, "max_tokens": u["light_tokens"], "ignore_eos": True},
        # one CPU each: the node's two run both workers at once, each on its own core (PIN_TO_GPU_CORE)
        "resources": {"mem_mb": 6000, "cpus_per_task": 1, "runtime": 30},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = slurm_workflow(d, args, "--retries", "0")
    (d / "pin").mkdir()
    (d / "pin" / "sitecustomize.py").write_text(PIN_TO_GPU_CORE)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d / "pin"), env.get("PYTHONPATH")]))
    t = time.monotonic()
    with (d / "snakemake.log").open("w") as f:
        rc = subprocess.call(cmd, cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    wall = time.monotonic() - t
    if rc != 0:
        raise RuntimeError(f"the uneven run in {d} failed ({rc}); see {d / 'snakemake.log'}")
    run_dir = RunDir(d / "results")
    manifest = Manifest.load(run_dir.manifest)
    pieces = {p.id: p for p in splits.Splits(run_dir.splits).all_pieces(manifest)}  # the shards, or their pieces
    commits = {p: run_dir.shard_stats(p).stat().st_mtime for p in pieces}
    jobs = [j for j in slurm_jobs(d) if "generate" in j.get("Comment", "") and j.get("EndTime", "Unknown") != "Unknown"]
    first_start = min(datetime.fromisoformat(j["StartTime"]).timestamp() for j in jobs)
    last_commit = max(commits.values())
    workers = []
    for w in range(u["workers"]):
        record = json.loads(run_dir.worker_record(w).read_text())
        done = record["committed"]
        own_last = max((commits[s] for s in done), default=first_start)
        workers.append(
            {
                "worker": w,
                "shards": len(done),
                "rows": sum(pieces[s].rows for s in done),
                "taken_over": len(record["taken_over"]),
                "last_commit_s": round(own_last - first_start, 1),
                # from this worker's last commit to the run's: idle (or released) while another finishes
                "idle_tail_s": round(last_commit - own_last, 1),
            }
        )
    ids = pq.read_table(run_dir.merged("parquet"), columns=["id"]).column("id").to_pylist()
    want = pq.read_table(d / "in.parquet", columns=["id"]).column("id").to_pylist()
    exactly_once = sorted(ids) == sorted(want) and len(set(ids)) == len(ids)
    if not exactly_once:
        raise RuntimeError(f"the uneven run in {d}: the merged output does not hold every row exactly once")
    stats = [json.loads(run_dir.shard_stats(p).read_text()) for p in pieces]
    return {
        "shards": len(manifest.shards),
        "shard_rows": [s.rows for s in manifest.shards],
        "pieces": len(pieces) - len(manifest.shards),  # made by splits
        "generate_jobs": len(jobs),
        "rows_out": len(ids),
        "exactly_once": exactly_once,
        "generated_tokens": sum(s["generated_tokens"] for s in stats),
        "generation_seconds": round(sum(s["generation_seconds"] for s in stats), 1),
        "engine_start_seconds": round(sum(s["engine_start_seconds"] for s in stats), 1),
        "makespan_s": round(last_commit - first_start, 1),
        "workers": workers,
        "idle_tail_s": max(w["idle_tail_s"] for w in workers),
        "workflow_seconds": round(wall),
    }


def uneven_bound(run: dict[str, Any], workers: int) -> float:
    """The run's bound, as the simulation's: its generation time ÷ workers plus one engine start (the
    mean of its workers'). Measured per run, so a run that generated more slowly (this machine is
    shared) is not counted as a worse tail."""
    return (run["generation_seconds"] + run["engine_start_seconds"]) / workers


def step_uneven(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The workflow on the local Slurm, elastic workers, over shards of which the last few ask ten times
    the output tokens of the others (per row, through input.sampling_column: no plan can see it), in
    plan order and with the package's policy; the same data, one run each."""
    if why := slurm_ready():
        return {"skipped": f"Slurm is not available ({why})"}
    u = UNEVEN
    n = u["shards"] * u["rows_per_shard"]
    heavy_rows = u["heavy"] * u["rows_per_shard"]
    rows = [
        {
            "id": f"r{i:03d}",
            "topic": TOPICS[i % len(TOPICS)],
            "sampling": json.dumps({"max_tokens": u["heavy_tokens"] if i < heavy_rows else u["light_tokens"]}),
        }
        for i in range(n)
    ]
    runs = []
    for name, (shards_cfg, order) in UNEVEN_ORDERS.items():
        d = fresh_dir(work / "uneven" / name.replace(" ", "-").replace("+", "and"))
        pq.write_table(pa.Table.from_pylist(rows), d / "in.parquet", row_group_size=u["rows_per_shard"])
        say(f"uneven: {name}, {n} rows on the local Slurm with {u['workers']} workers")
        r = {"order": name, "shards_config": shards_cfg, "prompt_order": order or "prefix (default)"}
        r |= uneven_run(d, shards_cfg, order, args)
        say(f"  {r['shards']} shards, makespan {r['makespan_s']} s, idle tail {r['idle_tail_s']} s")
        runs.append(r)
    base = runs[0]["makespan_s"]
    for r in runs:
        r["makespan_vs_plan_order"] = round(r["makespan_s"] / base, 3)
        r["bound_s"] = round(uneven_bound(r, u["workers"]), 1)
        r["vs_bound"] = round(r["makespan_s"] / r["bound_s"], 3)
    return {
        "what": (
            f"real runs (vLLM CPU build, SmolLM2-135M float32, max_num_seqs 1, local Slurm): {n} rows in "
            f"{u['shards']} shards of {u['rows_per_shard']} rows (shards.balance: rows), the first {u['heavy']} "
            f"shards' rows asking {u['heavy_tokens']} output tokens and the others {u['light_tokens']} "
            f"(ignore_eos; per row through input.sampling_column), {u['workers']} elastic workers, each kept to "
            "the one core of its Slurm GPU (PIN_TO_GPU_CORE: a worker is one device, as a GPU is)"
        ),
        "data": dict(u),
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
        u = r["controller"]
        rows.append(
            f"| Slurm submission | {r['jobs']:,} held jobs, plugin {r['plugin']} | {r['last_submission_s']:.0f} "
            f"| {u.get('cpu_seconds', '')} | {u.get('peak_rss_mb', '')} | {r['submitted']:,} submitted, "
            f"{r['jobs_per_minute']:,} jobs/min from first to last; sbatch calls {u.get('sbatch_cpu_seconds', '')} "
            "CPU s more (seconds: from the start of the controller to the last submission) |"
        )
    if skipped := result.get("slurm", {}).get("skipped"):
        rows.append(f"| Slurm submission | | | | | skipped: {skipped} |")
    text = "\n".join(rows) + "\n"
    if sim := result.get("simulate"):
        c = sim["cluster"]
        text += (
            f"\n**Simulated** (no engine, no Slurm; `simulate` step): {c['shards']:,} shards of log-normal work "
            f"(sigma {c['sigma']}, mean {c['shard_seconds']:.0f} s, largest {sim['work']['max_over_median']}× the "
            f"median; {sim['work']['total_gpu_h']} GPU-hours of generation) on {c['gpus']} GPUs, engine start "
            f"{c['engine_start_s']:.0f} s, {c['queue_s']:.0f} s from a freed GPU to the next job; `per_job` "
            f"{c['per_job']}, `workers` {c['gpus']}.\n\n"
            "| mode | engine starts | makespan (h) | vs one job per shard | billed GPU-hours | efficiency "
            "| GPUs busy to the end |\n|---|---|---|---|---|---|---|\n"
        )
        for r in sim["runs"]:
            text += (
                f"| {r['mode']} | {r['engine_starts']:,} | {r['makespan_h']} | ×{r['makespan_vs_per_shard']} "
                f"| {r['billed_gpu_h']} | {r['efficiency']:.1%} | {r['gpu_busy_until_end']:.1%} |\n"
            )
        text += (
            "\nEfficiency: generation time ÷ billed job time (a job is billed from its start, engine start "
            "included, to its end). GPUs busy to the end: billed time ÷ (GPUs × makespan), what a fixed "
            "reservation of the GPUs would get."
            + (
                " The `workers` rows include the time per shard and the failures below; the others do not."
                if sim.get("end")
                else ""
            )
            + "\n"
        )
        if end := sim.get("end"):
            text += (
                f"\n**The end of the run** (`simulate` step): elastic workers with the package's own policy: the "
                f"order `work_order` gives (largest estimated work first) and the plan's tail "
                f"(`shards.tail: guided`, `plan.guided_tail`: each tail shard 1/{1 / sim['tail']['fraction']:g} of the "
                f"work left per worker, down to 1/{1 / sim['tail']['floor']:g} of an average shard). Shards of "
                f"log-normal work as above, one draw per case; {c['shard_overhead_s']:.0f} s per shard, a worker "
                f"with none left watches the others' claims {c['end_watch_s']:.0f} s (billed), "
                f"{c['failures_per_gpu_hour']:g} failures per GPU-hour (the retry queues "
                f"{c['queue_s']:.0f} s, starts an engine and resumes from the last checkpoint, every "
                f"{c['checkpoint_s']:.0f} s). Bound: work ÷ GPUs + one engine start. Estimate `rows`: the "
                "plan knows nothing of the spread (all shards look alike: output lengths, or `balance: rows` "
                "on uniform prompts); `work`: the plan's `estimated_tokens` is each shard's true work. `split`: "
                f"a worker with no shard left asks for a split (`shards.split_seconds` "
                f"{c['split_seconds']:.0f}; `splits.victim`, `splits.cut_point`: the holder keeps the rows it "
                f"read, {c['held_rows']:,} in flight, and with `prompt.order: prefix` those read ahead to sort "
                f"(`feed.requests.order_window`: up to 2,048, and no more than the piece finishes in "
                f"{feed.requests.ORDER_WINDOW_SECONDS:g} s), read no more once asked; half of the rest go), "
                "answered within "
                f"{splits.POLL_S:g} s; shards of {c['rows_per_shard']:,} rows, the work even over a shard's rows; "
                "pieces: the pieces splits made and ran. `defaults`: the config a user gets with only "
                "`shards.workers` set (`bench/scale.py: defaults`, from the package's config: the guided tail, "
                "splits, `prompt.order: prefix`).\n\n"
                "| shards | GPUs | sigma | estimate | bound (h) | largest shard ÷ bound | order | shards run "
                "| pieces | makespan (h) | ÷ bound | efficiency | failures |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            )
            for case in end:
                for r in case["runs"]:
                    text += (
                        f"| {case['shards']:,} | {case['gpus']} | {case['sigma']} | {case['estimate']} "
                        f"| {case['bound_h']} | {case['largest_shard_vs_bound']} | {r['order']} | {r['shards']:,} "
                        f"| {r['splits_made']} | {r['makespan_h']} | {r['vs_bound']} | {r['efficiency']:.1%} "
                        f"| {r['failures']} |\n"
                    )
            text += (
                "\nNo order of the plan's shards can end before its largest shard does (largest shard ÷ bound): "
                "where that is above the target, only a plan that knows the shard is large (the estimate) "
                "cuts it, or a split of the running shard, which needs no estimate. A split gives away only "
                "rows the holder has not read: `prompt.order: prefix` reads rows ahead to sort them (at most what "
                "it finishes in a minute), so its splits give a little less.\n"
            )
    if (modes := result.get("modes")) and "runs" in modes:
        text += (
            f"\n**Real** (`modes` step): {modes['what']}.\n\n"
            "| mode | generate jobs | engine starts | engine start (s) | generation (s) | billed job time (s) "
            "| efficiency | first job start to last job end (s) |\n|---|---|---|---|---|---|---|---|\n"
        )
        for r in modes["runs"]:
            text += (
                f"| {r['mode']} | {r['generate_jobs']} | {r['engine_starts']} | {r['engine_start_seconds']} "
                f"| {r['generation_seconds']} | {r['billed_job_seconds']} | {r['efficiency']:.1%} "
                f"| {r['generate_makespan_s']} |\n"
            )
    if (uneven := result.get("uneven")) and "runs" in uneven:
        text += (
            f"\n**The end of a real run** (`uneven` step, {uneven['date']}): {uneven['what']}. Makespan: the first "
            "generate job's start (Slurm) to the last shard's commit (its stats file); a worker's idle tail: "
            "from its own last commit to the run's last. Every row exactly once in the merged output, "
            "checked.\n\n"
            "Bound: the run's own generation and engine start time ÷ workers (as the simulation's; measured "
            "per run, since throughput on this shared machine varies from run to run).\n\n"
            "| sample | order | shards | rows of each | pieces split off | generated tokens | generation (s) "
            "| bound (s) | makespan (s) | ÷ bound | vs plan order | worker shards (rows) | idle tail per worker (s) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        for r in uneven["runs"]:
            rows_each = " ".join(map(str, r["shard_rows"]))
            per = ", ".join(f"{w['shards']} ({w['rows']})" for w in r["workers"])
            tails = ", ".join(f"{w['idle_tail_s']}" for w in r["workers"])
            bound = uneven_bound(r, len(r["workers"]))
            text += (
                f"| {r.get('sample', 1)} | {r['order']} | {r['shards']} | {rows_each} | {r.get('pieces', 0)} "
                f"| {r['generated_tokens']:,} "
                f"| {r['generation_seconds']} | {bound:.1f} | {r['makespan_s']} | {r['makespan_s'] / bound:.3f} "
                f"| ×{r['makespan_vs_plan_order']} | {per} | {tails} |\n"
            )
        for r in uneven["runs"]:
            if r.get("note"):
                text += f"\nSample {r.get('sample', 1)}, {r['order']}: {r['note']}."
        text += "\n"
    load = result.get("load_average", {}).get("start", ["?"])[0]
    head = (
        f"Scale benchmark (`bench/scale.py --size {result['size']}`), {result['machine']}, {result['date']}; "
        f"load average {load} at the start (seconds are wall time, the best of {result['params']['repeats']} "
        "for plan and dry run; CPU seconds are the step's own).\n\n"
    )
    return head + text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--work", type=Path, help="where data and runs go (default: /tmp/shardgen-scale-<size>)")
    ap.add_argument(
        "--steps",
        default="plan,dryrun,merge,simulate",
        help="comma-separated: plan, dryrun, merge, simulate, slurm, modes, uneven",
    )
    ap.add_argument("--slurm", action="store_true", help="also measure Slurm submissions (the local cluster)")
    ap.add_argument("--jobs", default="1000,10000", help="held stand-in jobs to submit, comma-separated (--slurm)")
    ap.add_argument("--partition", default="debug", help="Slurm partition (--slurm)")
    args = ap.parse_args()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if args.slurm and "slurm" not in steps:
        steps.append("slurm")
    if unknown := set(steps) - {"plan", "dryrun", "merge", "simulate", "slurm", "modes", "uneven"}:
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
        if step in ("slurm", "simulate", "modes", "uneven"):
            run = {"slurm": step_slurm, "simulate": step_simulate, "modes": step_modes, "uneven": step_uneven}
            result[step] = run[step](work, args)
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
