#!/usr/bin/env bash
# A second environment for the Snakemake controller alone, without vLLM.
#
# The Slurm executor plugin that installs beside vLLM (2.6.x) sleeps 5 s before
# every sbatch: about 24 jobs a minute, hours for 10,000 shards. The versions
# without the pause (2.7.1 and later) need a numpy that vLLM's dependencies
# refuse, so they live here. Run the workflow from this environment with the
# engine's environment first on PATH: the rules call its `shardgen`.
#
#   PATH=$PWD/.venv/bin:$PATH .venv-ctl/bin/snakemake --profile profiles/slurm ...
#
# Usage: scripts/setup-controller.sh [VENV_DIR]
set -euo pipefail
venv=${1:-.venv-ctl}
echo "setup: creating the controller environment $venv (Snakemake, the Slurm plugin >= 2.7.1, no vLLM)"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "snakemake==9.27.1" "snakemake-executor-plugin-slurm>=2.7.1,<3" -e .
"$venv/bin/python" -c "import importlib.metadata as m; print('setup: executor plugin', m.version('snakemake-executor-plugin-slurm'))"
