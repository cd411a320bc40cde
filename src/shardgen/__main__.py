"""``python -m shardgen``: the ``shardgen`` command."""

from shardgen.cli import run

run()
