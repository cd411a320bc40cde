"""shardgen: offline LLM inference over large datasets, one vLLM job per shard on Slurm.

From Python (``shardgen.api``)::

    import shardgen

    table = shardgen.generate(rows, "config/config.yaml")   # here, in this process: a pyarrow.Table
    result = shardgen.run("config/config.yaml", profile="slurm")  # the whole workflow, as the command line
    shardgen.close()                                          # the engine generate keeps between calls
"""

from __future__ import annotations

import importlib
from typing import Any

from shardgen.version import __version__

# (their types: __init__.pyi)
__all__ = ["RunResult", "__version__", "close", "generate", "run"]


def __getattr__(name: str) -> Any:
    # The API's functions, imported when first used: ``import shardgen`` stays light (the CLI's start and
    # the status check import neither pyarrow nor the features).
    # (by name: the layers below read FEATURES from here, and must not reach the API through it)
    if name in ("RunResult", "close", "generate", "run"):
        return getattr(importlib.import_module("shardgen.api"), name)
    raise AttributeError(f"module 'shardgen' has no attribute {name!r}")


# The features: each registers its checks and kinds with the layers below it when imported
# (config.register_*, engine.KINDS, ...: docs/dev/layers.md). ``import shardgen`` imports none of them;
# the first read of any registry imports them all (shardgen.base.registry), so that every config is checked
# by every feature whoever reads it. A new feature is one line here.
FEATURES = (
    "engines.vllm",
    "engines.fake",
    "features.functions",
    "features.openai_batch",
    "requests.prompts",
    "features.rollouts",
    "engines.server",
    "features.splits",
    "features.steps",
    "requests.tasks",
)
