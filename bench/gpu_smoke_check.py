"""Check one case of bench/gpu_smoke.sh: every row, and each shard's GPUs, precision and engine settings.

Usage: python bench/gpu_smoke_check.py CASE RESULTS_DIR ROWS
Prints what it found; exits 1 on the first case of a problem list that is not empty.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

# What each case's shards must have run with (None: not checked).
EXPECT = {
    "fp8": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 1},
    "tp3": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 3},
    "pp2": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 2},
    "nvfp4": {"quantization": None, "kv_cache_dtype": "fp8", "gpus": 1},
    "labels": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 1},
    "json": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 1},
    "slurm": {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 1},
}


def main() -> int:
    case, results, rows = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    expect = EXPECT.get(case.split("-")[0], {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8", "gpus": 1})
    problems = []
    table = pq.read_table(results / "output.parquet")
    stats = json.loads((results / "stats.json").read_text())
    errors = [e for e in table.column("error").to_pylist() if e]
    speed = f"{stats.get('output_tokens_per_s')} output tok/s"
    print(f"{case}: {table.num_rows} rows (expected {rows}), {len(errors)} errors, {speed}, "
          f"TTFT from scheduling p50 {stats.get('ttft_scheduled_p50_s')} s")  # fmt: skip
    if len({r for r in table.column("row_index").to_pylist()}) != rows:
        problems.append(f"{table.num_rows} rows, expected every one of {rows}")
    if errors:
        problems.append(f"{len(errors)} row(s) with an error, the first: {errors[:1]}")
    if case == "labels" and not all(abs(sum(p.values()) - 1) < 1e-4 for p in table.column("choice_probs").to_pylist()):
        problems.append("label probabilities that do not sum to one")
    for path in sorted((results / "shards").glob("*.stats.json")):
        s = json.loads(path.read_text())
        precision, engine = s.get("precision") or {}, s.get("engine") or {}
        names = [g.get("name") for g in s.get("gpu_devices") or []]
        print(f"  shard {s['shard']}: gpus {names}, precision {precision}, environment {engine.get('environment')}, "
              f"memory failures {s.get('memory_failures')}")  # fmt: skip
        if len(names) != expect["gpus"] or not all(names):
            problems.append(f"shard {s['shard']}: GPUs {names}, expected {expect['gpus']}")
        for key in ("quantization", "kv_cache_dtype"):
            if expect[key] is not None and precision.get(key) != expect[key]:
                problems.append(f"shard {s['shard']}: {key} {precision.get(key)!r}, expected {expect[key]!r}")
        if (engine.get("environment") or {}).get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
            problems.append(f"shard {s['shard']}: vLLM's processes were not spawned")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
