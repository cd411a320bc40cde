# shardgen: dataset -> shards -> one vLLM job per shard -> merged dataset.
# This file only wires; the work is done by the `shardgen` package.
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

from shardgen.features import steps as shardgen_steps
from shardgen import trust
from shardgen import config as shardgen_config
from shardgen.errors import ConfigError
from shardgen.profile import ProfileError, unset_resources_message

min_version("9.0")

# SET_ME placeholders left in a cluster profile (partition, GPU type) stop the
# run here, while the Snakefile is parsed: before any plan, fetch or job.
_unset = unset_resources_message(workflow.resource_settings, sys.argv)
if _unset:
    raise ProfileError(_unset)


# A --configfile on the command line replaces the example config instead of
# being merged into it, so keys of the example never leak into a user's run.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# Paths the config gives relative to its file (function.path) are made absolute; with no
# config file (a module's config), relative to the working directory.
shardgen_config.resolve_paths(
    config,
    Path(workflow.configfiles[-1]).parent if workflow.configfiles else Path.cwd(),
)
# A credential anywhere in the config stops the run before any message could quote it.
trust.check_credentials(config)
try:
    validate(config, "workflow/schemas/config.schema.yaml")
except WorkflowError:
    # The same schema again, for a message that names the key and the fix.
    shardgen_config.validate(config)
    raise
shardgen_config.check_consistency(config)
for warning in shardgen_config.warnings(config):
    logger.warning(f"shardgen: warning: {warning}")
# A run of `steps` is this workflow once per step, each with the step's own config (steps.smk);
# every other config is one run (run.smk).
STEPS = shardgen_steps.step_configs(config) if config.get("steps") else []


if STEPS:

    include: "workflow/rules/steps.smk"

else:

    include: "workflow/rules/run.smk"


# (here: a rule all in an included file would not be the default target)
rule all:
    default_target: True
    input:
        OUTPUTS,
