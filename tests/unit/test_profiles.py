"""The Slurm profiles: their SET_ME placeholders stop a run before anything happens, with a
message that names each value, the profile file and both ways to set it; the flags the
executor plugin builds from them are ones Slurm accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from snakemake.resources import Resources

from shardgen.profile import (
    ProfileError,
    Unset,
    find_unset,
    is_placeholder,
    placeholder_hint,
    profile_file,
    profiles_in_use,
    raw_value,
    read_profile,
    unset_message,
    unset_placeholders,
    unset_resources_message,
)
from tests.conftest import make_rows, write_parquet

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SLURM = ROOT / "profiles" / "slurm"
GPU_TYPES_PROFILE = ROOT / "profiles" / "slurm-gpu-types"
GPU_TYPES = ("hopper", "h100", "h200", "rtxpro6000")

# What the lead puts at the top of the Snakefile (after min_version); the
# stand-in workflow below runs exactly this text.
SNAKEFILE_SNIPPET = """
import sys

from shardgen.profile import ProfileError, unset_resources_message

# SET_ME placeholders left in a cluster profile (partition, GPU type) stop the
# run here, while the Snakefile is parsed: before any plan, fetch or job.
_unset = unset_resources_message(workflow.resource_settings, sys.argv)
if _unset:
    raise ProfileError(_unset)
"""

STAND_IN_RULES = """
rule all:
    input: "done.txt"

rule generate_shard:
    output: "done.txt"
    resources: gpu=1, tasks_per_gpu=0, nodes=1
    shell: "touch {output}"
"""


def placeholders_in_text(path: Path) -> set[str]:
    """Every quoted "SET_ME:..." value outside comments, as written."""
    found = set()
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        found |= set(re.findall(r'(?<!f)"(SET_ME:[^"]*)"', code))
    return found


def filled(text: str) -> str:
    """The profile with each placeholder set to a value made from its hint (what a user does once)."""
    return re.sub(
        r'(?<!f)"SET_ME:([^"]*)"', lambda m: '"' + re.sub(r"\W+", "_", m.group(1)).strip("_").lower() + '"', text
    )


# -- the profiles as files ----------------------------------------------------------------------


def test_slurm_profile_parses_as_snakemake_reads_it():
    p = read_profile(SLURM)
    assert p["executor"] == "slurm"
    assert p["slurm-status-command"] == "squeue", "without accounting, sacct-based status checks hang the run"
    assert int(p["retries"]) >= 1 and int(p["jobs"]) >= 1
    assert p["default-resources"] == {"slurm_partition": "SET_ME:your-gpu-partition"}
    assert p["set-resources"] == {}


def test_slurm_profile_placeholders_are_exactly_the_values_that_must_be_set():
    p = read_profile(SLURM)
    assert placeholders_in_text(SLURM / "config.yaml") == set(p["default-resources"].values())
    assert unset_placeholders(p["default-resources"]) == ["slurm_partition"]
    # account, QoS, GPU type and constraint are optional: documented, not required
    text = (SLURM / "config.yaml").read_text()
    for optional in ("# slurm_account:", "# qos:", "# gpu_model:", "# constraint:", "slurm_extra:"):
        assert optional in text


@pytest.mark.parametrize("gpu_type", GPU_TYPES)
def test_gpu_types_profile_chooses_partition_and_type_by_SHARDGEN_GPU(monkeypatch, gpu_type):
    monkeypatch.setenv("SHARDGEN_GPU", gpu_type)
    p = read_profile(GPU_TYPES_PROFILE)
    assert p["executor"] == "slurm" and p["slurm-status-command"] == "squeue"
    res = p["set-resources"]["generate_shard"]
    assert is_placeholder(res["slurm_partition"])
    assert ("gpu_model" in res) == (gpu_type != "hopper"), "hopper takes any GPU of its partition"
    if gpu_type == "rtxpro6000":
        assert "RTX-PRO-6000" in res["slurm_partition"]
    else:
        assert "H100-H200" in res["slurm_partition"]


def test_gpu_types_profile_defaults_to_hopper(monkeypatch):
    monkeypatch.delenv("SHARDGEN_GPU", raising=False)
    default = read_profile(GPU_TYPES_PROFILE)["set-resources"]
    monkeypatch.setenv("SHARDGEN_GPU", "")
    assert read_profile(GPU_TYPES_PROFILE)["set-resources"] == default
    monkeypatch.setenv("SHARDGEN_GPU", "hopper")
    assert read_profile(GPU_TYPES_PROFILE)["set-resources"] == default


def test_gpu_types_profile_refuses_an_unknown_type_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv("SHARDGEN_GPU", "a100")
    res = read_profile(GPU_TYPES_PROFILE)["set-resources"]["generate_shard"]
    (unset,) = find_unset({}, {"generate_shard": res})
    assert unset.hint.startswith("SHARDGEN_GPU=a100 is not in GPU_TYPES")
    assert all(t in unset.hint for t in GPU_TYPES)


def test_every_placeholder_of_the_gpu_types_profile_is_detected_for_some_type(monkeypatch):
    seen = set()
    for gpu_type in GPU_TYPES:
        monkeypatch.setenv("SHARDGEN_GPU", gpu_type)
        res = read_profile(GPU_TYPES_PROFILE)["set-resources"]
        unset = find_unset({}, res)
        assert unset, gpu_type
        seen |= {raw_value(res[u.rule][u.name]) for u in unset}
    assert seen == placeholders_in_text(GPU_TYPES_PROFILE / "config.yaml")


@pytest.mark.parametrize("profile", [SLURM, GPU_TYPES_PROFILE])
def test_every_placeholder_names_its_key_and_profile_in_the_message(monkeypatch, profile):
    monkeypatch.setenv("SHARDGEN_GPU", "h200")
    p = read_profile(profile)
    unset = find_unset(p["default-resources"], p["set-resources"])
    message = unset_message(unset, [str(profile)])
    assert str(profile / "config.yaml") in message
    for u in unset:
        assert f"  - {u.key} (" in message and u.hint in message


def test_filling_the_placeholders_leaves_none(monkeypatch, tmp_path):
    for gpu_type in GPU_TYPES:
        monkeypatch.setenv("SHARDGEN_GPU", gpu_type)
        for profile in (SLURM, GPU_TYPES_PROFILE):
            (tmp_path / "config.yaml").write_text(filled((profile / "config.yaml").read_text()))
            p = read_profile(tmp_path)
            assert find_unset(p["default-resources"], p["set-resources"]) == []


# -- profile.py --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("SET_ME:your-gpu-partition", True),
        ("SET_ME", True),
        ("'SET_ME:quoted twice'", True),
        ('"SET_ME:x"', True),
        ("  SET_ME:x  ", True),
        ("SET_MEX", False),
        ("gpu", False),
        ("set_me:x", False),
        ("my-SET_ME:x", False),
        (8000, False),
        (None, False),
        (SimpleNamespace(raw="SET_ME:x"), True),
        (SimpleNamespace(raw="gpu"), False),
    ],
)
def test_is_placeholder(value, expected):
    assert is_placeholder(value) is expected


def test_placeholder_hint_is_the_text_after_SET_ME():
    assert placeholder_hint("SET_ME: your-gpu-partition ") == "your-gpu-partition"
    assert placeholder_hint("SET_ME") == ""
    assert placeholder_hint("gpu") == ""


def test_unset_placeholders_reads_snakemakes_own_parsed_resources():
    resources = Resources.parse(
        ["slurm_partition=SET_ME:your-gpu-partition", "mem_mb=8000", "qos='SET_ME:a-qos'", "slurm_account=proj"],
        allow_expressions=True,
        defaults="full",
    )
    assert unset_placeholders(resources) == ["slurm_partition", "qos"]
    assert unset_placeholders(None) == [] and unset_placeholders({}) == []


def test_find_unset_covers_default_and_per_rule_resources_in_order():
    found = find_unset(
        {"slurm_partition": "SET_ME:p", "mem_mb": 1},
        {"generate_shard": {"gpu_model": "SET_ME:t", "constraint": "h100"}, "other": {}},
    )
    assert found == [Unset("slurm_partition", "p"), Unset("gpu_model", "t", "generate_shard")]
    assert [u.key for u in found] == ["slurm_partition", "generate_shard:gpu_model"]


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["snakemake", "--profile", "profiles/slurm", "-n"], {}, ["profiles/slurm"]),
        (["snakemake", "--profile=profiles/slurm"], {}, ["profiles/slurm"]),
        (["snakemake", "--profile", "a", "--profile", "b"], {}, ["a", "b"]),
        (["snakemake", "--workflow-profile", "w"], {"SNAKEMAKE_PROFILE": "env"}, ["env", "w"]),
        (["snakemake", "-n"], {"SNAKEMAKE_PROFILE": "env"}, ["env"]),
        (["snakemake", "--profile", "p"], {"SNAKEMAKE_PROFILE": "env"}, ["p"]),
        (["snakemake", "--profile", "none"], {"SNAKEMAKE_PROFILE": "env"}, []),
        (["snakemake", "--profile"], {}, []),
        ([], {}, []),
    ],
)
def test_profiles_in_use_reads_the_command_line_like_snakemake(argv, environ, expected):
    assert profiles_in_use(argv, environ) == expected


def test_profile_file_of_a_directory_a_file_and_a_name(tmp_path):
    assert profile_file(SLURM) == str(SLURM / "config.yaml")
    (tmp_path / "profile.yaml").write_text("jobs: 1\n")
    (tmp_path / "config.yaml").write_text("jobs: 1\n")
    assert profile_file(tmp_path) == str(tmp_path / "profile.yaml"), "profile.yaml comes first, as in Snakemake"
    assert profile_file(tmp_path / "config.yaml") == str(tmp_path / "config.yaml")
    assert profile_file("my-cluster") == "my-cluster"


def test_message_names_each_value_the_file_and_both_ways_to_set_it():
    message = unset_message([Unset("slurm_partition", "your-gpu-partition")], [str(SLURM)])
    assert message.startswith(
        f"the profile leaves 1 cluster value(s) unset: SET_ME placeholders in {SLURM / 'config.yaml'}."
    )
    assert "Nothing was run or submitted." in message
    assert "  - slurm_partition (default-resources): your-gpu-partition (" in message
    assert "sinfo -o '%P %G %l'" in message
    assert f"1. edit {SLURM / 'config.yaml'}: replace each SET_ME value (e.g. slurm_partition: gpu)" in message
    assert "--default-resources slurm_partition=gpu slurm_account=myproj" in message
    assert "replaces the profile's whole default-resources list" in message
    assert "--set-resources" not in message


def test_message_for_per_rule_values_shows_set_resources():
    message = unset_message(
        [Unset("slurm_partition", "p", "generate_shard"), Unset("gpu_model", "t", "generate_shard")],
        [str(GPU_TYPES_PROFILE)],
    )
    assert "  - generate_shard:gpu_model (set-resources of rule generate_shard): t" in message
    assert "--set-resources generate_shard:slurm_partition=gpu generate_shard:gpu_model=h100" in message
    assert "--default-resources" not in message


def test_message_names_only_the_profile_that_holds_the_placeholder(tmp_path):
    (tmp_path / "config.yaml").write_text("jobs: 1\n")
    message = unset_message([Unset("slurm_partition", "p")], [str(tmp_path), str(SLURM)])
    assert str(SLURM / "config.yaml") in message and str(tmp_path) not in message
    without = unset_message([Unset("slurm_partition", "p")], [])
    assert "your Snakemake profile (the file given with --profile)" in without


def test_unset_resources_message_reads_snakemakes_resource_settings():
    settings = SimpleNamespace(
        default_resources=Resources.parse(["slurm_partition=SET_ME:x"], allow_expressions=True, defaults="full"),
        overwrite_resources={},
    )
    message = unset_resources_message(settings, ["snakemake", "--profile", str(SLURM)], {})
    assert "slurm_partition" in message and str(SLURM / "config.yaml") in message
    # the command line's --default-resources replaced the profile's list: nothing left to set
    settings.default_resources = Resources.parse(["slurm_partition=gpu"], allow_expressions=True, defaults="full")
    assert unset_resources_message(settings, ["snakemake", "--profile", str(SLURM)], {}) is None
    # no profile, no default resources at all (a local run)
    assert unset_resources_message(SimpleNamespace(default_resources=None, overwrite_resources={})) is None


def test_read_profile_refuses_resources_it_cannot_read(tmp_path):
    (tmp_path / "config.yaml").write_text("set-resources:\n  generate_shard:\n    gpu_model: h100\n")
    assert read_profile(tmp_path)["set-resources"] == {"generate_shard": {"gpu_model": "h100"}}
    (tmp_path / "config.yaml").write_text("default-resources: ['rule:mem_mb=1']\n")
    with pytest.raises(ProfileError, match="default-resources: cannot read 'rule:mem_mb=1'"):
        read_profile(tmp_path)


# -- what the executor plugin makes of the profiles --------------------------------------------


class _Resources(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


def sbatch_flags(profile_resources: dict, gpus: int = 1, nodes: int = 1, extra: str = "--signal=TERM@180") -> str:
    """The sbatch command the Slurm plugin (2.6.x) builds for a generate job, without submitting it.

    The generate rule's resources as workflow/rules/generate.smk declares them
    (config/config.yaml's values), then the profile's on top.
    """
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    resources = _Resources(
        gpu=gpus, tasks_per_gpu=0, nodes=nodes, cpus_per_task=2, mem_mb=8000, runtime=30, slurm_extra=extra
    )
    partition = raw_value(profile_resources.pop("slurm_partition", None))
    resources.update({k: raw_value(v) for k, v in profile_resources.items()})
    job = SimpleNamespace(resources=resources, threads=2, name="generate_shard")
    validate_slurm_extra(job)
    params = {
        "run_uuid": "shardgen-test",
        "slurm_logfile": "/dev/null",
        "comment_str": "rule_generate_shard_wildcards_00000",
        "account": "",
        "partition": f" -p {partition}" if partition else "",
        "workdir": None,
    }
    return get_submit_command(job, params) + set_gres_string(job)


def test_generate_rule_declares_the_resources_the_flags_test_assumes():
    text = (ROOT / "workflow" / "rules" / "generate.smk").read_text()
    for declared in ("gpu=GPUS", "tasks_per_gpu=0", "nodes=RUN.resources.nodes", "cpus_per_task=", "mem_mb=",
                     "runtime=", "slurm_extra=slurm_extra"):  # fmt: skip
        assert declared in text


def test_a_job_over_two_nodes_gets_the_total_gpus_the_same_on_each_node_and_one_task_per_node():
    """What common.smk's slurm_extra adds for resources.nodes > 1, through the plugin's own checks."""
    from shardgen import cluster
    from tests.conftest import base_config

    run = base_config({"parquet": ["x.parquet"]}, model={"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
                      resources={"nodes": 2})  # fmt: skip
    extra = " ".join(["--signal=TERM@180", *cluster.multinode_options(run, "h100")])
    call = sbatch_flags({"slurm_partition": "gpu", "gpu_model": "h100"}, gpus=run.model.gpus, nodes=2, extra=extra)
    assert " --nodes=2" in call and " --gpus=h100:16" in call
    assert "--gpus-per-node=h100:8 --ntasks-per-node=1" in call


def test_slurm_profile_gives_one_process_all_gpus_of_one_node_in_the_partition():
    call = sbatch_flags({"slurm_partition": "debug"}, gpus=2)
    assert " -p debug" in call and " --gpus=2" in call and " --nodes=1" in call
    assert " --cpus-per-task=2" in call and " --mem 8000" in call and " -t 30" in call
    assert "--ntasks-per-gpu" not in call, "tasks_per_gpu=0: one process sees every GPU of the job"
    assert "--signal=TERM@180" in call


def test_gpu_model_and_constraint_become_typed_gpus_and_a_feature_request():
    call = sbatch_flags({"slurm_partition": "gpu", "gpu_model": "h100", "constraint": "h100|h200", "qos": "'high'"}, 4)
    assert " --gpus=h100:4" in call and " --gpus=4" not in call
    assert " -C 'h100|h200'" in call and " --qos=high" in call


@pytest.mark.parametrize("gpu_type", GPU_TYPES)
def test_gpu_types_profile_filled_in_gives_valid_sbatch_flags(monkeypatch, tmp_path, gpu_type):
    monkeypatch.setenv("SHARDGEN_GPU", gpu_type)
    (tmp_path / "config.yaml").write_text(filled((GPU_TYPES_PROFILE / "config.yaml").read_text()))
    res = read_profile(tmp_path)["set-resources"]["generate_shard"]
    call = sbatch_flags(dict(res))
    assert f" -p {res['slurm_partition']}" in call
    if "gpu_model" in res:
        assert f" --gpus={res['gpu_model']}:1" in call


def test_slurm_extra_example_of_the_profile_passes_the_plugins_check():
    text = (SLURM / "config.yaml").read_text()
    (example,) = re.findall(r"#\s+slurm_extra: (.+)", text)
    call = sbatch_flags({"slurm_partition": "debug", "slurm_extra": example.strip().strip('"')})
    assert "--signal=TERM@300" in call


@pytest.mark.slurm
def test_local_slurm_accepts_the_flags_of_the_slurm_profile_without_submitting(tmp_path, slurm_cluster):
    call = sbatch_flags({"slurm_partition": "debug"}, gpus=2)
    assert call.startswith("sbatch ")
    cmd = "sbatch --test-only" + call[len("sbatch") :] + " --wrap true"
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr
    typed = "sbatch --test-only" + sbatch_flags({"slurm_partition": "debug", "gpu_model": "h100"})[6:] + " --wrap true"
    r = subprocess.run(typed, shell=True, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "node configuration is not available" in r.stderr, "no h100 GPUs here: refused"


# -- the check in a workflow: a stand-in Snakefile, then the real one --------------------------


def snakemake(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **(env or {}))
    return subprocess.run(
        [str(BIN / "snakemake"), *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def stand_in(tmp_path) -> Path:
    (tmp_path / "Snakefile").write_text(SNAKEFILE_SNIPPET + STAND_IN_RULES)
    return tmp_path


def test_snippet_stops_a_dry_run_with_the_slurm_profile_before_anything_runs(stand_in):
    r = snakemake(stand_in, "--profile", str(SLURM), "-n")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "ProfileError" in out and "slurm_partition (default-resources): your-gpu-partition" in out
    assert str(SLURM / "config.yaml") in out
    assert "Building DAG of jobs" not in out and "rule generate_shard" not in out


def test_snippet_passes_a_dry_run_when_the_command_line_sets_the_partition(stand_in):
    r = snakemake(stand_in, "--profile", str(SLURM), "--default-resources", "slurm_partition=debug", "-n")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "slurm_partition=debug" in out and "This was a dry-run" in out


def test_snippet_does_nothing_without_a_profile(stand_in):
    r = snakemake(stand_in, "--cores", "1", "-n")
    assert r.returncode == 0, r.stderr


def test_snippet_names_the_gpu_types_profile_and_the_chosen_types_values(stand_in):
    r = snakemake(stand_in, "--profile", str(GPU_TYPES_PROFILE), "-n", env={"SHARDGEN_GPU": "rtxpro6000"})
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "generate_shard:slurm_partition (set-resources of rule generate_shard): your-RTX-PRO-6000" in out
    assert "generate_shard:gpu_model" in out and str(GPU_TYPES_PROFILE / "config.yaml") in out


@pytest.mark.parametrize("gpu_type", ["h200", "rtxpro6000"])
def test_filled_in_gpu_types_profile_sends_the_chosen_type_to_the_generate_jobs(stand_in, gpu_type):
    profile = stand_in / "profiles" / "slurm-gpu-types"
    profile.mkdir(parents=True)
    (profile / "config.yaml").write_text(filled((GPU_TYPES_PROFILE / "config.yaml").read_text()))
    r = snakemake(stand_in, "--profile", str(profile), "-n", env={"SHARDGEN_GPU": gpu_type})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    part = "your_rtx_pro_6000_partition" if gpu_type == "rtxpro6000" else "your_h100_h200_partition"
    model = "slurm_type_name_of_rtx_pro_6000" if gpu_type == "rtxpro6000" else "slurm_type_name_of_h200"
    assert f"slurm_partition={part}" in out and f"gpu_model={model}" in out


def demo_workdir(tmp_path: Path) -> Path:
    """A working directory like the checkout's after `make setup`: demo-like data, the demo model."""
    rows = make_rows(40)
    styles = ["one sentence", "a short haiku"]
    for i, r in enumerate(rows):
        r["style"] = styles[i % 2]
    write_parquet(tmp_path / "data" / "demo" / "part-0.parquet", rows[:20])
    write_parquet(tmp_path / "data" / "demo" / "part-1.parquet", rows[20:])
    (tmp_path / "models").symlink_to(ROOT / "models", target_is_directory=True)
    return tmp_path


def job_counts(output: str) -> dict[str, int]:
    """The "Job stats" table of a dry run: how many jobs of each rule it would run."""
    table = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {}
    for line in table.splitlines()[3:]:
        name, _, count = line.partition(" ")
        if count.strip().isdigit() and name != "total":
            counts[name] = int(count)
    return counts


def real_workflow(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return snakemake(
        workdir,
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        "--profile",
        str(SLURM),
        "--configfile",
        str(ROOT / "config" / "config.yaml"),
        "-n",
        *args,
    )


def test_real_workflow_dry_run_with_the_unedited_slurm_profile_stops_with_the_message(tmp_path):
    """Needs the Snakefile check (SNAKEFILE_SNIPPET) at the top of the Snakefile."""
    workdir = demo_workdir(tmp_path)
    r = real_workflow(workdir)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "slurm_partition (default-resources): your-gpu-partition" in out, out[-3000:]
    assert "--default-resources slurm_partition=gpu" in out
    assert not (workdir / "results").exists(), "stopped before the workflow wrote anything"


def test_real_workflow_dry_run_passes_with_the_partition_on_the_command_line(tmp_path):
    workdir = demo_workdir(tmp_path)
    r = real_workflow(workdir, "--default-resources", "slurm_partition=debug")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "This was a dry-run" in out
    # the fetch is in the DAG before the plan (a checkpoint) is made: it runs beside the planning
    assert job_counts(out) == {"plan_shards": 1, "fetch_model": 1, "merge_shards": 1, "plot_stats": 1, "all": 1}
    assert "slurm_partition=debug" in out


def test_every_value_a_rule_puts_on_a_command_line_is_quoted():
    """Rules pass only paths and ids, and each goes through Snakemake's :q (or shlex.quote in the
    input function that builds it), so no value can become shell syntax."""
    rules = (ROOT / "workflow" / "rules").glob("*.smk")
    unquoted = []
    for path in rules:
        for field in re.findall(r"\{((?:params|input|output|log)[^}]*)\}", path.read_text()):
            if not field.endswith(":q") and field != "params.job":  # generate_args quotes its own
                unquoted.append(f"{path.name}: {{{field}}}")
    assert unquoted == []
