# One run: the dataset's shards, a vLLM job per shard, the merge (a run of `steps` is this once per
# step: steps.smk). The typed view of the validated config, for the package's functions.
from shardgen import cluster
from shardgen.errors import ConfigError

RUN = shardgen_config.RunConfig.from_dict(config)
_container = cluster.container_multinode_problem(
    RUN, workflow.deployment_settings.deployment_method
)
if _container:
    raise ConfigError(_container)


include: "common.smk"
include: "plan.smk"
include: "preflight.smk"
include: "generate.smk"
include: "merge.smk"
include: "report.smk"


# What the run makes (the Snakefile's rule all)
OUTPUTS = [
    rules.merge_shards.output,
    rules.plot_stats.output,
    rules.push_to_hub.output if RUN.output.push_to_hub else [],
    rules.upload_output.output if RUN.output.upload else [],
]


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
# those the main Snakefile registered before its module statement. (Not for a
# step of a run of steps, whose own handlers hold the run: steps.smk.)
if not workflow.modifier.is_main_snakefile() and not RUN.step:
    workflow._onstart = chain_handler(start_run, workflow._onstart)
    workflow._onsuccess = chain_handler(
        lambda: (end_run(), print_summary()), workflow._onsuccess
    )
    workflow._onerror = chain_handler(end_run, workflow._onerror)
