"""shardgen: offline LLM inference over large datasets, one vLLM job per shard on Slurm."""

from shardgen.version import __version__  # noqa: F401

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
