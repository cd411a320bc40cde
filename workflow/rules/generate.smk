# Generation: one job per shard (or per shards.per_job shards), one vLLM
# engine per job.


rule generate_shard:
    input:
        manifest=rules.plan_shards.output.manifest,
        # no GPU job starts before the run passed its checks (a run of steps: every step's)
        preflight=rules.preflight.output.report,
        preflights=STEP_PREFLIGHTS,
        storage=STORAGE_REACH,
        step_before=step_before_shard,
    output:
        parquet=RUN_DIR.shard_file("{shard}"),
        stats=RUN_DIR.shard_stats("{shard}"),
    log:
        RUN_DIR.log("generate_shard", "{shard}"),
    conda:
        "../envs/generate.yaml"
    container:
        RUN.software.container
    threads: RUN.cpus_per_job
    resources:
        # resources.nodes > 1: the `mpi` and `tasks` resources (common.smk)
        **MULTINODE_RESOURCES,
        # all GPUs of a job on one node, one vLLM process that sees them all;
        # or resources.nodes nodes with the same GPUs each (slurm_extra), one
        # engine across them
        gpu=GPUS,
        tasks_per_gpu=0,
        nodes=RUN.resources.nodes,
        cpus_per_task=RUN.cpus_per_job,
        mem_mb=RUN.resources.mem_mb,
        runtime=generate_runtime,
        slurm_extra=slurm_extra,
    params:
        config=run_config,
        # a parameter, not an input: fetching again (a new download_dir) reruns no shard
        model_record=RUN_DIR.model_record,
        # rerun when anything that decides the generated text changes
        fingerprint=RUN.fingerprint,
        # the shards or the worker, and where they go: each value quoted
        job=generate_args,
    shell:
        "shardgen generate --config {params.config:q} --manifest {input.manifest:q}"
        " --model-record {params.model_record:q} {params.job} >> {log:q} 2>&1"


# shards.per_job > 1: several shards one after the other on one engine, which
# starts once per job. Each shard still gets its own file, stats and checkpoints.
use rule generate_shard as generate_shards with:
    output:
        record=RUN_DIR.job_record("{job}"),
    log:
        RUN_DIR.log("generate_shards", "{job}"),


# shards.workers: W elastic workers, each with one engine, claiming shards
# until none is left (claims on the shared file system, taken over from a
# worker that stopped for longer than shards.lease_seconds).
use rule generate_shard as generate_worker with:
    output:
        record=RUN_DIR.worker_record("{worker}"),
    log:
        RUN_DIR.log("generate_worker", "{worker}"),
