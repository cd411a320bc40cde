"""Merge: every planned row exactly once, in input order; refuses gaps, repeats and mixed configs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen.data.outputs import PROVENANCE_KEY
from shardgen.errors import MergeError, ShardgenError
from shardgen.jobs.merge import merge as merge_files
from shardgen.requests.results import ResultSpec
from tests.conftest import base_config

INPUT = pa.schema([pa.field("text", pa.string())])
PLAN = [("00000", 0, 4), ("00001", 4, 8), ("00002", 8, 10)]


def write_plan(tmp_path, plan=PLAN):
    manifest = {
        "version": 1,
        "source": {"kind": "parquet", "files": []},
        "total_rows": plan[-1][2],
        "rows_per_shard": 4,
        "shards": [{"id": i, "start": a, "stop": b, "segments": []} for i, a, b in plan],
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def config(**output):
    return base_config({"parquet": ["in.parquet"]}, output={"dir": "results", **output})


def merge(manifest, shard_dir, *args, **output):
    """Merge the shards in ``shard_dir``, the ``shards/`` of the run directory its parent is."""
    return merge_files(config(dir=str(shard_dir.parent), **output), manifest, *args)


def write_shard(shard_dir, shard_id, indexes, config_fp=None, samples=1, vllm=None):
    """A shard file as a generate job writes it, made with ``config()`` unless ``config_fp`` says otherwise
    (``vllm``: the vLLM version the job ran, which its fingerprint and stats record)."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    config_fp = config_fp or (config().fingerprint_with(vllm) if vllm else config().fingerprint)
    spec = ResultSpec({"n": samples}, samples="rows")
    schema = spec.schema(INPUT, f"fp-{shard_id}", config_fp, shard_id)
    rows = [
        {
            "text": f"t{i}",
            "row_index": i,
            "generation": f"g{i}",
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "generated_tokens": 3,
            "error": None,
        }
        | ({"sample_index": k} if samples > 1 else {})
        for i in indexes
        for k in range(samples)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), shard_dir / f"{shard_id}.parquet")
    stats = {
        "shard": shard_id,
        "rows": len(rows),
        "errors": 0,
        "prompt_tokens": 5 * len(rows),
        "generated_tokens": 3 * len(rows),
        "attempt_generated_tokens": 3 * len(rows),
        "attempt_prompt_tokens": 5 * len(rows),
        "attempt_requests": len(rows),
        "generation_seconds": 2.0,
        "wall_seconds": 3.0,
        "gpu_hours": 0.001,
        "histograms": {"ttft_s": {"10": len(rows)}},
    } | ({"engine": {"vllm_version": vllm}} if vllm else {})
    (shard_dir / f"{shard_id}.stats.json").write_text(json.dumps(stats))


def complete(tmp_path):
    for shard_id, a, b in PLAN:
        write_shard(tmp_path / "shards", shard_id, range(a, b))


def test_merge_writes_every_row_once_in_input_order_with_summed_stats(tmp_path):
    complete(tmp_path)
    stats = merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("row_index").to_pylist() == list(range(10))
    assert table.column("text").to_pylist()[3] == "t3"
    assert stats["rows"] == 10 and stats["generated_tokens"] == 30
    assert stats["output_tokens_per_s"] == pytest.approx(30 / 6.0)
    assert len(stats["shards"]) == 3
    assert json.loads((tmp_path / "stats.json").read_text())["rows"] == 10


def test_merge_refuses_a_missing_row_and_names_the_shard(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00001", [4, 5, 7])
    with pytest.raises(MergeError, match="shard 00001: 1 rows missing, 0 rows repeated"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    assert not (tmp_path / "out.parquet").exists()


def test_merge_refuses_a_repeated_row(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00002", [8, 9, 9])
    with pytest.raises(MergeError, match="shard 00002: 0 rows missing, 1 rows repeated"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_merge_refuses_a_missing_shard(tmp_path):
    complete(tmp_path)
    (tmp_path / "shards" / "00000.parquet").unlink()
    with pytest.raises(MergeError, match=r"shard 00000: output missing \(4 rows\)"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_merge_refuses_shards_that_another_config_made_even_when_they_agree(tmp_path):
    """Run A's shards under run B's config: every shard agrees with the others, none with the run."""
    for shard_id, a, b in PLAN:
        write_shard(tmp_path / "shards", shard_id, range(a, b), config_fp="run-a")
    with pytest.raises(
        MergeError, match=r"another configuration \(run-a\) than this run's .*shards 00000, 00001, 00002"
    ):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    assert not (tmp_path / "out.parquet").exists()


def test_merge_refuses_shards_of_mixed_configurations(tmp_path):
    complete(tmp_path)
    write_shard(tmp_path / "shards", "00001", range(4, 8), config_fp="other")
    with pytest.raises(MergeError, match="2 different configurations"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_merge_counts_every_sample_of_every_row(tmp_path):
    for shard_id, a, b in PLAN:
        write_shard(tmp_path / "shards", shard_id, range(a, b), samples=3)
    merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 30 and table.column("sample_index").to_pylist()[:4] == [0, 1, 2, 0]
    # a row with one sample short is a missing row
    table = pq.read_table(tmp_path / "shards" / "00001.parquet")
    pq.write_table(table.slice(0, table.num_rows - 1), tmp_path / "shards" / "00001.parquet")
    with pytest.raises(MergeError, match="shard 00001: 1 rows missing, 0 rows repeated"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out2.parquet", tmp_path / "stats.json")


def test_each_output_format_loads_back_with_its_provenance(tmp_path):
    import datasets

    complete(tmp_path)
    plan = write_plan(tmp_path)
    fp = config().fingerprint
    merge(plan, tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "s1.json")
    meta = pq.read_schema(tmp_path / "out.parquet").metadata
    prov = json.loads(meta[PROVENANCE_KEY])
    assert prov["config_fingerprint"] == fp and prov["model"].endswith("SmolLM2-135M-Instruct")

    merge(plan, tmp_path / "shards", tmp_path / "out.jsonl", tmp_path / "s2.json", format="jsonl")
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["row_index"] for line in lines] == list(range(10))
    assert json.loads((tmp_path / "out.jsonl.provenance.json").read_text())["config_fingerprint"] == fp
    assert datasets.load_dataset("json", data_files=str(tmp_path / "out.jsonl"), split="train").num_rows == 10

    merge(plan, tmp_path / "shards", tmp_path / "out_hf", tmp_path / "s3.json", format="hf")
    ds = datasets.load_from_disk(str(tmp_path / "out_hf"))
    assert ds["row_index"] == list(range(10)) and ds[3]["text"] == "t3"
    assert json.loads(ds.info.description)["shardgen_provenance"]["config_fingerprint"] == fp


def hub_cards(monkeypatch):
    """The hub's dataset cards, stood in for: the card a dataset's push leaves (with the metadata of its
    files), and the list of the cards pushed over it."""
    import huggingface_hub

    hub_card = "---\nconfigs:\n- config_name: default\n  data_files: data/*.parquet\n---\n\n# pushed\n"
    cards = []
    monkeypatch.setattr(huggingface_hub.DatasetCard, "load", classmethod(lambda cls, repo, **kw: cls(hub_card)))
    monkeypatch.setattr(huggingface_hub.DatasetCard, "push_to_hub",
                        lambda self, repo, **kw: cards.append((repo, str(self), kw)) or "card01")  # fmt: skip
    return cards


def test_push_to_hub_sends_the_merged_rows_with_the_token_from_the_environment_only(tmp_path, monkeypatch):
    """And the merge's dataset card as the dataset's (the hub is this test's stand-in: nothing reaches it)."""
    import datasets

    from shardgen.jobs.merge import push

    complete(tmp_path)
    merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.jsonl", tmp_path / "s.json", format="jsonl")
    monkeypatch.setenv("HF_TOKEN", "hf_SecretThatMustNotBeWritten")
    calls = []

    def fake_push(self, repo_id, **kwargs):  # nothing can reach the hub here
        calls.append((repo_id, self.num_rows, kwargs))
        return type("CommitInfo", (), {"oid": "abc123"})()

    monkeypatch.setattr(datasets.Dataset, "push_to_hub", fake_push)
    cards = hub_cards(monkeypatch)
    c = config(format="jsonl", push_to_hub="org/reviews-labelled")
    record = push(c, tmp_path / "out.jsonl", tmp_path / "s.json", tmp_path / "pushed.json")
    ((repo, rows, kwargs),) = calls
    assert repo == "org/reviews-labelled" and rows == 10 and "token" not in kwargs and kwargs["private"] is True
    assert record == {"repo_id": "org/reviews-labelled", "rows": 10, "commit": "abc123", "card": "card01"}
    assert "hf_Secret" not in (tmp_path / "pushed.json").read_text()
    ((repo, text, kwargs),) = cards
    assert repo == "org/reviews-labelled" and kwargs["repo_type"] == "dataset" and "token" not in kwargs
    assert text.startswith("---\n") and "data_files: data/*.parquet" in text, "the hub's files, not output.jsonl"
    assert text.split("---\n", 2)[2] == (tmp_path / "README.md").read_text().split("---\n", 2)[2], "the merge's card"


def test_every_output_gets_a_dataset_card_saying_what_was_run_and_how_to_run_it_again(tmp_path):
    import datasets
    from huggingface_hub import DatasetCard

    from shardgen import config as cfg

    complete(tmp_path)
    stats = merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "output.parquet", tmp_path / "stats.json")
    card = DatasetCard((tmp_path / "README.md").read_text())  # the hub's own reader
    assert card.data.tags == ["shardgen", "synthetic"] and card.data.size_categories == ["n<1K"]
    assert card.data.configs == [{"config_name": "default", "data_files": "output.parquet"}]
    run = config(dir=str(tmp_path))
    for said in (f"config fingerprint: `{stats['config_fingerprint']}`", "rows            10  (0 errors)",
                 "GPU-hours", run.prompt.template, '"max_tokens": 12', f"{run.model['model'].rsplit('/')[-1]}`",
                 f"--configfile <output.dir>/plan/configs/{cfg.digest(dict(run.raw))}.json"):  # fmt: skip
        assert said in card.text, said
    # a directory output holds its card, and still loads
    merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out_hf", tmp_path / "s.json", format="hf")
    assert (tmp_path / "out_hf" / "README.md").exists()
    assert datasets.load_from_disk(str(tmp_path / "out_hf"))["row_index"] == list(range(10))


def test_merge_decides_from_the_vllm_the_shards_were_made_with_not_from_its_own_environment(tmp_path, monkeypatch):
    """The conda deployment merges (and pushes) in an environment without vLLM: its own probe says
    'unknown'. The push's commit names the fingerprint of the shards, not of the pushing process."""
    import datasets

    from shardgen import config as cfg
    from shardgen.jobs.merge import push

    for shard_id, a, b in PLAN:
        write_shard(tmp_path / "shards", shard_id, range(a, b), vllm="0.32.0")
    monkeypatch.setattr(cfg, "engine_version", lambda: "unknown")
    assert config().fingerprint != config().fingerprint_with("0.32.0"), "the merging process cannot see vLLM"
    stats = merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    assert stats["rows"] == 10 and stats["provenance"]["vllm_version"] == "0.32.0"
    messages = []
    monkeypatch.setattr(datasets.Dataset, "push_to_hub", lambda self, repo, **kw: messages.append(kw["commit_message"]))
    hub_cards(monkeypatch)
    push(config(push_to_hub="org/x"), tmp_path / "out.parquet", tmp_path / "stats.json", tmp_path / "pushed.json")
    assert messages == [f"shardgen output, config fingerprint {config().fingerprint_with('0.32.0')}"]


def test_merge_refuses_shards_made_with_different_vllm_versions_naming_them(tmp_path):
    for (shard_id, a, b), version in zip(PLAN, ["0.32.0", "0.32.0", "0.33.1"], strict=True):
        write_shard(tmp_path / "shards", shard_id, range(a, b), vllm=version)
    with pytest.raises(
        MergeError, match=r"2 versions of vLLM \(0\.32\.0: shards 00000, 00001; 0\.33\.1: shards 00002\)"
    ):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_a_shard_replaced_after_it_was_checked_stops_the_merge_before_anything_is_written(tmp_path, monkeypatch):
    from shardgen.jobs import merge as merge_module

    complete(tmp_path)
    check = merge_module._check_shards

    def check_then_replace(*args):
        checked = check(*args)
        # another run commits the same shard between the check and the copy: same rows, another file
        write_shard(tmp_path / "shards", "00001", range(4, 8), config_fp="another-config")
        return checked

    monkeypatch.setattr(merge_module, "_check_shards", check_then_replace)
    with pytest.raises(MergeError, match="shard 00001: its file .* was replaced while the merge ran"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shards"], "no output, no stats"


def test_a_shard_whose_result_column_doubled_an_input_column_is_refused(tmp_path):
    """A shard written by a job that did not check its columns (an older shardgen): two 'generation'
    columns, one the input's. The merge names it instead of writing a file no reader can load."""
    complete(tmp_path)
    path = tmp_path / "shards" / "00001.parquet"
    table = pq.read_table(path)
    doubled = table.append_column("generation", pa.array(["input's"] * table.num_rows))
    pq.write_table(doubled.replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(MergeError, match=r"shard 00001: the file .*00001.parquet has more than one column named"):
        merge(write_plan(tmp_path), tmp_path / "shards", tmp_path / "out.parquet", tmp_path / "stats.json")


def test_the_provenance_names_no_local_path_unless_asked_to(tmp_path):
    """Outputs get shared and pushed: the model's snapshot directory under a home directory, a
    download_dir, an adapter's path are named by their last component, unless output.provenance_paths."""
    from shardgen.data.stats import RunTotals
    from shardgen.jobs.merge import provenance

    first = {
        "engine": {"vllm_version": "0.32.0", "args": {"model": "/home/ada/.cache/hf/snapshots/abc123",
                                                        "download_dir": "/scratch/ada/hf", "max_model_len": 1024}},
        "model_source": {"commit": "abc123"},
        "lora_adapters": {"terse": {"source": "local", "path": "/home/ada/adapters/terse"}},
    }  # fmt: skip
    run = config()
    run = run.__class__.from_dict({**run.raw, "sampling": {**run.raw["sampling"], "stop": ["/end"]}})
    prov = provenance(run, first, RunTotals(), "fp")
    assert "/home/ada" not in json.dumps(prov) and "/scratch" not in json.dumps(prov)
    assert prov["sampling"]["stop"] == ["/end"], "a sampling value that starts with a slash is the user's text"
    assert prov["engine_args"] == {"model": "<local>/abc123", "download_dir": "<local>/hf", "max_model_len": 1024}
    assert prov["lora_adapters"]["terse"]["path"] == "<local>/terse" and prov["model_revision"] == "abc123"
    assert provenance(config(provenance_paths=True), first, RunTotals(), "fp")["engine_args"] == first["engine"]["args"]


def test_a_killed_merge_leaves_nothing_the_next_one_keeps_and_jsonl_rows_and_provenance_cannot_disagree(tmp_path):
    """A merge killed mid-write leaves its temporary file (and, for a datasets output, its working
    directory): the next merge removes them. JSON Lines rows and their provenance are two files; one
    killed between the two renames leaves a pair whose disagreement is named, not trusted."""
    from shardgen.data import formats

    complete(tmp_path)
    plan = write_plan(tmp_path)
    leftovers = [tmp_path / ".out.jsonl.0a1b2c3d.tmp", tmp_path / ".out.jsonl.provenance.json.0a1b2c3d.tmp"]
    for p in leftovers:
        p.write_text("half a merge")
    (tmp_path / ".out.jsonl.k3j_9abc").mkdir()  # a datasets output's working directory
    (tmp_path / ".out.jsonl.notes").write_text("someone else's")
    merge(plan, tmp_path / "shards", tmp_path / "out.jsonl", tmp_path / "s.json", format="jsonl")
    assert not any(p.exists() for p in leftovers) and not (tmp_path / ".out.jsonl.k3j_9abc").exists()
    assert (tmp_path / ".out.jsonl.notes").exists(), "only what a writer of the output leaves is removed"
    assert formats.provenance(tmp_path / "out.jsonl")["output_sha256"]
    # killed between the renames: the rows of the run before, the provenance of this one
    rows = (tmp_path / "out.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_text("".join(rows[:-1]))
    with pytest.raises(ShardgenError, match=r"out.jsonl.provenance.json' describes other rows than"):
        formats.provenance(tmp_path / "out.jsonl")
