"""shardgen: offline LLM inference over large datasets, one vLLM job per shard on Slurm."""

__version__ = "0.1.0"
