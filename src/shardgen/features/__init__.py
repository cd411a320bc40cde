"""The features: run modes, source kinds, shard sets and tasks without an engine, each plugged into the
layers below through their registries (docs/dev/layers.md).
"""
