"""The shardgen command: reads every value from its config file; errors are one clean line."""

from __future__ import annotations

import json
import os
import signal

import yaml

from shardgen.cli import main
from tests.conftest import base_config


def test_plan_writes_the_manifest_from_a_config_file(parquet_files, tmp_path):
    config = base_config({"parquet": [str(f) for f in parquet_files]})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(dict(config.raw)))
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")]) == 0
    assert len(json.loads((tmp_path / "m.json").read_text())["shards"]) == 4


def test_a_bad_config_is_one_line_naming_the_key_and_exit_status_2(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(
        "input: {parquet: [x.parquet]}\nprompt: {template: hi}\nmodel: {model: m}\nshard: {}\n"
    )
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardgen: error: unknown key 'shard' (did you mean 'shards'?)")
    assert "Traceback" not in err
    assert not (tmp_path / "m.json").exists()


def generate_args(tmp_path, parquet_files) -> list[str]:
    config = base_config({"parquet": [str(f) for f in parquet_files]}, output={"dir": str(tmp_path / "out")})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(dict(config.raw)))
    main(["plan", "--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")])
    files = ["--config", tmp_path / "c.yaml", "--manifest", tmp_path / "m.json", "--shard", "00000"]
    return ["generate", *map(str, files), "--output", str(tmp_path / "s.parquet"), "--stats", str(tmp_path / "s.json")]


def test_the_hugging_face_token_is_gone_before_a_generate_job_runs_model_code(parquet_files, tmp_path, monkeypatch):
    """The Slurm plugin exports the whole environment into every job; only fetch-model and push may use the token."""
    import shardgen.jobs.generate
    from shardgen.jobs.stopflag import Interrupted

    seen = {}

    def run_shard(*args, **kwargs):
        seen.update({k: os.environ.get(k) for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")})
        raise Interrupted(signal.SIGTERM, "00000")

    monkeypatch.setenv("HF_TOKEN", "hf_ShardgenTestSecret0123456789abcdef")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_ShardgenTestSecret0123456789abcdef")
    monkeypatch.setattr(shardgen.jobs.generate, "run_shard", run_shard)
    assert main(generate_args(tmp_path, parquet_files)) == 3, "a stopped job exits non-zero (3)"
    assert seen == {"HF_TOKEN": None, "HUGGING_FACE_HUB_TOKEN": None}


def test_the_token_file_of_hf_auth_login_is_hidden_from_the_commands_that_run_model_code(tmp_path):
    """``hf auth login`` writes $HF_HOME/token, which huggingface_hub reads when no variable is set:
    a job's model code (and vLLM's processes, which inherit the environment) must not find it."""
    import subprocess
    import sys

    (tmp_path / "token").write_text("hf_ShardgenTestSecret0123456789abcdef\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env["HF_HOME"] = str(tmp_path)
    probe = "import huggingface_hub; print(huggingface_hub.get_token())"
    before = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert before.stdout.strip().startswith("hf_Shardgen"), "the probe finds the file when nothing hides it"
    hidden = "from shardgen.base.jobenv import hide_tokens; hide_tokens(); " + probe
    after = subprocess.run([sys.executable, "-c", hidden], env=env, capture_output=True, text=True, check=True)
    assert after.stdout.strip() == "None"


def test_the_generate_command_ends_without_the_interpreters_teardown_its_output_flushed_its_status_kept(tmp_path):
    """``shardgen generate`` ends with ``os._exit`` once ``main`` returns (what vLLM and torch loaded is
    not torn down): what it printed and logged is out, and the exit status is main's. An exit handler
    registered by the job's code (a stand-in for the libraries') does not run; for another command it does."""
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text("shard: {}\n")  # a bad config: main prints its error and returns 2
    probe = (
        "import atexit, sys; from shardgen import cli; "
        "atexit.register(lambda: print('teardown ran', flush=True)); "
        "sys.argv = ['shardgen', *sys.argv[1:]]; cli.run()"
    )
    files = ["--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")]
    generate = [*files, "--shard", "00000", "--output", str(tmp_path / "o"), "--stats", str(tmp_path / "s")]
    for command, args, teardown in (("generate", generate, False), ("plan", files, True)):
        r = subprocess.run([sys.executable, "-c", probe, command, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "shardgen: error: unknown key 'shard'" in r.stderr, (command, r.stderr)
        assert ("teardown ran" in r.stdout) is teardown, (command, r.stdout)


def test_the_engines_spawned_processes_do_not_run_the_shardgen_script_again(tmp_path):
    """vLLM spawns its engine core and workers; multiprocessing's spawn runs the parent's main script in
    each first, and the ``shardgen`` script imports shardgen (0.4 s a process). A generate job names its
    script as shardgen's ``__main__``, which spawn does not run again; unnamed, the child imports it."""
    import subprocess
    import sys

    script = tmp_path / "shardgen"  # as pip writes the console script: the import at the top
    script.write_text(
        "import multiprocessing, sys\n"
        "from shardgen import cli\n"
        "if __name__ == '__main__':\n"
        "    if sys.argv[1] == 'named':\n"
        "        cli._spawn_without_this_script()\n"
        "    child = multiprocessing.get_context('spawn').Process(\n"
        "        target=exec, args=(\"import sys; sys.exit(3 if 'shardgen.cli' in sys.modules else 0)\",))\n"
        "    child.start(); child.join(); sys.exit(child.exitcode)\n"
    )
    for how, imported in (("named", False), ("unnamed", True)):
        r = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)
        assert r.returncode == (3 if imported else 0), (how, r.returncode, r.stderr[-2000:])
