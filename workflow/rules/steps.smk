# A run of steps (`steps:`): this workflow once per step, as a Snakemake module with the
# step's own config (shardgen.steps.step_configs: its rules are named <step>_<rule>, its
# files are under <output.dir>/steps/<step>/), and the run's output: the last step's rows
# after its select. The run's handlers hold the whole run; the steps' own do not run.
import json
from pathlib import Path

from shardgen import cluster
from shardgen.config import RunConfig
from shardgen.installed import slurm_plugin_problem
from shardgen.io import restrict_umask
from shardgen.rundir import RunDir
from shardgen.runlock import RunLock
from shardgen.runstop import RunStop

restrict_umask(config["output"]["world_readable"])
RUN_DIR = RunDir(config["output"]["dir"])
CONFIG_JSON = shardgen_config.write_resolved(config, RUN_DIR.root)
MERGED = RUN_DIR.merged(config["output"]["format"])
RUN_STOP = None

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


# What the run makes (the Snakefile's rule all): its output, and each step's plots for the report
OUTPUTS = [
    rules.select_output.output,
    *(getattr(rules, f"{c['step']['name']}_plot_stats").output for c in STEPS),
]


def start_steps():
    """onstart: hold output.dir for the run; with Slurm, refuse a step whose generate jobs no node can
    run, and watch the queue."""
    global RUN_LOCK, RUN_STOP, WATCHER
    fingerprint = shardgen_steps.content_digest(STEPS)
    RUN_LOCK = RunLock.acquire(RUN_DIR.root, Path.cwd(), fingerprint)
    RUN_STOP = RunStop(
        workflow,
        Path.cwd(),
        [rule.name for rule in workflow.rules],
        record=RUN_DIR.stopped,
        logger=logger,
    )
    if workflow.executor_plugin is None or workflow.executor_plugin.name != "slurm":
        return
    earlier = cluster.earlier_jobs_warning(RUN_STOP.workdir, RUN_STOP.rules)
    if earlier:
        logger.warning(f"shardgen: warning: {earlier}")
    problem = slurm_plugin_problem()
    if problem:
        logger.warning(f"shardgen: warning: {problem}")
    nodes, default = cluster.sinfo()
    for step in STEPS:
        run = RunConfig.from_dict(step)
        generate = f"{step['step']['name']}_generate_shard"
        request = cluster.generate_request(
            run, workflow.resource_settings, generate, run.resources.runtime
        )
        cluster.check_request(nodes, request, default)
    WATCHER = cluster.PendingWatcher(str(Path.cwd()), stop=RUN_STOP.request).start()


def end_steps():
    if RUN_STOP is not None:
        RUN_STOP.finish()


def print_steps():
    if RUN_DIR.stats.exists():
        print(f"\n{shardgen_steps.summary_text(json.loads(RUN_DIR.stats.read_text()))}")
        print(f"\noutput: {MERGED}\nstats:  {RUN_DIR.stats}")


onstart:
    start_steps()


onsuccess:
    end_steps()
    print_steps()


onerror:
    end_steps()
