# Preflight: every check that can run before a GPU job is submitted.


rule preflight:
    input:
        manifest=rules.plan_shards.output.manifest,
    output:
        report=f"{PLAN_DIR}/preflight.json",
    log:
        f"{LOG_DIR}/preflight.log",
    localrule: True
    conda:
        "../envs/generate.yaml"
    params:
        config=CONFIG_JSON,
        # rechecked when what it checks changes (which reruns every shard anyway)
        checks=shardgen_config.content_fingerprint(config),
    shell:
        "shardgen preflight --config {params.config:q} --manifest {input.manifest:q}"
        " --report {output.report:q} 2>&1 | tee {log:q}"
