"""Runs of steps (shardgen.features.steps): the steps' configs, which rows a step passes on, and how the next
step reads them. The whole run, with the real engine and Slurm: tests/integration/test_workflow.py."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

from shardgen import config as cfg
from shardgen.errors import ConfigError, InputError
from shardgen.features import steps


@pytest.fixture
def chain(parquet_files, model_dir, tmp_path):
    """generate 4 samples, then score them with a reward model and keep the best."""
    return {
        "input": {"parquet": [str(p) for p in parquet_files]},
        "model": {"model": str(model_dir), "max_model_len": 512},
        "output": {"dir": str(tmp_path / "out"), "format": "jsonl"},
        "shards": {"rows_per_shard": 2},
        "steps": [
            {"name": "draft", "prompt": {"template": "{{ topic }}"}, "sampling": {"n": 4, "seed": 1, "max_tokens": 8}},
            {
                "name": "judge",
                "task": "reward",
                "prompt": {"template": "{{ topic }} {{ generation }}", "chat": False},
                "select": {"best_of": {"by": "reward"}},
            },
        ],
    }


def test_step_configs_are_runs_of_their_own_chained_by_fingerprint(chain, tmp_path):
    draft, judge = steps.step_configs(chain)
    assert draft["output"]["dir"] == str(tmp_path / "out" / "steps" / "draft")
    assert draft["output"]["format"] == "parquet", "a step's own output is Parquet; the run's is output.format"
    assert draft["input"]["parquet"] == chain["input"]["parquet"]
    assert judge["task"] == "reward" and judge["model"]["model"] == draft["model"]["model"], "a section it omits"
    before = judge["input"]["step"]
    assert before["dir"] == draft["output"]["dir"] and before["name"] == "draft"
    assert before["fingerprint"] == cfg.content_fingerprint(draft)
    assert (draft["step"]["group"], judge["step"]["group"]) == (1, 4), "the judge's rows: 4 per input row"
    assert judge["step"]["previous_config"].endswith(f"{cfg.digest(draft)}.json")
    assert draft["step"]["preflights"] == judge["step"]["preflights"] and len(draft["step"]["preflights"]) == 2

    # a change of the judge's prompt changes the judge's fingerprint only; of the draft's, both
    other = copy.deepcopy(chain)
    other["steps"][1]["prompt"]["template"] = "{{ generation }}"
    d2, j2 = steps.step_configs(other)
    assert cfg.content_fingerprint(d2) == cfg.content_fingerprint(draft)
    assert cfg.content_fingerprint(j2) != cfg.content_fingerprint(judge)
    other = copy.deepcopy(chain)
    other["steps"][0]["sampling"]["seed"] = 2
    d3, j3 = steps.step_configs(other)
    assert cfg.content_fingerprint(d3) != cfg.content_fingerprint(draft)
    assert cfg.content_fingerprint(j3) != cfg.content_fingerprint(judge)


def test_bad_steps_are_refused_naming_the_step(chain):
    bad = copy.deepcopy(chain)
    bad["steps"][1]["sampling"] = {"max_tokens": 8, "nope": 1}
    bad["steps"][1]["task"] = "generate"
    with pytest.raises(ConfigError, match=r"steps\[1\] \(judge\): unknown key 'sampling.nope'"):
        cfg.validate(bad)
    bad = copy.deepcopy(chain)
    bad["steps"][0]["select"] = {"pairs": {"by": "reward"}}
    with pytest.raises(ConfigError, match=r"steps\[0\] \(draft\).select.pairs: pairs end a run"):
        cfg.validate(bad)
    bad = copy.deepcopy(chain)
    bad["steps"][1]["select"] = {"keep_if": "reward >"}
    with pytest.raises(ConfigError, match="keep_if: 'reward >' is not a Jinja expression"):
        cfg.validate(bad)
    bad = copy.deepcopy(chain)
    bad["shards"]["workers"] = 2
    with pytest.raises(ConfigError, match="drop shards.workers"):
        cfg.validate(bad)
    bad = copy.deepcopy(chain)
    bad["steps"][1]["name"] = "draft"
    with pytest.raises(ConfigError, match="two steps named 'draft'"):
        cfg.validate(bad)


def _judged(rewards: list[float | None], errors: list[str | None] | None = None) -> pa.Table:
    n = len(rewards)
    return pa.table({
        "topic": [f"q{i // 4}" for i in range(n)],
        "row_index": list(range(n)),
        "reward": pa.array(rewards, pa.float32()),
        "error": pa.array(errors or [None] * n, pa.string()),
    })  # fmt: skip


def test_best_of_keeps_the_best_sample_of_each_input_row():
    table = _judged([0.1, 0.9, 0.5, 0.3, -1.0, -2.0, None, -0.5], [None, None, None, None, None, None, None, "boom"])
    reasons = steps.dropped_reasons(table, "judge", {"best_of": {"by": "reward"}}, group=4)
    assert [r is None for r in reasons] == [False, True, False, False, True, False, False, False]
    assert reasons[7] == "step judge: error" and "not the highest reward" in reasons[0]
    lowest = steps.dropped_reasons(table, "judge", {"best_of": {"by": "reward", "lowest": True}}, group=4)
    assert [i for i, r in enumerate(lowest) if r is None] == [0, 5]
    kept, dropped = steps.selected(table, "judge", {"best_of": {"by": "reward"}}, 4)
    assert kept.column("row_index").to_pylist() == [1, 4] and dropped == 6


def test_pairs_and_keep_if(chain):
    table = _judged([0.1, 0.9, 0.5, 0.3, 1.0, 1.0, 1.0, 1.0])
    pairs, dropped = steps.selected(table, "judge", {"pairs": {"by": "reward"}}, 4)
    chosen, rejected = pairs.column("chosen").to_pylist(), pairs.column("rejected").to_pylist()
    assert [(c["row_index"], r["row_index"]) for c, r in zip(chosen, rejected, strict=True)] == [(1, 0)]
    assert dropped == 6, "the second input row's samples all tie: no pair"
    kept, dropped = steps.selected(table, "judge", {"keep_if": "reward > 0.4 and topic == 'q0'"}, 4)
    assert kept.column("row_index").to_pylist() == [1, 2] and dropped == 6
    with pytest.raises(InputError, match="select by 'score': no such column"):
        steps.selected(table, "judge", {"best_of": {"by": "score"}}, 4)
    # a value keep_if cannot take (a null reward) is that row's: not passed on, and why
    nulls = _judged([None, 0.9, 0.5, 0.3])
    reasons = steps.dropped_reasons(nulls, "judge", {"keep_if": "reward > 0.4"}, 4)
    assert reasons[0].startswith("step judge: keep_if reward > 0.4 failed: TypeError") and reasons[1:3] == [None] * 2
    # a column it does not have is found when the step plans
    run = cfg.RunConfig.from_dict(steps.step_configs({**chain, "steps": [
        chain["steps"][0], {**chain["steps"][1], "select": {"keep_if": "score > 1 and reward > 0"}}]})[1])  # fmt: skip
    with pytest.raises(InputError, match=r"judge.select.keep_if reads \['score'\], which the step's rows do not"):
        steps.check_select(run, pa.schema([("topic", pa.string()), ("reward", pa.float32())]))
    steps.check_select(run, pa.schema([("topic", pa.string()), ("reward", pa.float32()), ("score", pa.int64())]))


def test_a_best_of_or_pairs_by_a_column_that_is_not_a_number_is_refused_when_the_step_plans(chain, tmp_path):
    """Found by the judge's plan (``plan.write_manifest``), before any of its GPU work."""
    from shardgen.data.plan import write_manifest

    for kind in ("best_of", "pairs"):
        chained = copy.deepcopy(chain)
        chained["steps"][1]["select"] = {kind: {"by": "topic"}}
        draft, judge = (cfg.RunConfig.from_dict(c) for c in steps.step_configs(cfg.validate(chained)))
        cfg.write_resolved(draft.raw, draft.output.dir)
        write_manifest(draft, tmp_path / "out" / "steps" / "draft" / "plan" / "manifest.json")
        with pytest.raises(InputError, match=rf"judge.select.{kind}.by: 'topic' is a column of string, not a number"):
            write_manifest(judge, tmp_path / "judge.json")
    steps.check_select(judge, pa.schema([("topic", pa.bool_())]))


def test_a_slow_keep_if_drops_that_row_with_its_reason_and_the_others_are_judged(monkeypatch):
    """The alarm's ``TemplateTimeout`` (a BaseException, so that Jinja's own handlers cannot swallow it)
    is that row's reason, as a value keep_if cannot take is: the select goes on."""
    from shardgen.base import sandbox

    monkeypatch.setattr(sandbox, "RENDER_SECONDS", 0.01)
    table = _judged([0.9, 0.9, 0.1, 0.9]).append_column("slow", pa.array([0, 1, 0, 0]))
    # sums in C, 10-30 ms each: the alarm lands inside one, and is raised as it returns, before the
    # next cooperative check could raise its own error (200 of 200 runs here)
    slow = "reward > 0.4 and (slow == 0 or " + " + ".join(["(range(10**6) | sum)"] * 10) + " > 0)"
    reasons = steps.dropped_reasons(table, "judge", {"keep_if": slow}, 4)
    assert reasons[0] is None and reasons[3] is None and "is false" in reasons[2]
    assert reasons[1] == f"step judge: keep_if {slow} failed: it took more than 0.01 s"


def test_a_pairs_select_without_any_pair_writes_the_chosen_and_rejected_columns():
    table = _judged([1.0, 1.0, 1.0, 1.0])  # every sample ties: no pair
    pairs, dropped = steps.selected(table, "judge", {"pairs": {"by": "reward"}}, 4)
    assert pairs.num_rows == 0 and dropped == 4
    assert pairs.schema == steps.pairs_schema(table.schema)
    assert pairs.schema.field("chosen").type == pa.struct(list(table.schema))


def test_an_input_column_named_like_the_steps_bookkeeping_is_refused_when_the_first_step_plans(chain, tmp_path):
    """A user's ``dropped`` would be read as why rows were not passed on (and its rows left out); a
    user's ``reasoning_tokens`` (a bookkeeping column of a reasoning step) would not be passed on."""
    import pyarrow.parquet as pq

    from shardgen.data.plan import write_manifest

    for column in ("dropped", "reasoning_tokens"):
        path = tmp_path / f"{column}.parquet"
        pq.write_table(pa.table({"topic": ["owls"], column: ["mine"]}), path)
        chained = copy.deepcopy(chain) | {"input": {"parquet": [str(path)]}}
        draft = cfg.RunConfig.from_dict(steps.step_configs(cfg.validate(chained))[0])
        with pytest.raises(InputError, match=rf"has the column\(s\) \['{column}'\], which a run of steps keeps"):
            write_manifest(draft, tmp_path / "m.json")
        # a run of one step too, whose output would keep only the rows with a null `dropped`
        alone = copy.deepcopy(chained) | {"steps": chained["steps"][:1]}
        with pytest.raises(InputError, match=rf"\['{column}'\], which a run of steps keeps"):
            write_manifest(cfg.RunConfig.from_dict(steps.step_configs(cfg.validate(alone))[0]), tmp_path / "m.json")
    # not in a run without steps, where it is a column like any other
    plain = {k: v for k, v in chained.items() if k != "steps"} | {"prompt": {"template": "{{ topic }}"}}
    write_manifest(cfg.RunConfig.from_dict(cfg.validate(plain)), tmp_path / "m.json")


def test_a_column_renamed_for_the_next_step_must_not_meet_one_of_the_same_name():
    written = pa.schema([("draft_generation", pa.string()), ("row_index", pa.int64()), ("generation", pa.string())])
    with pytest.raises(InputError, match="'draft_generation' and 'generation', which the next step would both read"):
        steps.passed_columns(written, ["generation"], "draft")


def test_the_next_step_reads_content_columns_renamed_where_it_writes_them_too():
    written = pa.schema([
        ("topic", pa.string()), ("row_index", pa.int64()), ("sample_index", pa.int32()), ("generation", pa.string()),
        ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()), ("generated_tokens", pa.int32()),
        ("error", pa.string()),
    ])  # fmt: skip
    schema, names = steps.passed_columns(written, ["row_index", "generation", "finish_reason", "error"], "draft")
    assert schema.names == ["topic", "sample_index", "draft_generation", "dropped"]
    assert names == {"topic": "topic", "sample_index": "sample_index", "draft_generation": "generation"}


def test_the_steps_recipes_of_the_readmes_are_valid_configs():
    import re

    import yaml

    from tests.conftest import ROOT

    found = 0
    for doc in (ROOT / "README.md", ROOT / "config" / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"^```yaml\n(.*?)^```", doc.read_text(), re.M | re.S):
            config = yaml.safe_load(block)
            if "steps" in config:
                config.setdefault("input", {"parquet": ["data/prompts.parquet"]})
                config = cfg.resolve_paths(config, ROOT)  # a function.path: as in a config at the root
                assert len(steps.step_configs(cfg.validate(config))) == len(config["steps"]), block
                found += 1
    assert found >= 4


def test_timing_tells_how_long_a_step_ran_alongside_the_one_before_and_waited_for_its_input(tmp_path):
    import json

    from shardgen.base.rundir import RunDir

    def write(step: str, shard: str, start: str, end: str) -> dict:
        run_dir = RunDir(tmp_path / step)
        run_dir.shards.mkdir(parents=True, exist_ok=True)
        attempts = [{"started": f"2026-01-01T00:{start}+00:00", "ended": f"2026-01-01T00:{end}+00:00"}]
        run_dir.shard_stats(shard).write_text(json.dumps({"attempts": attempts}))
        return {"output": {"dir": str(run_dir.root)}}

    draft = [write("draft", "0", "00:00", "01:00"), write("draft", "1", "01:00", "02:00")][0]
    judge = [write("judge", "0", "01:10", "01:30"), write("judge", "1", "02:20", "02:30")][0]
    first, second = steps.timing([draft, judge], ["0", "1"])
    assert first == {"span_s": 120.0, "overlap_with_step_before_s": None, "start_after_input_p50_s": None}
    assert second == {"span_s": 80.0, "overlap_with_step_before_s": 50.0, "start_after_input_p50_s": 15.0}


def test_a_later_steps_preflight_reads_none_of_its_rows_which_the_step_before_makes_later(chain, tmp_path, model_dir):
    """Every step's preflight runs before the step before has committed a shard: the judge's reads none
    of its rows (its source's kind says they are not there to read), and passes on what it can check."""
    from shardgen.data.plan import write_manifest
    from shardgen.jobs import preflight

    chain["steps"][1] = {"name": "judge", "prompt": {"template": "Is this about {{ topic }}? {{ draft_generation }}"}}
    draft, judge = (cfg.RunConfig.from_dict(c) for c in steps.step_configs(cfg.validate(chain)))
    cfg.write_resolved(draft.raw, draft.output.dir)
    write_manifest(draft, tmp_path / "out" / "steps" / "draft" / "plan" / "manifest.json")
    write_manifest(judge, tmp_path / "judge.json")
    report = preflight.run(judge, tmp_path / "judge.json", {"path": str(model_dir)})
    assert report["ok"] and report["sampled_rows"] == 0 and report["sampled_errors"] == {}
    assert report["estimate"]["rows"] == 4 * 30, "each of the 30 input rows' 4 samples"
