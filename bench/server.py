"""A shard's throughput through vLLM's own OpenAI-compatible server (``engine.kind: server``, preset
``vllm``) against the same vLLM in the job's process (``engine.kind: vllm``).

One engine at a time: the in-process engine runs the shard (after a warm-up), is stopped, then the server
starts with the same engine arguments and runs the same shard (after a warm-up) through shardgen's
``run_shard``. Both are greedy on the demo model, so the texts are compared too. The result: rows/s and
output tokens/s of each (median of the repeats) and their ratio (docs/engines.md says where the
difference goes).

With ``--slurm PARTITION``: the same two engines as whole runs through the Slurm profile
(``snakemake --profile profiles/slurm``), one after the other on the same rows, each run's figures from
its merged stats.json: generation throughput, the engine's start, the job's wall time and GPU-hours.
It writes server-slurm.{json,md}.

Usage: python bench/server.py [--rows N] [--repeats N] [--max-tokens N] [--slurm PARTITION] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import machine, write_results  # noqa: E402

from shardgen.base.installed import vllm_version  # noqa: E402
from shardgen.base.jobenv import clear_thread_env  # noqa: E402
from shardgen.config import RunConfig  # noqa: E402
from shardgen.data.plan import write_manifest  # noqa: E402
from shardgen.engines.server import ServerEngine  # noqa: E402
from shardgen.engines.vllm import Engine  # noqa: E402
from shardgen.jobs.generate import JobContext, run_shard  # noqa: E402

TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
MODEL = {"model": str(ROOT / "models" / "SmolLM2-135M-Instruct"), "dtype": "float32", "max_model_len": 1024,
         "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 64}  # fmt: skip


def config(work: Path, rows: int, max_tokens: int, engine: dict) -> RunConfig:
    data = work.parent / "in.parquet"
    if not data.exists():
        table = [{"id": i, "topic": TOPICS[i % len(TOPICS)], "n": i} for i in range(rows)]
        pq.write_table(pa.Table.from_pylist(table), data)
    return RunConfig.from_dict({
        "input": {"parquet": [str(data)]},
        "shards": {"rows_per_shard": rows},
        "prompt": {"system": "Answer in two sentences.", "template": "Tell me about {{ topic }} (note {{ n }})."},
        "model": MODEL,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        "cache": {"enabled": False},  # the engine's speed: every row a request
        "output": {"dir": str(work)},
        "engine": engine,
    })  # fmt: skip


def run(handle, work: Path, rows: int, max_tokens: int, engine: dict) -> tuple[dict, list[str]]:
    cfg = config(work, rows, max_tokens, engine)
    write_manifest(cfg, work / "m.json")
    stats = run_shard(cfg, work / "m.json", "00000", work / "s.parquet", work / "s.json", JobContext(handle))
    return stats, pq.read_table(work / "s.parquet").column("generation").to_pylist()


def measure(side: str, handle, tmp: Path, rows: int, max_tokens: int, repeats: int, engine: dict) -> dict:
    run(handle, tmp / f"{side}-warm", rows, max_tokens, engine)
    seconds, tokens, texts = [], [], None
    for i in range(repeats):
        stats, texts = run(handle, tmp / f"{side}-{i}", rows, max_tokens, engine)
        seconds.append(stats["generation_seconds"])
        tokens.append(stats["generated_tokens"])
    s = statistics.median(seconds)
    return {"rows_per_s": round(rows / s, 2), "output_tokens_per_s": round(statistics.median(tokens) / s, 1),
            "seconds": [round(x, 2) for x in seconds], "texts": texts}  # fmt: skip


SLURM_FIGURES = ("rows", "output_tokens_per_s", "requests_per_s", "engine_start_seconds", "generation_seconds",
                 "wall_seconds", "gpu_hours")  # fmt: skip


def slurm_run(work: Path, rows: int, max_tokens: int, engine: dict, partition: str) -> tuple[dict, list[str]]:
    """One whole run through the Slurm profile: its merged stats and generations."""
    work.mkdir(parents=True)
    raw = dict(config(work / "results", rows, max_tokens, engine).raw)
    raw["resources"] = {"cpus_per_task": os.cpu_count(), "mem_mb": 8000, "runtime": 30}
    (work / "config.yaml").write_text(yaml.safe_dump(raw))
    bin_dir = Path(sys.executable).absolute().parent
    cmd = [str(bin_dir / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work),
           "--profile", str(ROOT / "profiles" / "slurm"), "--default-resources", f"slurm_partition={partition}",
           "--configfile", str(work / "config.yaml")]  # fmt: skip
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"the {engine['kind']} run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    stats = json.loads((work / "results" / "stats.json").read_text())
    texts = pq.read_table(work / "results" / "output.parquet").column("generation").to_pylist()
    return {k: stats.get(k) for k in SLURM_FIGURES}, texts


def main_slurm(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp_dir:  # on the file system the jobs see
        tmp = Path(tmp_dir)
        sides, texts = {}, {}
        for side, engine in (("in_process", {"kind": "vllm"}),
                             ("server", {"kind": "server", "server": {"preset": "vllm"}})):  # fmt: skip
            sides[side], texts[side] = slurm_run(tmp / side, args.rows, args.max_tokens, engine, args.slurm)
    ip, sv = sides["in_process"], sides["server"]
    result = {
        "what": "a whole run through the Slurm profile (one generate job) with vLLM in the job's process against "
        "vLLM's OpenAI-compatible server started by the job (engine.kind: server, preset vllm), same rows and "
        "engine arguments, greedy, one run after the other; figures from each run's merged stats.json",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "max_num_seqs": MODEL["max_num_seqs"],
        "sides": sides,
        "ratio": round(sv["output_tokens_per_s"] / ip["output_tokens_per_s"], 3),
        "same_text": texts["in_process"] == texts["server"],
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "server-slurm", result, markdown_slurm(result))


def markdown_slurm(r: dict) -> str:
    ip, sv = r["sides"]["in_process"], r["sides"]["server"]
    lines = [f"| {k} | {ip[k]:.4g} | {sv[k]:.4g} |" for k in SLURM_FIGURES[1:]]
    return (
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; a run of {r['rows']} rows of {r['max_tokens']} output "
        f"tokens through the Slurm profile, one generate job, max_num_seqs {r['max_num_seqs']}, greedy.\n\n"
        "| figure (stats.json) | in process (`engine.kind: vllm`) | server (`engine.kind: server`, preset `vllm`) |\n"
        "|---|---|---|\n" + "\n".join(lines) + "\n\n"
        f"Output tokens/s, server against in process: **{r['ratio']}**. Same text on both sides: {r['same_text']}.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slurm", metavar="PARTITION", help="whole runs through the Slurm profile on PARTITION")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    if args.slurm:
        main_slurm(args)
        return
    clear_thread_env()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        sides = {}
        for side, handle, engine in (
            ("in_process", Engine(), {"kind": "vllm"}),
            ("server", ServerEngine({"preset": "vllm"}), {"kind": "server", "server": {"preset": "vllm"}}),
        ):
            try:
                sides[side] = measure(side, handle, tmp, args.rows, args.max_tokens, args.repeats, engine)
            finally:
                handle.close()
    same = sides["in_process"].pop("texts") == sides["server"].pop("texts")
    result = {
        "what": "a shard's generation through vLLM's OpenAI-compatible server (engine.kind: server, preset vllm) "
        "against vLLM in the job's process, same rows and engine arguments, greedy, one engine at a time; "
        "median of the repeats",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "max_num_seqs": MODEL["max_num_seqs"],
        "sides": sides,
        "ratio": round(sides["server"]["rows_per_s"] / sides["in_process"]["rows_per_s"], 3),
        "same_text": same,
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "server", result, markdown(result))
    print(json.dumps(result, indent=1))


def markdown(r: dict) -> str:
    ip, sv = r["sides"]["in_process"], r["sides"]["server"]
    return (
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; {r['rows']} rows of {r['max_tokens']} output tokens, "
        f"max_num_seqs {r['max_num_seqs']}, greedy; median of {r['repeats']}.\n\n"
        "| engine | rows/s | output tokens/s |\n|---|---|---|\n"
        f"| in process (`engine.kind: vllm`) | {ip['rows_per_s']} | {ip['output_tokens_per_s']} |\n"
        f"| server (`engine.kind: server`, preset `vllm`) | {sv['rows_per_s']} | {sv['output_tokens_per_s']} |\n"
        f"| **ratio** | **{r['ratio']}** | |\n\n"
        f"Same text on both sides: {r['same_text']}.\n"
    )


if __name__ == "__main__":
    main()
