"""The environment of the processes that run model code (generate, preflight, a node of a multi-node
engine), set in one place.

The Slurm executor plugin exports the controller's whole environment into every job. Before any
model code or vLLM is imported, a command that runs it (``enter``):

- drops the Hugging Face token: the variables, and the token file ``hf auth login`` writes, which
  ``huggingface_hub`` reads when no variable is set (``HF_TOKEN_PATH`` points at an empty file).
  Only fetch-model and push, on the machine the run starts from, use the token;
- drops the thread-count variables Snakemake sets from a rule's ``threads``: vLLM sizes and pins
  its own worker threads (on the CPU build it binds all cores but one), and an inherited
  ``OMP_NUM_THREADS`` larger than the cores it binds oversubscribes them, about 9x slower measured
  on the CPU build. What was dropped is kept for the shard's stats (``removed``);
- runs offline and without usage reports (vLLM's rank-0 worker otherwise posts usage data to
  stats.vllm.ai: vllm/usage/usage_lib.py);
- has vLLM spawn its engine core and workers. On CUDA vLLM forks them unless CUDA is initialised
  already (vllm/utils/system_utils.py, _maybe_force_spawn), and a fork would copy this process's
  pyarrow threads and shardgen's signal handlers; the CPU build always spawns
  (vllm/platforms/cpu.py).

What depends on the engine's settings or the node (the compile cache of this node, batch
invariance: ``engine.EngineSettings.environment``; a multi-node engine's addresses:
``multinode.node_environment``) is set with ``apply`` before the engine starts. What shardgen set
for one node never reaches another's processes (``for_other_nodes``): each node of a multi-node
engine computes its own interfaces and cache (the head's ``eno1`` is not a worker's ``ens3f0``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
PROCESS_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}

# Variables that hold one node's own values (its address, its network interfaces, its compile
# cache): set on each node for itself, never passed on to another node's processes.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the network interface, per library
# The compile caches of vLLM (torch.compile, CUDA graphs, FlashInfer's autotuning), FlashInfer's JIT
# kernels (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer: flashinfer/jit/env.py) and Triton's (by
# default ~/.triton, shared by every node): per node, under the node's own root (jobinfo.cache_root),
# so that no two nodes write one cache at once. A value the user set is kept.
CACHE_VARS = ("VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR")
PER_NODE = ("VLLM_HOST_IP", *IFNAME_VARS, *CACHE_VARS)

# The thread-count variables this process dropped, with their values.
removed: dict[str, str] = {}
# The PER_NODE variables shardgen set in this process (a user's own setting of one is passed on).
set_here: set[str] = set()


def node_caches(root: str) -> dict[str, str]:
    """The per-node caches under ``root`` (``jobinfo.cache_root``), where the user set none; and no
    download of FlashInfer's kernels on a compute node (FLASHINFER_NO_DOWNLOAD: a missing one fails at
    once instead of waiting on the network; the preflight and the setup install them)."""
    caches = {"VLLM_CACHE_ROOT": root, "FLASHINFER_WORKSPACE_BASE": root, "TRITON_CACHE_DIR": f"{root}/triton"}
    env = {k: v for k, v in caches.items() if k == "VLLM_CACHE_ROOT" or not os.environ.get(k) or k in set_here}
    return env | {"FLASHINFER_NO_DOWNLOAD": os.environ.get("FLASHINFER_NO_DOWNLOAD", "1")}


def hide_tokens() -> None:
    """Drop the Hugging Face token from this process and the processes it starts."""
    for name in TOKEN_ENV:
        os.environ.pop(name, None)
    os.environ["HF_TOKEN_PATH"] = os.devnull


def clear_thread_env() -> dict[str, str]:
    """Drop the thread-count variables; return those dropped now (``removed`` keeps them all)."""
    now = {k: os.environ.pop(k) for k in THREAD_ENV_VARS if k in os.environ}
    removed.update(now)
    return now


def enter(command: str = "generate") -> dict[str, str]:
    """The environment of a process that runs model code (the module's docstring); again is harmless.
    The preflight also keeps the tokenizers library from starting threads it would fork with (unless
    set). Returns the thread-count variables this process dropped."""
    hide_tokens()
    clear_thread_env()
    apply(OFFLINE_ENV | PROCESS_ENV)
    if command == "preflight":
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return dict(removed)


def apply(env: Mapping[str, str]) -> None:
    """Set ``env`` for this process and the engine's processes, which inherit it."""
    set_here.update(k for k in env if k in PER_NODE)
    os.environ.update(env)


def for_other_nodes() -> dict[str, str]:
    """This process's environment for a process on another node: without the values shardgen set
    for this node (``PER_NODE``), which that node sets for itself."""
    return {k: v for k, v in os.environ.items() if k not in set_here}
