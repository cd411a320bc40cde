"""Bad input is caught before any GPU job: the preflight (real tokenizer, real files) and,
through the real Slurm profile, nothing is submitted when a check fails."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen.cli import main
from shardgen.data.plan import write_manifest
from tests.conftest import base_config, changed, make_rows, write_parquet
from tests.integration.workflow import run_bounded, run_workflow, slurm_jobs, workflow_config


def preflight(tmp_path, capsys, rows=None, id_column=None, sampling_column=None, **overrides) -> tuple[int, str]:
    """Plan ``rows`` and run ``shardgen preflight``; return its exit status and stderr."""
    data = write_parquet(tmp_path / "in.parquet", rows if rows is not None else make_rows(40))
    inputs = {"parquet": [str(data)], "id_column": id_column, "sampling_column": sampling_column}
    config = base_config(inputs, **overrides)
    (tmp_path / "c.json").write_text(json.dumps(config.raw))
    write_manifest(config, tmp_path / "m.json")
    capsys.readouterr()
    rc = main(["preflight", "--config", str(tmp_path / "c.json"), "--manifest", str(tmp_path / "m.json"),
               "--report", str(tmp_path / "report.json")])  # fmt: skip
    return rc, capsys.readouterr().err


def test_a_good_run_passes_and_reports_an_estimate(tmp_path, capsys, model_dir):
    rc, _ = preflight(tmp_path, capsys)
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["sampled_rows"] == 40 and report["vllm_build"] == "cpu"
    est = report["estimate"]
    assert est["rows"] == 40 and est["shards"] == 5 and est["output_tokens_at_most"] == 40 * 12
    assert est["mean_prompt_tokens_sampled"] > 5 and est["gpu_hours_at_most"] > 0


def _with_ids(tmp_path, capsys, ids):
    rows = make_rows(len(ids))
    for r, i in zip(rows, ids, strict=True):
        r["id"] = i
    return preflight(tmp_path, capsys, rows, id_column="id")


def test_duplicate_ids_are_named(tmp_path, capsys, model_dir):
    rc, err = _with_ids(tmp_path, capsys, ["a", "b", "c", "b", "e"])
    assert rc == 2
    assert "input.id_column: 'id' is not unique: 1 value(s) appear more than once ('b' ×2)" in err
    assert not (tmp_path / "report.json").exists()


def test_null_ids_are_named_with_the_first_row(tmp_path, capsys, model_dir):
    rc, err = _with_ids(tmp_path, capsys, ["a", "b", None, "d", None])
    assert rc == 2 and "input.id_column: 'id' has 2 null value(s), the first at row 2" in err


def test_every_problem_is_listed_at_once(tmp_path, capsys, model_dir):
    rows = make_rows(40)
    rows[7]["id"] = rows[3]["id"]
    rc, err = preflight(tmp_path, capsys, rows, id_column="id", model={"quantization": "fp8", "max_model_len": 10**6})
    assert rc == 2 and "preflight found 4 problem(s); no generate job was submitted" in err
    assert "input.id_column: 'id' is not unique" in err
    assert "model.quantization: 'fp8' needs a CUDA GPU" in err
    assert "model.quantization: 'fp8' no longer quantizes a BF16/FP16 checkpoint at load in vLLM 0.32.0" in err
    assert "model.max_model_len: 1000000 is more than the model's own context" in err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("quantization", "fp8_per_chanel", "model.quantization: 'fp8_per_chanel' is not one of vLLM 0.32.0's "
         "(did you mean 'fp8_per_channel'?)"),
        ("kv_cache_dtype", "fp8_e4m4", "model.kv_cache_dtype: 'fp8_e4m4' is not one of vLLM 0.32.0's"),
    ],
)  # fmt: skip
def test_a_quantization_or_kv_cache_dtype_the_installed_vllm_does_not_know_is_refused(
    tmp_path, capsys, model_dir, key, value, message
):
    rc, err = preflight(tmp_path, capsys, model={key: value})
    assert rc == 2 and message in err


def test_the_estimate_counts_every_sample_of_a_row(tmp_path, capsys, model_dir):
    rc, _ = preflight(tmp_path, capsys, sampling={"temperature": 0.8, "max_tokens": 12, "n": 3})
    assert rc == 0
    assert json.loads((tmp_path / "report.json").read_text())["estimate"]["output_tokens_at_most"] == 40 * 12 * 3


def test_the_estimate_takes_each_rows_own_max_tokens_and_n_from_its_sampling_column(tmp_path, capsys, model_dir):
    rows = make_rows(40)
    for i, r in enumerate(rows):  # half the rows ask for 4 samples of 20 tokens, half keep the run's 1 of 12
        r["sampling"] = json.dumps({"max_tokens": 20, "n": 4}) if i % 2 else None
    rc, err = preflight(tmp_path, capsys, rows, sampling_column="sampling", output={"samples": "list"},
                        sampling={"temperature": 0.8, "max_tokens": 12})  # fmt: skip
    assert rc == 0, err
    estimate = json.loads((tmp_path / "report.json").read_text())["estimate"]
    assert estimate["output_tokens_at_most"] == 20 * 12 + 20 * 20 * 4 and "own max_tokens and n" in str(estimate)


def test_the_sampled_rows_are_made_requests_as_a_job_makes_them(tmp_path, capsys, model_dir):
    """The preflight makes its sample's requests with a job's own path (``feed.prepared_requests`` and
    the run's task): a row asking for its own log-probabilities in a run whose labels take them is that
    row's error in a job, and so in the sample."""
    rows = make_rows(40)
    for i, r in enumerate(rows):
        r["sampling"] = json.dumps({"logprobs": 2}) if i == 3 else None
    choice = {"temperature": 0.0, "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}
    rc, err = preflight(tmp_path, capsys, rows, sampling_column="sampling", output={"choice_probs": True},
                        sampling=choice)  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["sampled_errors"] == {"invalid_sampling": 1}, err
    assert any("row 3: invalid_sampling: sampling.logprobs: output.choice_probs" in w for w in report["warnings"])


def test_fp8_weights_on_the_cpu_build_are_refused_before_any_job(tmp_path, capsys, model_dir):
    rc, err = preflight(tmp_path, capsys, model={"quantization": "fp8"})
    assert rc == 2 and "model.quantization: 'fp8' needs a CUDA GPU" in err and "CPU build" in err


def test_a_sandbox_escape_in_the_template_is_refused(tmp_path, capsys, model_dir):
    rc, err = preflight(tmp_path, capsys, prompt={"template": "{{ topic.__class__.__mro__[1].__subclasses__() }}"})
    assert rc == 2 and "prompt.template: the sandbox refused an unsafe operation" in err


def test_a_template_failing_on_most_rows_fails_before_any_job(tmp_path, capsys, model_dir):
    rows = make_rows(40)
    for r in rows[::2]:
        r["topic"] = None
    rc, err = preflight(tmp_path, capsys, rows)
    assert rc == 2
    assert "prompt: 20 of 40 sampled rows would be errors, more than errors.max_rate (0.1)" in err
    assert "null_value 20 (first: row 0: null_value: column 'topic' is null)" in err


def test_images_that_do_not_decode_in_most_sampled_rows_fail_before_any_job(tmp_path, capsys, model_dir):
    import io

    from PIL import Image

    from tests.conftest import ROOT

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    rows = [{**r, "photo": buf.getvalue() if i % 5 == 0 else b"junk"} for i, r in enumerate(make_rows(20))]
    rc, err = preflight(tmp_path, capsys, rows, prompt={"template": "Describe {{ topic }}.", "images": ["photo"]},
                        model={"model": str(ROOT / "models" / "vlm")})  # fmt: skip
    assert rc == 2 and "16 of 20 sampled rows would be errors" in err
    assert "bad_image 16 (first: row 1: bad_image: column 'photo': 4 bytes is not an image" in err


def test_a_few_overlong_prompts_are_a_warning_with_their_count(tmp_path, capsys, model_dir):
    rows = make_rows(40)
    rows[5]["topic"] = "long " * 1200  # beyond max_model_len 1024
    rc, _ = preflight(tmp_path, capsys, rows)
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["sampled_errors"] == {"prompt_too_long": 1}
    assert any("1 of 40 sampled rows will be per-row errors" in w for w in report["warnings"])


def test_a_context_longer_than_the_models_own_is_refused(tmp_path, capsys, model_dir):
    rc, err = preflight(tmp_path, capsys, model={"max_model_len": 10**6})
    assert rc == 2 and "model.max_model_len: 1000000 is more than the model's own context" in err


def test_a_missing_model_directory_is_named(tmp_path, capsys, model_dir):
    rc, err = preflight(tmp_path, capsys, model={"model": str(tmp_path / "no-model")})
    assert rc == 2 and f"model.model: no such directory: '{tmp_path / 'no-model'}'" in err


def test_an_empty_dataset_is_an_error_unless_allowed(tmp_path, capsys):
    empty = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "topic": pa.array([], pa.string())}), empty)
    config = base_config({"parquet": [str(empty)]})
    (tmp_path / "c.json").write_text(json.dumps(config.raw))
    args = ["plan", "--config", str(tmp_path / "c.json"), "--manifest", str(tmp_path / "m.json")]
    assert main(args) == 2
    assert "has no rows; nothing to generate. Set input.allow_empty: true" in capsys.readouterr().err
    config = changed(config, "input", allow_empty=True)
    (tmp_path / "c.json").write_text(json.dumps(config.raw))
    assert main(args) == 0
    out, stats = tmp_path / "out.parquet", tmp_path / "stats.json"
    assert main(["merge", "--config", str(tmp_path / "c.json"), "--manifest", str(tmp_path / "m.json"),
                 "--output", str(out), "--stats", str(stats)]) == 0  # fmt: skip
    table = pq.read_table(out)
    assert table.num_rows == 0 and {"id", "topic", "generation", "error"} <= set(table.column_names)
    assert "the input has no rows" in capsys.readouterr().out


def run_without_read_override(workdir, args) -> tuple[int, str]:
    """``shardgen ARGS`` as root without the capabilities that let root read any file."""
    import shutil
    import sys

    if not shutil.which("setpriv"):
        pytest.fail("running as root without setpriv: cannot test an unreadable file")
    drop = "-dac_override,-dac_read_search"
    cmd = ["setpriv", "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-m", "shardgen.cli", *args]
    r = run_bounded(cmd, 120, cwd=workdir)
    return r.returncode, r.stderr


@pytest.mark.parametrize(
    "kind", ["truncated", "not_parquet", "unreadable", "missing"], ids=lambda k: f"{k}_file_is_named"
)
def test_a_bad_input_file_is_named_at_planning(tmp_path, capsys, kind):
    good = write_parquet(tmp_path / "good.parquet", make_rows(5))
    bad = tmp_path / "bad.parquet"
    if kind == "truncated":
        bad.write_bytes(good.read_bytes()[:-20])
    elif kind == "not_parquet":
        bad.write_text("id,topic\n1,tea\n")
    elif kind == "unreadable":
        bad.write_bytes(good.read_bytes())
        bad.chmod(0)
    config = base_config({"parquet": [str(good), str(bad)]})
    (tmp_path / "c.json").write_text(json.dumps(config.raw))
    args = ["plan", "--config", str(tmp_path / "c.json"), "--manifest", str(tmp_path / "m.json")]
    if kind == "unreadable" and os.geteuid() == 0:
        # root reads any file: plan without the capabilities that allow it
        rc, err = run_without_read_override(tmp_path, args)
        assert rc == 2
    else:
        assert main(args) == 2
        err = capsys.readouterr().err
    assert str(bad) in err
    expected = {
        "truncated": "is not a valid Parquet file",
        "not_parquet": "is not a valid Parquet file",
        "unreadable": "permission denied",
        "missing": "no such file",
    }[kind]
    assert expected in err


# Through the real Slurm profile: a mistake stops the run before anything is submitted.
SLURM_CASES = {
    "unknown_key": ({"sampling": {"max_tokns": 8}}, "unknown key 'sampling.max_tokns' (did you mean 'max_tokens'?)"),
    "wrong_type": ({"shards": {"rows_per_shard": "ten"}}, "shards.rows_per_shard: 'ten' is not of type 'integer'"),
    "contradiction": ({"sampling": {"max_tokens": 2000}}, "sampling.max_tokens (2000) must be smaller than"),
    "path_traversal": ({"output": {"dir": "../escape"}}, "output.dir: '../escape' leads outside the working directory"),
    "template_syntax": ({"prompt": {"template": "{{ topic "}}, "prompt.template: syntax error on line 1"),
    "missing_column": ({"prompt": {"template": "{{ title }}"}}, "prompt.template uses the column 'title'"),
    "missing_file": ({"input": {"parquet": ["nowhere/*.parquet"]}}, "the pattern 'nowhere/*.parquet' matches no file"),
    # two the preflight finds (one run of it: the slow part of a case), both listed
    "fp8_weights_on_cpu_and_duplicate_ids": (
        {"model": "fp8", "input": "ids"},
        ["model.quantization: 'fp8' needs a CUDA GPU", "input.id_column: 'id' is not unique"],
    ),
}


@pytest.mark.slurm
@pytest.mark.parametrize("case", sorted(SLURM_CASES))
def test_a_mistake_stops_the_slurm_run_before_any_job_is_submitted(tmp_path, model_dir, case, slurm_cluster):
    change, message = SLURM_CASES[case]
    rows = make_rows(12)
    rows[9]["id"] = rows[1]["id"]
    data = write_parquet(tmp_path / "data" / "in.parquet", rows)
    config = workflow_config({"parquet": [str(data)]})
    for key, value in change.items():
        if key == "model":
            config["model"]["quantization"] = value
        elif value == "ids":
            config["input"]["id_column"] = "id"
        else:
            config[key] = {**config.get(key, {}), **value}
    r = run_workflow(tmp_path, config, "slurm", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    for said in [message] if isinstance(message, str) else message:
        assert said in out, out[-3000:]
    # (from this run's directory: the other process of `make test` submits jobs meanwhile)
    assert slurm_jobs(tmp_path) == {}, "a job was submitted to Slurm"
    assert "submitted with SLURM jobid" not in out
    assert not (tmp_path / "results" / "shards").exists()


@pytest.mark.slurm
def test_a_result_column_added_by_a_config_change_after_planning_stops_the_run_before_any_job(
    tmp_path, model_dir, slurm_cluster
):
    """Gold labels in 'label'; the run is planned and checked for plain generation, then sampling asks
    for a choice, which adds a 'label' column. The plan is not made again (sampling does not change
    it), but the preflight checks the columns for the new config and stops the run before any job:
    the gold labels would have been overwritten by predictions."""
    rows = make_rows(12)
    for r in rows:
        r["label"] = "gold"
    data = write_parquet(tmp_path / "data" / "in.parquet", rows)
    config = workflow_config({"parquet": [str(data)]})
    run_workflow(tmp_path, config, "slurm", "--until", "preflight")  # planned and checked, nothing submitted
    manifest = (tmp_path / "results" / "plan" / "manifest.json").stat().st_mtime_ns
    config["sampling"] = {**config["sampling"], "structured_outputs": {"choice": ["yes", "no"]}}
    r = run_workflow(tmp_path, config, "slurm", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "has the column(s) ['label'], which this config's output also has" in out, out[-3000:]
    assert (tmp_path / "results" / "plan" / "manifest.json").stat().st_mtime_ns == manifest, "not planned again"
    assert slurm_jobs(tmp_path) == {} and "submitted with SLURM jobid" not in out


@pytest.mark.parametrize(
    ("sampling", "problem"),
    [
        ({"reasoning_parser": "deepseek-r1"}, "sampling.reasoning_parser: 'deepseek-r1' is not one of the installed "
         "vLLM's reasoning parsers (did you mean 'deepseek_r1' or"),
        ({"reasoning_parser": "deepseek_r1"}, "sampling.reasoning_parser: 'deepseek_r1' does not work with this "
         "model's tokenizer: RuntimeError"),
    ],
)  # fmt: skip
def test_a_reasoning_parser_the_model_cannot_use_is_refused_before_any_job(
    tmp_path, capsys, model_dir, sampling, problem
):
    rc, err = preflight(tmp_path, capsys, sampling={"temperature": 0.0, "max_tokens": 12, **sampling})
    assert rc == 2 and problem in err, err


def test_a_yaml_alias_bomb_given_to_snakemake_is_refused_at_once(tmp_path):
    """Snakemake loads ``--configfile`` itself and hands the Snakefile the aliased structure: the
    Snakefile's first walk of it (the credential scan) is bounded too, so the bomb is refused at once
    instead of walked for hours (43 million values here)."""
    import time

    from tests.integration.workflow import snakemake_command
    from tests.unit.test_config import ALIAS_BOMB

    data = write_parquet(tmp_path / "in.parquet", make_rows(4))
    configfile = tmp_path / "bomb.yaml"
    configfile.write_text(f"input: {{parquet: [{data}]}}\nmodel: {{model: m}}\n{ALIAS_BOMB}")
    cmd, env = snakemake_command(tmp_path, configfile, "-n", "--cores", "1")
    started = time.monotonic()
    r = run_bounded(cmd, 120, tmp_path, cwd=tmp_path, env=env)
    took = time.monotonic() - started
    assert r.returncode != 0
    assert "the config holds more than 100,000 values once its YAML aliases" in r.stdout + r.stderr, r.stderr[-3000:]
    # Snakemake's own start is most of it (the refusal: milliseconds, tests/unit/test_config.py)
    assert took < 60, f"{took:.0f} s"


def test_a_run_of_steps_whose_upload_destination_cannot_be_written_stops_before_any_job(tmp_path, s3_server):
    """output.upload of a run of steps: the run's destination (the steps' own preflights check each
    step, and upload nothing themselves) is tried when the run starts, before the first job."""
    data = write_parquet(tmp_path / "data" / "in.parquet", make_rows(4))
    config = workflow_config({"parquet": [str(data)], "storage_options": {"endpoint_url": s3_server}},
                             output={"upload": "s3://no-such-bucket/run/"})  # fmt: skip
    config["steps"] = [{"name": "draft"}]
    r = run_workflow(tmp_path, config, "local", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "output.upload: cannot write under 's3://no-such-bucket/run/'" in out and "no job was started" in out, out
    assert "rule draft_plan_shards" not in out
    assert not (tmp_path / "results" / "steps" / "draft" / "plan" / "manifest.json").exists()
