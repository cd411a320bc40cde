# Planning: the resolved config, then the shard manifest (metadata only).


rule write_config:
    # The validated config with defaults filled, as the CLI reads it. It is
    # rewritten whenever any config value changes (params); the rules below
    # read it as ancient() so that only changes that matter rerun them.
    output:
        f"{PLAN_DIR}/config.json",
    log:
        f"{LOG_DIR}/write_config.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=config,
    run:
        from shardgen.io import atomic_write_text

        atomic_write_text(
            output[0], json.dumps(params.config, indent=1, sort_keys=True) + "\n"
        )


checkpoint plan_shards:
    input:
        config=ancient(rules.write_config.output[0]),
    output:
        manifest=f"{PLAN_DIR}/manifest.json",
    log:
        f"{LOG_DIR}/plan_shards.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        # replanned when the input or the sharding changes
        plan=lambda wildcards: shardgen_config.digest(
            [config["input"], config["shards"]]
        ),
    shell:
        "shardgen plan --config {input.config:q} --manifest {output.manifest:q} 2> {log:q}"
