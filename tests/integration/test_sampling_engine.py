"""Labelling and generation on the real engine (CPU build): structured outputs, label
probabilities, several samples, seeded sampling, conversations, speculative decoding."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen.data.plan import write_manifest
from shardgen.jobs.generate import JobContext, run_shard
from shardgen.jobs.merge import merge
from tests.conftest import base_config, make_rows, write_parquet

pytestmark = pytest.mark.engine

REVIEWS = [
    "I loved it, the best tea I ever had.",
    "Terrible. It broke after one day.",
    "It is a clock. It shows the time.",
    "Wonderful maps, very clear and beautiful.",
    "The bread was stale and the service rude.",
    "Snow fell; the bridge was closed.",
]


def planned(tmp_path, rows, **overrides):
    data = write_parquet(tmp_path / "in.parquet", rows)
    config = base_config(
        {"parquet": [str(data)], "id_column": "id"},
        output={"dir": str(tmp_path / "out")} | overrides.pop("output", {}),
        **overrides,
    )
    manifest = tmp_path / "manifest.json"
    write_manifest(config, manifest)
    return config, manifest


def run_all(tmp_path, config, manifest, engine, tag="s") -> list:
    shards = json.loads(manifest.read_text())["shards"]
    for s in shards:
        run_shard(
            config,
            manifest,
            s["id"],
            tmp_path / tag / f"{s['id']}.parquet",
            tmp_path / tag / f"{s['id']}.stats.json",
            JobContext(engine),
        )
    return shards


def review_rows(n: int) -> list[dict]:
    return [{"id": f"r{i:03d}", "text": REVIEWS[i % len(REVIEWS)]} for i in range(n)]


def test_json_schema_output_parses_for_every_row_into_typed_columns(tmp_path, engine):
    schema = {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "topic": {"type": "string", "maxLength": 12},
        },
        "required": ["sentiment", "stars", "topic"],
        "additionalProperties": False,
    }
    config, manifest = planned(
        tmp_path,
        review_rows(6),
        prompt={"template": "Review: {{ text }}\nDescribe the review as JSON."},
        sampling={"temperature": 0.0, "max_tokens": 60, "structured_outputs": {"json": schema}},
        shards={"rows_per_shard": 6},
    )
    run_all(tmp_path, config, manifest, engine)
    table = pq.read_table(tmp_path / "s" / "00000.parquet")
    assert table.column("error").to_pylist() == [None] * 6, table.column("error").to_pylist()
    parsed = table.column("parsed").to_pylist()
    assert table.schema.field("parsed").type.field("stars").type == "int64"
    for record, text in zip(parsed, table.column("generation").to_pylist(), strict=True):
        assert record == json.loads(text)
        assert record["sentiment"] in {"positive", "negative", "neutral"} and 1 <= record["stars"] <= 5


def test_each_row_gets_its_own_sampling_and_a_bad_value_is_that_rows_error_naming_the_field(tmp_path, engine):
    """input.sampling_column, under OpenAI's names: each row within its own max_tokens, a row seed
    that gives two rows of one prompt the same sampled text, JSON mode for one row; an invalid
    request is that row's error and the other rows run."""
    seeded = {"max_completion_tokens": 6, "temperature": 0.9, "seed": 7}
    params = [
        {"max_tokens": 2},
        seeded,
        seeded,
        None,  # the run's: greedy, 12 tokens
        {"max_tokens": -1},
        {"temperature": "hot"},
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_object"}, "max_tokens": 30},
    ]
    rows = [
        {"id": f"r{i}", "text": REVIEWS[0], "params": None if p is None else json.dumps(p)}
        for i, p in enumerate(params)
    ]
    config, manifest = planned(
        tmp_path,
        rows,
        input={"parquet": [str(tmp_path / "in.parquet")], "id_column": "id", "sampling_column": "params"},
        prompt={"template": "Review: {{ text }}\nSay what you think of it."},
        shards={"rows_per_shard": 8},
        errors={"max_rate": 0.5},
    )
    run_all(tmp_path, config, manifest, engine)
    got = pq.read_table(tmp_path / "s" / "00000.parquet").to_pylist()
    errors = [r["error"] for r in got]
    assert errors[:4] == [None] * 4 and errors[7] is None, errors
    assert [r["generated_tokens"] for r in got[:2]] == [2, 6] and got[3]["generated_tokens"] <= 12
    assert got[1]["generation"] == got[2]["generation"], "one prompt, one row seed: one sampled text"
    assert errors[4].startswith("invalid_sampling: params: max_tokens must be at least 1")
    assert errors[5] == "invalid_sampling: params.temperature: a number, not 'hot'"
    assert errors[6].startswith("invalid_sampling: params.tools: not a sampling field")
    assert got[7]["generation"].lstrip().startswith("{") and got[7]["generated_tokens"] <= 30


def test_choice_labels_are_always_a_choice_with_probabilities_summing_to_one(tmp_path, engine):
    labels = ["positive", "negative", "neutral"]
    config, manifest = planned(
        tmp_path,
        review_rows(12),
        prompt={
            "system": "You label product reviews as positive, negative or neutral.",
            "template": "Review: {{ text }}\nLabel:",
        },
        sampling={"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": labels}},
        output={"choice_probs": True},
        shards={"rows_per_shard": 12},
    )
    run_all(tmp_path, config, manifest, engine)
    rows = pq.read_table(tmp_path / "s" / "00000.parquet").to_pylist()
    for r in rows:
        assert r["error"] is None and r["label"] in labels and r["generation"].strip() == r["label"]
        assert sum(r["choice_probs"].values()) == pytest.approx(1.0, abs=1e-6)
        # greedy decoding picks the label whose first token is most likely
        assert r["label_prob"] == max(r["choice_probs"].values())
    # the probabilities are the model's, row by row (a 135M model is not a good labeller)
    assert len({round(r["choice_probs"]["negative"], 6) for r in rows}) >= 3


def test_three_samples_per_row_are_kept_as_rows_and_merge_counts_them(tmp_path, engine):
    config, manifest = planned(
        tmp_path,
        make_rows(10),
        sampling={"temperature": 1.0, "max_tokens": 6, "n": 3, "seed": 11},
        shards={"rows_per_shard": 6},
    )
    run_all(tmp_path, config, manifest, engine, tag="out/shards")  # the shards of the run directory (output.dir)
    stats = merge(config, manifest, tmp_path / "out.parquet", tmp_path / "stats.json")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 30 and stats["rows"] == 10 and stats["output_rows"] == 30
    assert table.column("row_index").to_pylist() == [i for i in range(10) for _ in range(3)]
    assert table.column("sample_index").to_pylist() == [0, 1, 2] * 10
    gens = table.column("generation").to_pylist()
    assert any(len(set(gens[i : i + 3])) > 1 for i in range(0, 30, 3)), "sampled, not greedy: samples differ"
    assert stats["generated_tokens"] == sum(table.column("generated_tokens").to_pylist())


def test_samples_as_a_list_keep_one_row_per_input_row(tmp_path, engine):
    config, manifest = planned(
        tmp_path,
        make_rows(4),
        sampling={"temperature": 1.0, "max_tokens": 5, "n": 2, "seed": 3},
        output={"samples": "list"},
        shards={"rows_per_shard": 4},
    )
    run_all(tmp_path, config, manifest, engine)
    table = pq.read_table(tmp_path / "s" / "00000.parquet")
    assert table.num_rows == 4 and [len(g) for g in table.column("generation").to_pylist()] == [2, 2, 2, 2]


SYSTEM = "You are a friendly storyteller who writes one vivid sentence about the topic you are given. " * 3


def test_seeded_sampling_gives_the_same_text_across_runs_and_shard_sizes(tmp_path, engine):
    # 48 chats of about 200 prompt tokens, sampled at temperature 0.9: the
    # size at which seeded sampling once killed vLLM's CPU engine (with
    # chunked prefill on; shardgen turns it off for seeded runs there).
    rows = make_rows(48)
    texts = {}
    for rows_per_shard in (48, 13):
        work = tmp_path / f"rps{rows_per_shard}"
        config, manifest = planned(
            work,
            rows,
            prompt={"system": SYSTEM, "template": "Tell me about {{ topic }} (story {{ n }})."},
            sampling={"temperature": 0.9, "max_tokens": 12, "seed": 2024},
            shards={"rows_per_shard": rows_per_shard},
        )
        shards = run_all(work, config, manifest, engine)
        table = pa.concat_tables([pq.read_table(work / "s" / f"{s['id']}.parquet") for s in shards])
        texts[rows_per_shard] = dict(
            zip(table.column("id").to_pylist(), table.column("generation").to_pylist(), strict=True)
        )
    assert texts[48] == texts[13]
    assert len(set(texts[48].values())) > 40, "sampled text differs from row to row"
    # and a rerun of one shard gives its rows the same text again
    config, manifest = planned(
        tmp_path / "again",
        rows,
        prompt={"system": SYSTEM, "template": "Tell me about {{ topic }} (story {{ n }})."},
        sampling={"temperature": 0.9, "max_tokens": 12, "seed": 2024},
        shards={"rows_per_shard": 13},
    )
    run_shard(config, manifest, "00001", tmp_path / "again.parquet", tmp_path / "again.json", JobContext(engine))
    again = pq.read_table(tmp_path / "again.parquet").to_pylist()
    assert {r["id"]: r["generation"] for r in again} == {r["id"]: texts[48][r["id"]] for r in again}


def test_a_messages_column_dataset_with_few_shot_turns_works(tmp_path, engine):
    rows = [
        {"id": "a", "chat": [{"role": "user", "content": "Name a color."}]},
        {
            "id": "b",
            "chat": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Name a fruit."},
            ],
        },
        {"id": "c", "chat": None},
    ]
    data = tmp_path / "chats"
    datasets.Dataset.from_list(rows).save_to_disk(data)
    config = base_config(
        {"disk": str(data), "id_column": "id"},
        prompt={
            "messages_column": "chat",
            "system": "Answer with one word.",
            "few_shot": [{"role": "user", "content": "Name an animal."}, {"role": "assistant", "content": "Cat."}],
        },
        output={"dir": str(tmp_path / "out")},
        errors={"max_rate": 0.5},
    )
    write_manifest(config, tmp_path / "m.json")
    stats = run_shard(
        config, tmp_path / "m.json", "00000", tmp_path / "o.parquet", tmp_path / "o.json", JobContext(engine)
    )
    out = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert [r["error"] for r in out] == [None, None, "null_value: column 'chat' is null"]
    assert out[0]["generation"].strip() and out[1]["generation"].strip()
    assert stats["errors"] == 1 and stats["error_reasons"] == {"null_value": 1}


def test_ngram_speculative_decoding_runs_and_reports_its_acceptance_rate(tmp_path):
    # Its own engine (speculation is an engine setting), started and stopped by run_shard as in a job.
    rows = [{"id": f"r{i}", "text": "one two three four five six seven eight nine ten " * 3} for i in range(6)]
    config, manifest = planned(
        tmp_path,
        rows,
        prompt={"template": "Repeat exactly: {{ text }}"},
        model={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}},
        sampling={"temperature": 0.0, "max_tokens": 24},
        shards={"rows_per_shard": 6},
    )
    stats = run_shard(config, manifest, "00000", tmp_path / "o.parquet", tmp_path / "o.json")
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.column("error").null_count == 6 and all(g.strip() for g in table.column("generation").to_pylist())
    spec = stats["spec_decode"]
    assert spec["draft_tokens"] > 0 and 0 < spec["acceptance_rate"] <= 1, spec
