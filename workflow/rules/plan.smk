# Planning: the shard manifest, from metadata only.


checkpoint plan_shards:
    output:
        manifest=f"{PLAN_DIR}/manifest.json",
    log:
        f"{LOG_DIR}/plan_shards.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=CONFIG_JSON,
        # replanned when the input or the sharding changes
        plan=shardgen_config.digest([config["input"], config["shards"]]),
    shell:
        "shardgen plan --config {params.config:q} --manifest {output.manifest:q} 2>&1 | tee {log:q}"
