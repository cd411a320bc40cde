# Report: plots and a table of totals of a finished run, for `snakemake --report`.
from pathlib import Path


# The report's front page (here rather than in the Snakefile, so everything
# the report needs is in this file; the path is relative to this file).
report: "../report/workflow.rst"


# A step of a run of steps: its name on each of its figures.
STEP_LABEL = {"step": RUN.step["name"]} if RUN.step else {}


rule plot_stats:
    input:
        stats=rules.merge_shards.output.stats,
        # the merged output in any output.format; only its token counts are read
        dataset=rules.merge_shards.output.dataset,
    output:
        totals=report(
            RUN_DIR.plots / "totals.html",
            caption="../report/totals.rst",
            category="Summary",
            labels={"figure": "Totals", **STEP_LABEL},
        ),
        throughput=report(
            RUN_DIR.plots / "throughput.svg",
            caption="../report/throughput.rst",
            category="Throughput",
            labels={"figure": "Output tokens/s per shard", **STEP_LABEL},
        ),
        time_per_shard=report(
            RUN_DIR.plots / "time_per_shard.svg",
            caption="../report/time_per_shard.rst",
            category="Throughput",
            labels={"figure": "Where the time went", **STEP_LABEL},
        ),
        ttft=report(
            RUN_DIR.plots / "ttft.svg",
            caption="../report/ttft.rst",
            category="Latency",
            labels={"figure": "Time to first token", **STEP_LABEL},
        ),
        token_lengths=report(
            RUN_DIR.plots / "token_lengths.svg",
            caption="../report/token_lengths.rst",
            category="Tokens",
            labels={"figure": "Prompt and output lengths", **STEP_LABEL},
        ),
    log:
        RUN_DIR.log("plot_stats"),
    localrule: True
    conda:
        "../envs/light.yaml"
    params:
        # the outputs' directory, derived from an output (not a hardcoded prefix)
        out_dir=lambda wildcards, output: Path(output.totals).parent,
    shell:
        "shardgen plots --stats {input.stats:q} --output {input.dataset:q}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"
