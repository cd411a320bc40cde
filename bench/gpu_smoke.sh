#!/usr/bin/env bash
# The first GPU run: everything the CPU build cannot show, in one command, for
# a maintainer on a machine with an NVIDIA GPU of compute capability 8.9 or
# newer (L40S, H100/H200, Blackwell) and internet access to PyPI:
#
#   bash bench/gpu_smoke.sh
#
# 1. installs the CUDA build of vLLM (SHARDGEN_VLLM=gpu make setup, which
#    also installs FlashInfer's precompiled kernels) unless VENV holds it;
# 2. records the machine: nvidia-smi -q, the driver, torch.cuda's view;
# 3. runs the workflow (local profile) on a small dataset for each case, and
#    checks every row and each shard's GPUs, precision and engine settings:
#      fp8         quantization auto, kv_cache_dtype auto: FP8 weights
#                  (fp8_per_channel) and an FP8 KV cache
#      tp3         the same on three GPUs (tensor_parallel_size 3: the demo model's 9 heads), with 3+ GPUs
#      pp2         the same in two pipeline stages (pipeline_parallel_size 2), with 2+ GPUs
#      nvfp4       an NVFP4 checkpoint (SHARDGEN_NVFP4_MODEL) on Blackwell
#      invariant   seeded sampling with model.batch_invariant, at two shard
#                  sizes: the same text for every row
#      labels      choice labels with probabilities, and a JSON schema
#      slurm       the Slurm profile (with SLURM_PARTITION set and sbatch on PATH)
#      example-*   each config of config/examples/ that fits one GPU, as it is, on a
#                  small made-up input (bench/gpu_smoke_examples.py), its model from the hub
# 4. runs bench/throughput.py and bench/feed.py at a size that suits a GPU.
# Everything lands in bench/results/gpu-<date>/ (commit it); a second run on
# the same day replaces it. Exits non-zero on the first failure.
#
# Environment: VENV (default .venv), ROWS (default 512), GPU_MEMORY_UTILIZATION
# (default 0.8), SHARDGEN_NVFP4_MODEL (an NVFP4 checkpoint directory or hub
# id), SLURM_PARTITION (a GPU partition for the slurm case), EXAMPLES (the
# examples to run, by name, or none; default: every one that fits one GPU).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${VENV:-.venv}
ROWS=${ROWS:-512}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.8}
OUT="$ROOT/bench/results/gpu-$(date +%Y-%m-%d)"
MODEL="$ROOT/models/SmolLM2-135M-Instruct"

step() { echo; echo "== gpu-smoke: $*"; }
fail() { echo "gpu-smoke: FAILED: $*" >&2; exit 1; }

step "GPU"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this needs a machine with an NVIDIA GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv \
  || fail "nvidia-smi sees no GPU"
GPUS=$(nvidia-smi -L | grep -c '^GPU ')
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')

step "environment: CUDA build of vLLM in $VENV"
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'from importlib.metadata import version; version("vllm")' 2>/dev/null; then
  fail "$VENV holds vLLM's CPU build (or none); remove it (rm -rf $VENV) or choose another one (VENV=.venv-gpu bash bench/gpu_smoke.sh)"
fi
SHARDGEN_VLLM=gpu make setup VENV="$VENV"
BIN="$(cd "$VENV" && pwd)/bin"
export PATH="$BIN:$PATH"
rm -rf "$OUT"
mkdir -p "$OUT"

step "the machine, recorded in $OUT/machine"
mkdir -p "$OUT/machine"
nvidia-smi >"$OUT/machine/nvidia-smi.txt" 2>&1
nvidia-smi -q >"$OUT/machine/nvidia-smi-q.txt" 2>&1
nvidia-smi topo -m >"$OUT/machine/nvidia-smi-topo.txt" 2>&1 || true
nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version,compute_cap --format=csv,noheader,nounits \
  >"$OUT/machine/nvidia-smi-query.csv"
python - >"$OUT/machine/torch.json" <<'PY' || fail "torch sees no CUDA GPU"
import json

import torch
import vllm

from shardgen.base import kernels
from shardgen.base.installed import version_problem

assert torch.cuda.is_available(), "torch sees no CUDA GPU"
print(json.dumps({
    "vllm": vllm.__version__, "vllm_problem": version_problem(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "flashinfer_missing": kernels.missing_kernels(),
    "devices": [{"name": p.name, "capability": [p.major, p.minor], "memory_mib": p.total_memory >> 20,
                 "multiprocessors": p.multi_processor_count}
                for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))],
}, indent=1))
PY
cat "$OUT/machine/torch.json"

make_config() { # NAME ROWS_PER_SHARD, then the config's model, sampling and output lines on stdin
  local dir="$OUT/$1"
  mkdir -p "$dir"
  [ -d "$dir/data" ] || python scripts/make_demo_data.py "$dir/data" "$ROWS" >/dev/null
  {
    printf 'input:\n  parquet: [%s/data/*.parquet]\n  id_column: id\n' "$dir"
    printf 'shards:\n  rows_per_shard: %s\n' "$2"
    printf 'prompt:\n  system: You are a concise, accurate assistant.\n  template: "Tell me about {{ topic }} in {{ style }}."\n'
    printf 'resources:\n  mem_mb: 32000\n  runtime: 30\n'
    cat
  } >"$dir/config.yaml"
}

run_case() { # NAME [snakemake options...]: run the workflow on $OUT/NAME/config.yaml, then check it
  local name=$1 dir="$OUT/$1"
  shift
  step "$name: the workflow"
  if ! snakemake --snakefile "$ROOT/Snakefile" --directory "$dir" --configfile "$dir/config.yaml" "$@" \
    >"$dir/snakemake.log" 2>&1; then
    tail -n 40 "$dir/snakemake.log" >&2
    for log in "$dir"/results/logs/generate_shard/*.log; do
      [ -e "$log" ] && { echo "--- $log" >&2; tail -n 60 "$log" >&2; }
    done
    fail "$name: the workflow failed; logs: $dir/snakemake.log and $dir/results/logs/"
  fi
  python "$ROOT/bench/gpu_smoke_check.py" "$name" "$dir/results" "$ROWS" | tee "$dir/checks.txt" \
    || fail "$name: the output is wrong (see $dir/checks.txt)"
}

model_lines() { # QUANTIZATION KV_CACHE_DTYPE [more model lines]
  printf 'model:\n  model: %s\n  max_model_len: 2048\n  quantization: %s\n  kv_cache_dtype: %s\n' \
    "${MODEL_OVERRIDE:-$MODEL}" "$1" "$2"
  printf '  gpu_memory_utilization: %s\n' "$GPU_MEMORY_UTILIZATION"
  shift 2
  for line in "$@"; do printf '  %s\n' "$line"; done
}

make_config fp8 256 <<EOF
$(model_lines auto auto)
sampling: {temperature: 0.0, max_tokens: 64}
EOF
run_case fp8 --profile "$ROOT/profiles/local"

# The demo model has 9 attention heads (tensor parallelism must divide them: 3, not 2) and 30 layers.
if [ "$GPUS" -ge 3 ]; then
  make_config tp3 256 <<EOF
$(model_lines auto auto "tensor_parallel_size: 3")
sampling: {temperature: 0.0, max_tokens: 64}
EOF
  run_case tp3 --profile "$ROOT/profiles/local"
else
  step "tp3: skipped, fewer than 3 GPUs"
fi
if [ "$GPUS" -ge 2 ]; then
  make_config pp2 256 <<EOF
$(model_lines auto auto "pipeline_parallel_size: 2")
sampling: {temperature: 0.0, max_tokens: 64}
EOF
  run_case pp2 --profile "$ROOT/profiles/local"
else
  step "pp2: skipped, one GPU"
fi

if [ "${CAP%%.*}" -ge 10 ] && [ -n "${SHARDGEN_NVFP4_MODEL:-}" ]; then
  make_config nvfp4 256 <<EOF
$(MODEL_OVERRIDE=$SHARDGEN_NVFP4_MODEL model_lines null auto)
sampling: {temperature: 0.0, max_tokens: 64}
EOF
  run_case nvfp4 --profile "$ROOT/profiles/local"
else
  step "nvfp4: skipped (needs a Blackwell GPU, compute capability 10.0 or newer, and SHARDGEN_NVFP4_MODEL)"
fi

for size in 256 64; do
  make_config "invariant-$size" "$size" <<EOF
$(model_lines auto auto "batch_invariant: true")
sampling: {temperature: 0.8, max_tokens: 48, seed: 1}
EOF
  run_case "invariant-$size" --profile "$ROOT/profiles/local"
done
python - "$OUT/invariant-256/results/output.parquet" "$OUT/invariant-64/results/output.parquet" <<'PY' \
  | tee "$OUT/invariant.txt" || fail "batch invariance: other shard sizes gave other text"
import sys

import pyarrow.parquet as pq

a, b = (pq.read_table(p, columns=["generation"]).column(0).to_pylist() for p in sys.argv[1:])
same = sum(x == y for x, y in zip(a, b, strict=True))
print(f"batch invariance: {same} of {len(a)} rows have the same text with 256 and 64 rows per shard")
sys.exit(0 if same == len(a) else 1)
PY

make_config labels 256 <<EOF
$(model_lines auto auto)
sampling:
  temperature: 0.0
  max_tokens: 8
  structured_outputs: {choice: [positive, negative, neutral]}
output: {choice_probs: true}
EOF
run_case labels --profile "$ROOT/profiles/local"
make_config json 256 <<EOF
$(model_lines auto auto "extra: {structured_outputs_config: {backend: xgrammar, disable_any_whitespace: true}}")
sampling:
  temperature: 0.0
  max_tokens: 64
  structured_outputs: {json: {type: object, properties: {summary: {type: string, maxLength: 80}}, required: [summary]}}
EOF
run_case json --profile "$ROOT/profiles/local"

if [ -n "${SLURM_PARTITION:-}" ] && command -v sbatch >/dev/null 2>&1; then
  make_config slurm 128 <<EOF
$(model_lines auto auto)
sampling: {temperature: 0.0, max_tokens: 64}
EOF
  run_case slurm --profile "$ROOT/profiles/slurm" --default-resources "slurm_partition=$SLURM_PARTITION"
else
  step "slurm: skipped (set SLURM_PARTITION on a machine with sbatch)"
fi

# The examples a researcher copies (config/examples/) that fit one GPU, each as it is, on a small
# made-up input; their models come from the hub (a gated one needs HF_TOKEN). EXAMPLES=none skips them.
for example in ${EXAMPLES:-$(python bench/gpu_smoke_examples.py list)}; do
  [ "$example" = none ] && break
  dir="$OUT/example-$example"
  step "example $example: the workflow"
  python bench/gpu_smoke_examples.py prepare "$example" "$dir" "$ROWS" || fail "example $example: no config"
  snakemake --snakefile "$ROOT/Snakefile" --directory "$dir" --configfile "$dir/config.yaml" \
    --profile "$ROOT/profiles/local" >"$dir/snakemake.log" 2>&1 \
    || { tail -n 40 "$dir/snakemake.log" >&2; fail "example $example: the workflow failed; logs: $dir"; }
  python bench/gpu_smoke_examples.py check "$example" "$dir/results" "$ROWS" | tee "$dir/checks.txt" \
    || fail "example $example: the output is wrong (see $dir/checks.txt)"
done

step "throughput benchmark (bench/throughput.py)"
python bench/throughput.py --rows 2048 --max-tokens 128 --out "$OUT/throughput" >"$OUT/throughput.log" 2>&1 \
  || { tail -n 40 "$OUT/throughput.log" >&2; fail "bench/throughput.py failed; log: $OUT/throughput.log"; }
cat "$OUT/throughput/throughput.md"

step "feed benchmark (bench/feed.py)"
python bench/feed.py --size full --out "$OUT/feed" >"$OUT/feed.log" 2>&1 \
  || { tail -n 40 "$OUT/feed.log" >&2; fail "bench/feed.py failed; log: $OUT/feed.log"; }
cat "$OUT/feed/feed.md"

step "passed; everything is in $OUT"
