# Planning: the shard manifest, from metadata only, and the model, found on
# disk or downloaded once.


checkpoint plan_shards:
    input:
        # a later step of a run of steps: the plan and the model of the step before it
        step_before=(
            [STEP_BEFORE.manifest, STEP_BEFORE.model_record] if STEP_BEFORE else []
        ),
    output:
        manifest=RUN_DIR.manifest,
    log:
        RUN_DIR.log("plan_shards"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
        # replanned when the input (its config, or a file of it) or the sharding changes
        plan=shardgen_config.plan_digest(RUN.raw, input_signature(RUN.input)),
    shell:
        "shardgen plan --config {params.config:q} --manifest {output.manifest:q} 2>&1 | tee {log:q}"


# On the machine the workflow starts on (usually a login node with internet),
# so that compute nodes run offline and 500 jobs never hit the hub at once.
rule fetch_model:
    output:
        record=RUN_DIR.model_record,
    log:
        RUN_DIR.log("fetch_model"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
        # fetched again when the model changes (which reruns every shard anyway)
        model=shardgen_config.digest(
            {k: RUN.model.get(k) for k in ("model", "revision", "tokenizer")}
            # (only when set: the digest of runs without adapters stays as it was)
            | ({"adapters": dict(RUN.lora.adapters)} if RUN.lora.adapters else {})
        ),
    shell:
        "shardgen fetch-model --config {params.config:q} --output {output.record:q} 2>&1 | tee {log:q}"
