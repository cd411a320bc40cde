"""Pooling rows/s through shardgen against vLLM's own ``LLM.classify`` and ``LLM.embed``.

For each task one engine runs the same rows through shardgen's ``run_shard``
(reading the Parquet shard, rendering, tokenizing, feeding, checkpointing,
writing the shard and its stats) and through vLLM's offline pooling call on
the same rendered texts, alternating, after one warm-up of each:

- ``classify``: the test classifier (the demo model's weights under a
  three-class head, made by ``make setup``);
- ``embed``: the demo model as an embedding model (last-token pooling).

The result is the ratio of rows/s (median of the repeats), and the largest
difference between the two paths' values for the same row (they run the
same engine on the same tokens, so it should be 0 up to batching noise).

Usage: python bench/pooling.py [--size smoke|full] [--rows N] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import machine, write_results  # noqa: E402

from shardgen.base.installed import vllm_version  # noqa: E402
from shardgen.base.jobenv import clear_thread_env  # noqa: E402
from shardgen.config import RunConfig  # noqa: E402
from shardgen.data.plan import write_manifest  # noqa: E402
from shardgen.engines.kinds import EngineSettings  # noqa: E402
from shardgen.engines.vllm import Engine  # noqa: E402
from shardgen.jobs.generate import JobContext, run_shard  # noqa: E402
from shardgen.requests.prompts import PromptRenderer  # noqa: E402

TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
TASKS = {
    # task: (model directory, vLLM's call, the output column, the value of a vLLM output)
    "classify": (ROOT / "models" / "classifier", "classify", "probs", lambda o: o.outputs.probs),
    "embed": (ROOT / "models" / "SmolLM2-135M-Instruct", "embed", "embedding", lambda o: o.outputs.embedding),
}
SIZES = {"smoke": (64, 1), "full": (400, 3)}  # rows, repeats (400 rows: about 8 s a run here)


def rows(n: int) -> list[dict]:
    return [{"id": i, "text": f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]}."} for i in range(n)]


def model_config(model: Path) -> dict:
    return {"model": str(model), "dtype": "float32", "max_model_len": 512, "enforce_eager": True,
            "kv_cache_memory_bytes": 256 << 20, "runner": "pooling"}  # fmt: skip


def measure(task: str, work: Path, n: int, repeats: int) -> dict:
    model_dir, call, column, value = TASKS[task]
    data = work / f"{task}.parquet"
    pq.write_table(pa.Table.from_pylist(rows(n)), data)
    config = RunConfig.from_dict({
        "task": task,
        "input": {"parquet": [str(data)]},
        "shards": {"rows_per_shard": n},
        "prompt": {"template": "{{ text }}", "chat": False},
        "cache": {"enabled": False},  # the engine's speed: every row a request
        "model": model_config(model_dir),
        "output": {"dir": str(work / f"{task}-out")},
        "checkpoint": {"rows": 1000, "seconds": 300},  # the default interval: a real job saves every 1000 rows
    })  # fmt: skip
    manifest = work / f"{task}-manifest.json"
    write_manifest(config, manifest)
    renderer = PromptRenderer.from_config(config.prompt)
    texts = [renderer.render(r) for r in rows(n)]
    engine = Engine()
    engine.start(EngineSettings(model=dict(config.model)))
    values: dict[str, list] = {}
    try:

        def vllm() -> float:
            t = time.perf_counter()
            outs = getattr(engine.llm, call)(texts, use_tqdm=False)
            rate = n / (time.perf_counter() - t)
            values["vllm"] = [list(map(float, value(o))) for o in outs]
            return rate

        def shardgen(tag: str) -> float:
            t = time.perf_counter()
            run_shard(config, manifest, "00000", work / f"{tag}.parquet", work / f"{tag}.json", JobContext(engine))
            rate = n / (time.perf_counter() - t)
            col = pq.read_table(work / f"{tag}.parquet", columns=[column]).column(column).to_pylist()
            values["shardgen"] = [list(v.values()) if isinstance(v, dict) else v for v in col]
            return rate

        vllm()
        shardgen(f"{task}-warm")
        runs: dict[str, list[float]] = {"vllm": [], "shardgen": []}
        for i in range(repeats):
            runs["vllm"].append(vllm())
            runs["shardgen"].append(shardgen(f"{task}-{i}"))
    finally:
        engine.close()
    theirs, ours = statistics.median(runs["vllm"]), statistics.median(runs["shardgen"])
    pairs = zip(values["vllm"], values["shardgen"], strict=True)
    diff = max(abs(a - b) for va, vb in pairs for a, b in zip(va, vb, strict=True))
    return {
        "vllm_call": f"LLM.{call}",
        "vllm_rows_per_s": round(theirs, 1),
        "shardgen_rows_per_s": round(ours, 1),
        "ratio": round(ours / theirs, 3),
        "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "max_abs_diff": diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rows", type=int, help="rows per run instead of the size's")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    n, repeats = SIZES[args.size]
    n = args.rows or n
    for model_dir, *_ in TASKS.values():
        if not (model_dir / "config.json").exists():
            sys.exit(f"the test model is missing at {model_dir}: run `make setup`")
    clear_thread_env()
    with tempfile.TemporaryDirectory() as tmp:
        tasks = {task: measure(task, Path(tmp), n, repeats) for task in TASKS}
    result = {
        "what": "pooling rows/s: shardgen's run_shard against vLLM's LLM.classify / LLM.embed, same rows, same "
        "engine, alternating; median of the repeats",
        "size": args.size,
        "rows": n,
        "repeats": repeats,
        "tasks": tasks,
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "pooling", result, markdown(result))


def markdown(r: dict) -> str:
    lines = [
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; {r['rows']} rows per run, median of {r['repeats']}.\n",
        "| task | vLLM call | vLLM rows/s | shardgen rows/s | ratio | largest difference of a value |",
        "|---|---|---|---|---|---|",
    ]
    for task, m in r["tasks"].items():
        lines.append(
            f"| {task} | `{m['vllm_call']}` | {m['vllm_rows_per_s']:.1f} | {m['shardgen_rows_per_s']:.1f} | "
            f"**{m['ratio']:.3f}** | {m['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
