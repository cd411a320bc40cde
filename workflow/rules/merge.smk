# Merge: every planned row exactly once, in input order, and summed stats.


rule merge_shards:
    input:
        unpack(all_shard_outputs),
        manifest=rules.plan_shards.output.manifest,
    output:
        parquet=f"{OUT}/output.parquet",
        stats=f"{OUT}/stats.json",
    log:
        f"{LOG_DIR}/merge_shards.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        shard_dir=SHARD_DIR,
    shell:
        "shardgen merge --manifest {input.manifest:q} --shard-dir {params.shard_dir:q}"
        " --output {output.parquet:q} --stats {output.stats:q} > {log:q} 2>&1"
