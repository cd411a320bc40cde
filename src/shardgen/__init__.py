"""shardgen: offline LLM inference over large datasets, one vLLM job per shard on Slurm."""

# The features register their checks and kinds with the layers below them when imported
# (config.register_*: docs/dev/layers.md); importing the package imports them all, so that every
# config is checked by every feature whoever imports config. A new feature is one line here.
from shardgen import (  # noqa: F401
    fake_engine,
    functions,
    openai_batch,
    prompts,
    rollouts,
    server_engine,
    splits,
    steps,
    tasks,
)
from shardgen.version import __version__  # noqa: F401
