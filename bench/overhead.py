"""The whole workflow against a plain vLLM script over the same rows: where a short job's time goes
outside generation.

Both run the demo model on the same rows, with the same engine arguments and sampling:

- ``plain``: a Python script as a user would write it: import vLLM, ``LLM(...)``, ``LLM.chat`` over
  every row, the generations written to a Parquet file. Timed from before its process starts to its end.
- ``workflow``: ``snakemake --profile profiles/local`` on the same rows in one shard (plan, preflight,
  one generate job, merge, the summary), timed the same way.

The ratio is plain seconds ÷ workflow seconds (1: the workflow costs nothing beyond the script). The
workflow's time is split by its own records: each rule's start and end (Snakemake's log, to the
second), and in the generate job its Python start (the job's time before shardgen's own clock), the
engine start and the generation (``shards/<id>.stats.json``). The runs alternate, plain first.

Usage: python bench/overhead.py [--rows N] [--max-tokens N] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "src"))

from common import machine, write_results  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
ENGINE = {  # the demo's (config/config.yaml)
    "model": str(MODEL),
    "dtype": "float32",
    "max_model_len": 2048,
    "kv_cache_memory_bytes": 1 << 30,
    "enforce_eager": True,
}
SYSTEM = "You are a concise, accurate assistant."
TEMPLATE = "Tell me about {topic}."

PLAIN = """\
import json, sys, time
t0 = time.perf_counter()
import pyarrow as pa, pyarrow.parquet as pq
from vllm import LLM, SamplingParams
t1 = time.perf_counter()
args = json.loads(sys.argv[1])
llm = LLM(**args["engine"])
t2 = time.perf_counter()
rows = pq.read_table(args["input"]).to_pylist()
conversations = [[{"role": "system", "content": args["system"]},
                  {"role": "user", "content": args["template"].format(**r)}] for r in rows]
outputs = llm.chat(conversations, SamplingParams(**args["sampling"]), use_tqdm=False)
t3 = time.perf_counter()
pq.write_table(pa.table({"id": [r["id"] for r in rows], "generation": [o.outputs[0].text for o in outputs]}),
               args["output"])
t4 = time.perf_counter()
timing = {"import_s": t1 - t0, "engine_start_s": t2 - t1, "generation_s": t3 - t2, "write_s": t4 - t3}
open(args["timing"], "w").write(json.dumps(timing))
"""

# Snakemake's log: "[Sun Dec  6 01:08:37 2026]" before each job's start ("rule x:" / "localrule x:") and end
STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
START = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
END = re.compile(r"^Finished jobid: \d+ \(Rule: (\w+)\)$")
STOPPING = re.compile(r"^(\S+ \S+) INFO shardgen\.engine: stopping the engine", re.M)


def env() -> dict[str, str]:
    # the Makefile's: the engine uses every core of vLLM's CPU build
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")


def plain(d: Path, data: Path, sampling: dict) -> dict:
    args = {"engine": ENGINE, "input": str(data), "system": SYSTEM, "template": TEMPLATE,
            "sampling": sampling, "output": str(d / "plain.parquet"), "timing": str(d / "timing.json")}  # fmt: skip
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PLAIN, json.dumps(args)], capture_output=True, text=True, env=env())
    seconds = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"the plain script failed:\n{out.stderr[-3000:]}")
    parts = json.loads((d / "timing.json").read_text())
    parts["python_start_s"] = seconds - sum(parts.values())
    return {"seconds": seconds, "parts": parts}


def rule_spans(log: str) -> dict[str, float]:
    """Each rule's seconds from its start to its end in Snakemake's log."""
    stamp, starts, spans = None, {}, {}
    for line in log.splitlines():
        if m := STAMP.match(line.strip()):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif (m := START.match(line.strip())) and stamp is not None:
            starts[m.group(1)] = stamp
        elif (m := END.match(line.strip())) and stamp is not None and m.group(1) in starts:
            spans[m.group(1)] = (stamp - starts[m.group(1)]).total_seconds()
    return spans


def workflow(d: Path, data: Path, sampling: dict) -> dict:
    config = {
        "input": {"parquet": [str(data)], "id_column": "id"},
        "shards": {"rows_per_shard": 1_000_000},
        "prompt": {"system": SYSTEM, "template": TEMPLATE.replace("{topic}", "{{ topic }}")},
        "model": ENGINE,
        "sampling": sampling,
        "cache": {"enabled": False},  # the engine's speed: every row a request
        "resources": {"mem_mb": 8000, "cpus_per_task": 2, "runtime": 30},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(d),
           "--profile", str(ROOT / "profiles" / "local"), "--configfile", str(d / "config.yaml")]  # fmt: skip
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=d)
    seconds = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"the workflow failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    (stats_file,) = (d / "results" / "shards").glob("*.stats.json")
    (job_log,) = (d / "results" / "logs" / "generate_shard").glob("*.log")
    stats = json.loads(stats_file.read_text())
    spans = rule_spans(out.stdout + "\n" + out.stderr)
    job = spans.get("generate_shard", 0.0)
    engine, generation = stats["engine_start_seconds"], stats["generation_seconds"]
    # from the job's log line before it stops its engine (shardgen.engines.vllm.Engine.close) to its last line
    stopping = STOPPING.search(job_log.read_text())
    after_commit = (
        job_log.stat().st_mtime - datetime.strptime(stopping.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stopping
        else 0.0
    )
    parts = {f"rule {name}": s for name, s in spans.items() if name != "generate_shard"}
    parts |= {
        "generate: Python start (shardgen's imports)": max(0.0, job - stats["wall_seconds"] - after_commit),
        "generate: vLLM's import, the job's settings, the commit": stats["wall_seconds"] - engine - generation,
        "generate: engine start": engine,
        "generate: generation": generation,
        "generate: engine stop and exit, after the commit": after_commit,
    }
    parts["Snakemake itself (start, DAG, between jobs, end)"] = seconds - sum(spans.values())
    return {"seconds": seconds, "parts": parts, "rows": stats["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128, help="about a minute of generation on 2 cores")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    runs: dict[str, list[dict]] = {"plain": [], "workflow": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.parquet"
        rows = [{"id": f"r{i:05d}", "topic": TOPICS[i % len(TOPICS)] + f" ({i})"} for i in range(args.rows)]
        pq.write_table(pa.Table.from_pylist(rows), data)
        for r in range(args.repeats):
            for name, run in (("plain", plain), ("workflow", workflow)):
                d = Path(tmp) / f"{name}-{r}"
                d.mkdir()
                runs[name].append(run(d, data, sampling))
                print(f"{name} {r + 1}: {runs[name][-1]['seconds']:.1f} s", flush=True)
    median = {name: statistics.median(x["seconds"] for x in rs) for name, rs in runs.items()}
    result = {
        "what": "the workflow (profiles/local, one shard) against a plain LLM.chat script over the same rows",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "seconds": {k: round(v, 1) for k, v in median.items()},
        "ratio": round(median["plain"] / median["workflow"], 3),
        "runs": runs,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "overhead", result, markdown(result))


def markdown(r: dict) -> str:
    last = {name: rs[-1]["parts"] for name, rs in r["runs"].items()}
    md = (
        f"{r['machine']}, {r['date']}: {r['rows']} rows, {r['max_tokens']} output tokens each, the demo model; "
        f"median of {r['repeats']} (`python bench/overhead.py`).\n\n"
        f"| | seconds |\n|---|---|\n| plain script (`LLM.chat`) | {r['seconds']['plain']} |\n"
        f"| workflow (`snakemake --profile profiles/local`) | {r['seconds']['workflow']} |\n"
        f"| **plain ÷ workflow** | **{r['ratio']}** |\n\nWhere the time went (the last run of each):\n\n"
        "| run | part | seconds |\n|---|---|---|\n"
    )
    for name, parts in last.items():
        for part, s in parts.items():
            md += f"| {name} | {part} | {s:.1f} |\n"
    return md


if __name__ == "__main__":
    main()
