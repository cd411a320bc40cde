#!/usr/bin/env bash
# GPU smoke test: the whole workflow on a real GPU, with FP8 weights and an
# FP8 KV cache, then the throughput benchmark. One command, for a
# maintainer on a machine with an NVIDIA GPU of compute capability 8.9 or
# newer (L40S, H100/H200, Blackwell) and internet access to PyPI:
#
#   bash bench/gpu_smoke.sh
#
# 1. installs the CUDA build of vLLM (SHARDGEN_VLLM=gpu make setup) and the
#    demo model, unless VENV already holds the CUDA build;
# 2. makes a small dataset and runs the workflow with the local profile (no
#    Slurm) on it: model.quantization fp8, model.kv_cache_dtype fp8;
# 3. checks the output (every row, no errors) and each shard's stats (the
#    GPUs it saw, the precision it ran with);
# 4. runs bench/throughput.py.
# Everything lands in bench/results/gpu-<date>/ (a second run on the same day
# replaces it). Exits non-zero on the first failure.
#
# Environment: VENV (default .venv), ROWS (default 256),
# ROWS_PER_SHARD (default 128), GPU_MEMORY_UTILIZATION (default 0.5).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${VENV:-.venv}
ROWS=${ROWS:-256}
ROWS_PER_SHARD=${ROWS_PER_SHARD:-128}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.5}
OUT="$ROOT/bench/results/gpu-$(date +%Y-%m-%d)"
MODEL="$ROOT/models/SmolLM2-135M-Instruct"

step() { echo; echo "== gpu-smoke: $*"; }
fail() { echo "gpu-smoke: FAILED: $*" >&2; exit 1; }

step "GPU"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this needs a machine with an NVIDIA GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv \
  || fail "nvidia-smi sees no GPU"

step "environment: CUDA build of vLLM in $VENV"
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'from importlib.metadata import version; version("vllm")' 2>/dev/null; then
  fail "$VENV holds vLLM's CPU build (or none); remove it (rm -rf $VENV) or choose another one (VENV=.venv-gpu bash bench/gpu_smoke.sh)"
fi
SHARDGEN_VLLM=gpu make setup VENV="$VENV"
BIN="$(cd "$VENV" && pwd)/bin"
export PATH="$BIN:$PATH"
"$BIN/python" -c 'import torch, vllm; assert torch.cuda.is_available(), "torch sees no CUDA GPU"; print("vllm", vllm.__version__, "torch", torch.__version__, "CUDA", torch.version.cuda)'

step "a small dataset and a config, in $OUT"
rm -rf "$OUT"
mkdir -p "$OUT/run"
python scripts/make_demo_data.py "$OUT/run/data" "$ROWS"
cat >"$OUT/run/config.yaml" <<EOF
input:
  parquet: [$OUT/run/data/*.parquet]
  id_column: id
shards:
  rows_per_shard: $ROWS_PER_SHARD
prompt:
  system: You are a concise, accurate assistant.
  template: "Tell me about {{ topic }} in {{ style }}."
model:
  model: $MODEL
  max_model_len: 2048
  quantization: fp8
  kv_cache_dtype: fp8
  gpu_memory_utilization: $GPU_MEMORY_UTILIZATION
sampling:
  temperature: 0.0
  max_tokens: 64
resources:
  # one generate job at a time on the local profile's 2 cores: one engine per GPU
  cpus_per_task: 2
  mem_mb: 16000
  runtime: 30
EOF
cat "$OUT/run/config.yaml"

step "the workflow, local profile (no Slurm)"
{
  nvidia-smi
  python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
} >"$OUT/environment.txt" 2>&1
if ! snakemake --snakefile "$ROOT/Snakefile" --directory "$OUT/run" --profile "$ROOT/profiles/local" \
  --configfile "$OUT/run/config.yaml" >"$OUT/snakemake.log" 2>&1; then
  tail -n 40 "$OUT/snakemake.log" >&2
  for log in "$OUT"/run/results/logs/generate_shard/*.log; do
    [ -e "$log" ] && { echo "--- $log" >&2; tail -n 40 "$log" >&2; }
  done
  fail "the workflow failed; logs: $OUT/snakemake.log and $OUT/run/results/logs/"
fi
tail -n 20 "$OUT/snakemake.log"

step "checking the output and each shard's GPUs and precision"
python - "$OUT/run/results" "$ROWS" >"$OUT/checks.txt" <<'PY' || { cat "$OUT/checks.txt" >&2; fail "the output is wrong"; }
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

results, rows = Path(sys.argv[1]), int(sys.argv[2])
problems = []
table = pq.read_table(results / "output.parquet")
stats = json.loads((results / "stats.json").read_text())
errors = [e for e in table.column("error").to_pylist() if e]
print(f"rows: {table.num_rows} (expected {rows}); errors: {len(errors)}")
if table.num_rows != rows:
    problems.append(f"{table.num_rows} rows, expected {rows}")
if errors or stats.get("errors"):
    problems.append(f"{len(errors)} row(s) with an error, the first: {errors[:1]}")
if not all(g and g.strip() for g in table.column("generation").to_pylist()):
    problems.append("an empty generation")
print(f"output tokens/s: {stats.get('output_tokens_per_s')}, shards: {len(stats['shards'])}")
for path in sorted((results / "shards").glob("*.stats.json")):
    s = json.loads(path.read_text())
    precision = s.get("precision") or {}
    gpus = s.get("gpu_devices")
    names = [g.get("name") for g in gpus] if isinstance(gpus, list) else []
    args = (s.get("engine") or {}).get("args", {})
    print(
        f"shard {s['shard']}: {s['rows']} rows, gpus {names or gpus}, "
        f"quantization {precision.get('quantization')!r}, kv_cache_dtype {precision.get('kv_cache_dtype')!r}, "
        f"engine args quantization {args.get('quantization')!r} kv_cache_dtype {args.get('kv_cache_dtype')!r}, "
        f"vLLM {(s.get('engine') or {}).get('vllm_version')}, {s.get('output_tokens_per_s')} tok/s; "
        f"{precision.get('reason')}"
    )
    if not (names and all(names)):
        problems.append(f"shard {s['shard']}: no GPU recorded (gpu_devices: {gpus!r})")
    if precision.get("quantization") not in ("fp8", "fp8_per_tensor"):
        problems.append(f"shard {s['shard']}: weights not FP8 (precision: {precision!r})")
    if precision.get("kv_cache_dtype") != "fp8":
        problems.append(f"shard {s['shard']}: KV cache not FP8 (precision: {precision!r})")
    if s.get("errors"):
        problems.append(f"shard {s['shard']}: {s['errors']} error(s)")
for p in problems:
    print(f"PROBLEM: {p}")
sys.exit(1 if problems else 0)
PY
cat "$OUT/checks.txt"
cp "$OUT/run/results/stats.json" "$OUT/stats.json"

step "throughput benchmark (bench/throughput.py)"
if ! python bench/throughput.py --out "$OUT/throughput" >"$OUT/throughput.log" 2>&1; then
  tail -n 40 "$OUT/throughput.log" >&2
  fail "bench/throughput.py failed; log: $OUT/throughput.log"
fi
cat "$OUT/throughput/throughput.md"

step "passed; everything is in $OUT"
