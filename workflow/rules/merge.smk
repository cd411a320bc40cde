# Merge: every planned row exactly once, in input order, and summed stats.


rule merge_shards:
    input:
        unpack(all_shard_outputs),
        manifest=rules.plan_shards.output.manifest,
    output:
        # output.parquet, output.jsonl, or the directory output/ (output.format)
        dataset=MERGED if RUN.output.format != "hf" else directory(MERGED),
        stats=f"{OUT}/stats.json",
    log:
        f"{LOG_DIR}/merge_shards.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
        shard_dir=SHARD_DIR,
        # read by a pooling task's merge, which has it among its inputs (all_shard_outputs)
        model_record=MODEL_RECORD,
    shell:
        "shardgen merge --config {params.config:q} --manifest {input.manifest:q} --shard-dir {params.shard_dir:q}"
        " --output {output.dataset:q} --stats {output.stats:q} --model-record {params.model_record:q} > {log:q} 2>&1"


# Only when output.push_to_hub is set; the token comes from HF_TOKEN.
rule push_to_hub:
    input:
        dataset=rules.merge_shards.output.dataset,
    output:
        record=f"{OUT}/pushed.json",
    log:
        f"{LOG_DIR}/push_to_hub.log",
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
    shell:
        "shardgen push --config {params.config:q} --dataset {input.dataset:q} --record {output.record:q}"
        " > {log:q} 2>&1"
