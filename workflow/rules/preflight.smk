# Preflight: every check that can run before a GPU job is submitted.
from shardgen.jobs.preflight import storage_objects


rule preflight:
    input:
        manifest=rules.plan_shards.output.manifest,
        model=rules.fetch_model.output.record,
    output:
        report=RUN_DIR.preflight,
    log:
        RUN_DIR.log("preflight"),
    localrule: True
    conda:
        "../envs/generate.yaml"
    container:
        RUN.software.container
    params:
        config=run_config,
        # rechecked when what it checks changes (which reruns every shard anyway)
        checks=RUN.fingerprint,
    shell:
        "shardgen preflight --config {params.config:q} --manifest {input.manifest:q}"
        " --model-record {input.model:q} --report {output.report:q} 2>&1 | tee {log:q}"


# Input in object storage: whether the nodes that run the generate jobs can read it, from a job of
# their own (no GPU), before any of them
rule reach_storage:
    input:
        manifest=rules.plan_shards.output.manifest,
    output:
        record=RUN_DIR.storage_reach,
    log:
        RUN_DIR.log("reach_storage"),
    conda:
        "../envs/generate.yaml"
    container:
        RUN.software.container
    resources:
        cpus_per_task=1,
        mem_mb=2000,
        runtime=5,
    params:
        config=run_config,
    shell:
        "shardgen reach-storage --config {params.config:q} --manifest {input.manifest:q}"
        " --record {output.record:q} 2>&1 | tee {log:q}"


# (ancient: that it was read, not when: a check made again reruns no shard)
STORAGE_REACH = (
    ancient(rules.reach_storage.output.record) if storage_objects(RUN) else []
)
