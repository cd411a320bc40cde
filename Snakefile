# shardgen: dataset -> shards -> one vLLM job per shard -> merged dataset.
# This file only wires; the work is done by the `shardgen` package.
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

from shardgen import cluster, trust
from shardgen import config as shardgen_config
from shardgen.errors import ConfigError
from shardgen.profile import ProfileError, unset_resources_message

min_version("9.0")

# SET_ME placeholders left in a cluster profile (partition, GPU type) stop the
# run here, while the Snakefile is parsed: before any plan, fetch or job.
_unset = unset_resources_message(workflow.resource_settings, sys.argv)
if _unset:
    raise ProfileError(_unset)


# A --configfile on the command line replaces the example config instead of
# being merged into it, so keys of the example never leak into a user's run.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# A credential anywhere in the config stops the run before any message could quote it.
trust.check_credentials(config)
try:
    validate(config, "workflow/schemas/config.schema.yaml")
except WorkflowError:
    # The same schema again, for a message that names the key and the fix.
    shardgen_config.validate(config)
    raise
shardgen_config.check_consistency(config)
for warning in shardgen_config.warnings(config):
    logger.warning(f"shardgen: warning: {warning}")
# The typed view of the validated config, for the package's functions.
RUN = shardgen_config.RunConfig.from_dict(config)
_container = cluster.container_multinode_problem(
    RUN, workflow.deployment_settings.deployment_method
)
if _container:
    raise ConfigError(_container)


include: "workflow/rules/common.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/preflight.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.merge_shards.output,
        rules.plot_stats.output,
        rules.push_to_hub.output if RUN.output.push_to_hub else [],


# Before the first job, never in a dry run: one run per output directory
# (released when this process ends, however it ends); with Slurm, generate
# jobs that no node can run are refused, and the queue is watched.
onstart:
    start_run()


onsuccess:
    end_run()
    print_summary()


onerror:
    end_run()


# Used as a module (`module shardgen: ...` and `use rule * from shardgen` in
# another Snakefile), Snakemake keeps only the main Snakefile's handlers
# (snakemake/workflow.py: Workflow.onstart registers a module's only in its
# namespace): the run would hold no lock on its output directory, stop no job
# after an error and print no summary. So they are registered here, ahead of
# those the main Snakefile registered before its module statement.
if not workflow.modifier.is_main_snakefile():
    workflow._onstart = chain_handler(start_run, workflow._onstart)
    workflow._onsuccess = chain_handler(
        lambda: (end_run(), print_summary()), workflow._onsuccess
    )
    workflow._onerror = chain_handler(end_run, workflow._onerror)
