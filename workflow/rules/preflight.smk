# Preflight: every check that can run before a GPU job is submitted.


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
