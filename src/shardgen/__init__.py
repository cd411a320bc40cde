"""shardgen: offline LLM inference over large datasets, one vLLM job per shard on Slurm."""

from shardgen.version import __version__  # noqa: F401

# The features: each registers its checks and kinds with the layers below it when imported
# (config.register_*, engine.KINDS, ...: docs/dev/layers.md). ``import shardgen`` imports none of them;
# the first read of any registry imports them all (shardgen.registry), so that every config is checked
# by every feature whoever reads it. A new feature is one line here.
FEATURES = (
    "fake_engine",
    "functions",
    "openai_batch",
    "prompts",
    "rollouts",
    "server_engine",
    "splits",
    "steps",
    "tasks",
)
