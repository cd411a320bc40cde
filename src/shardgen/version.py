"""shardgen's own version (the provenance of every output names it)."""

__version__ = "0.1.0"
