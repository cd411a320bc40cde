#!/usr/bin/env bash
# Run by Snakemake once, right after it creates the generate environment, on the machine the run
# starts from (the login node, with internet; Snakemake's post-deploy scripts): FlashInfer's
# precompiled kernels, which offline compute nodes could not download, and without which every
# engine start compiles kernels for minutes. The preflight checks they are there.
set -eu
vllm download-kernels || echo "shardgen: warning: vllm download-kernels failed; run it in $CONDA_PREFIX where there is internet" >&2
