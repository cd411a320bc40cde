"""``snakemake``, with the Slurm plugin's status checks at most ``SHARDGEN_TEST_POLL_S`` seconds apart.

The plugin waits 10 s longer before each status check that finds no job
ended, up to 180 s (snakemake_executor_plugin_slurm ``Executor.check_active_jobs``
sets ``next_seconds_between_status_checks``): right for a cluster's jobs of
hours, while the suite's jobs take a minute or two, and a run would wait up
to a minute after each of them ended. The tests run this instead of the
``snakemake`` script; everything else (the profile, the plugin, its squeue
queries, sbatch) is the real command's.
"""

import os
import sys

from snakemake.cli import main
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_S = float(os.environ.get("SHARDGEN_TEST_POLL_S", "3"))

_interval = RemoteExecutor.next_seconds_between_status_checks
RemoteExecutor.next_seconds_between_status_checks = property(
    lambda self: min(_interval.fget(self), POLL_S), _interval.fset
)

if __name__ == "__main__":
    sys.argv[0] = "snakemake"
    sys.exit(main())
