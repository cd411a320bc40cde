"""Rows and shards: the sources, the plan and its manifest, what identifies a shard's content, the output
files and a shard's figures.
"""
