# Merge: every planned row exactly once, in input order, and summed stats.


rule merge_shards:
    input:
        unpack(all_shard_outputs),
        manifest=rules.plan_shards.output.manifest,
        # (for a pooling task's labels and embedding size; here, not in all_shard_outputs, so that it is in
        # the DAG Snakemake builds before the plan, a checkpoint, is made: the fetch runs beside the planning)
        model_record=rules.fetch_model.output.record,
    output:
        # output.parquet, output.jsonl, or the directory output/ or openai/ (output.format)
        dataset=(
            directory(MERGED)
            if RUN.output.format in ("hf", "openai_batch")
            else MERGED
        ),
        stats=RUN_DIR.stats,
    log:
        RUN_DIR.log("merge_shards"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
        # not read from here (the config file has it): a changed price merges again, with the new cost
        cost=RUN.raw["cost"],
    shell:
        "shardgen merge --config {params.config:q} --manifest {input.manifest:q}"
        " --output {output.dataset:q} --stats {output.stats:q} --model-record {input.model_record:q} > {log:q} 2>&1"


# Only when output.push_to_hub is set; the token comes from HF_TOKEN.
rule push_to_hub:
    input:
        dataset=rules.merge_shards.output.dataset,
        stats=rules.merge_shards.output.stats,
    output:
        record=RUN_DIR.pushed,
    log:
        RUN_DIR.log("push_to_hub"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
    shell:
        "shardgen push --config {params.config:q} --dataset {input.dataset:q} --stats {input.stats:q}"
        " --record {output.record:q}"
        " > {log:q} 2>&1"


# output.upload: the merged output and its stats to object storage, from the machine the workflow
# starts on; each object verified; what the last upload left unchanged there is skipped.
rule upload_output:
    input:
        dataset=rules.merge_shards.output.dataset,
        stats=rules.merge_shards.output.stats,
    output:
        record=RUN_DIR.uploaded,
    log:
        RUN_DIR.log("upload_output"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=run_config,
        # uploaded again (what changed) when the prefix changes
        upload=RUN.output.upload,
    shell:
        "shardgen upload --config {params.config:q} --dataset {input.dataset:q} --stats {input.stats:q}"
        " --record {output.record:q} > {log:q} 2>&1"
