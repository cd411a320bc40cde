# A run of steps (`steps:`): this workflow once per step, as a Snakemake module with the
# step's own config (shardgen.features.steps.step_configs: its rules are named <step>_<rule>, its
# files are under <output.dir>/steps/<step>/), and the run's output: the last step's rows
# after its select. The run's handlers hold the whole run; the steps' own do not run.
from shardgen.base.io import restrict_umask
from shardgen.base.rundir import RunDir

restrict_umask(config["output"]["world_readable"])
RUN_DIR = RunDir(config["output"]["dir"])
CONFIG_JSON = shardgen_config.write_resolved(config, RUN_DIR.root)
MERGED = RUN_DIR.merged(config["output"]["format"])


include: "steps_common.smk"


for STEP_CONFIG in STEPS:
    STEP_MODULE = "step_" + STEP_CONFIG["step"]["name"]
    STEP_RULES = STEP_CONFIG["step"]["name"] + "_"

    module:
        name: STEP_MODULE
        snakefile:
            "../../Snakefile"
        config:
            STEP_CONFIG

    use rule * from STEP_MODULE as STEP_RULES*


LAST_STEP = RunDir(STEPS[-1]["output"]["dir"])


rule select_output:
    input:
        # every step merged: its own output, and the stats the run's sum up
        stats=[RunDir(c["output"]["dir"]).stats for c in STEPS],
        last=LAST_STEP.merged("parquet"),
    output:
        dataset=(directory(MERGED) if config["output"]["format"] == "hf" else MERGED),
        stats=RUN_DIR.stats,
    log:
        RUN_DIR.log("select_output"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=lambda wildcards, output: CONFIG_JSON,
        # selected again when the last step's select changes (the steps' own changes merge them again)
        select=STEPS[-1]["step"]["select"] or {},
    shell:
        "shardgen select --config {params.config:q} --output {output.dataset:q}"
        " --stats {output.stats:q} > {log:q} 2>&1"


# output.upload: the run's output and stats to object storage (shardgen.jobs.merge.upload)
rule upload_output:
    input:
        dataset=rules.select_output.output.dataset,
        stats=rules.select_output.output.stats,
    output:
        record=RUN_DIR.uploaded,
    log:
        RUN_DIR.log("upload_output"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        config=lambda wildcards, output: CONFIG_JSON,
        upload=config["output"].get("upload"),
    shell:
        "shardgen upload --config {params.config:q} --dataset {input.dataset:q} --stats {input.stats:q}"
        " --record {output.record:q} > {log:q} 2>&1"


# What the run makes (the Snakefile's rule all): its output, and each step's plots for the report
OUTPUTS = [
    rules.select_output.output,
    rules.upload_output.output if config["output"].get("upload") else [],
    *(getattr(rules, f"{c['step']['name']}_plot_stats").output for c in STEPS),
]


onstart:
    start_steps()


onsuccess:
    end_steps()
    print_steps()


onerror:
    end_steps()
