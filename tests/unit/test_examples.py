"""config/examples/: the configs a researcher copies for a GPU cluster are valid, ask Slurm for what
they say, and carry none of the CPU demo's settings."""

from __future__ import annotations

import pytest

from shardgen import cluster
from shardgen.config import RunConfig
from shardgen.features import steps
from shardgen.jobs.preflight import cpu_demo_settings
from tests.conftest import ROOT

EXAMPLES = ROOT / "config" / "examples"
# example -> (task, GPUs per node, nodes); a run of steps: a list, each step's in order
EXPECTED = {
    "label-choice-8b-fp8": ("generate", 1, 1),
    "synthetic-samples": ("generate", 1, 1),
    "json-extraction": ("generate", 1, 1),
    "classify": ("classify", 1, 1),
    "embed": ("embed", 1, 1),
    "tp-70b": ("generate", 4, 1),
    "two-node": ("generate", 8, 2),
    "rejection-sampling": [("generate", 1, 1), ("function", 0, 1)],
    "tool-rollout": [("generate", 1, 1), ("function", 0, 1)],
}


def test_every_example_is_listed_here():
    assert sorted(p.stem for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_example_is_valid_asks_slurm_for_its_gpus_and_has_no_cpu_demo_setting(name):
    """A run of steps: each step's jobs (a Python step's: CPUs only, its function's file found next to
    the example, as RunConfig.load resolves function.path against the config file's directory)."""
    config = RunConfig.load(EXAMPLES / f"{name}.yaml")
    runs = [RunConfig.from_dict(c) for c in steps.step_configs(config.raw)] if config.raw.get("steps") else [config]
    expected = EXPECTED[name] if isinstance(EXPECTED[name], list) else [EXPECTED[name]]
    asked = []
    for run in runs:
        request = cluster.generate_request(run, None, "generate_shard", run.resources.runtime)
        asked.append((run.task, request.gpus, request.nodes))
        if run.kind.uses_engine:
            assert cpu_demo_settings(run.model, "cuda") == []
    assert asked == expected


def test_the_cpu_demos_settings_on_a_gpu_are_a_warning_naming_each_and_the_examples():
    demo = RunConfig.load(ROOT / "config" / "config.yaml")
    assert cpu_demo_settings(demo.model, "cpu") == []
    warned = "\n".join(cpu_demo_settings(demo.model, "cuda"))
    for key in ("model.dtype: float32", "model.enforce_eager", "model.kv_cache_memory_bytes: 1073741824"):
        assert key in warned
    assert "config/examples/" in warned
    assert (ROOT / "config" / "config.yaml").read_text().startswith("# The CPU demo's config")


def test_the_two_node_example_in_a_container_is_refused_while_the_snakefile_is_parsed(tmp_path):
    """srun, scontrol and munge are not in the vLLM image: a model across nodes in the container is
    refused before anything runs; on one node, or outside the container, the same config plans."""
    import subprocess

    import yaml

    from tests.integration.workflow import snakemake_command

    config = yaml.safe_load((EXAMPLES / "two-node.yaml").read_text())
    config["software"] = {"container": "/images/shardgen-vllm.sif"}
    configfile = tmp_path / "run.yaml"

    def dry_run(config: dict, *options: str) -> subprocess.CompletedProcess:
        configfile.write_text(yaml.safe_dump(config))
        cmd, env = snakemake_command(tmp_path, configfile, "-n", "--cores", "1", *options)
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    refused = dry_run(config, "--software-deployment-method", "apptainer")
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "has no Slurm client (srun, scontrol)" in said, said
    assert "Building DAG" not in said
    assert dry_run(config).returncode == 0, "without apptainer the container is not used"
    one_node = {**config, "resources": {**config["resources"], "nodes": 1}}
    assert dry_run(one_node, "--software-deployment-method", "apptainer").returncode == 0


def test_the_gpu_smoke_script_runs_each_example_that_fits_one_gpu_on_an_input_it_can_plan(tmp_path):
    import subprocess
    import sys

    from shardgen.data.plan import build_manifest

    script = [sys.executable, str(ROOT / "bench" / "gpu_smoke_examples.py")]
    listed = subprocess.run([*script, "list"], capture_output=True, text=True, check=True).stdout.split()
    one_gpu = [n for n, e in EXPECTED.items() if isinstance(e, tuple) and e[1:] == (1, 1)]  # no run of steps
    assert listed == sorted(one_gpu)
    assert "gpu_smoke_examples.py list" in (ROOT / "bench" / "gpu_smoke.sh").read_text()
    for name in listed:
        subprocess.run([*script, "prepare", name, str(tmp_path / name), "12"], check=True)
        config = RunConfig.load(tmp_path / name / "config.yaml")
        original = RunConfig.load(EXAMPLES / f"{name}.yaml")
        assert (config.task, config.prompt, config.sampling) == (original.task, original.prompt, original.sampling)
        manifest = build_manifest(config)
        assert manifest["total_rows"] == 12 and len(manifest["shards"]) == 4, name
