"""Tasks and inputs beyond text generation, without an engine: what a pooling model's checkpoint says,
the columns each pooling task adds and the rows it gives, the config keys that belong to one task,
text pairs for the cross-encoder, LoRA adapters per row, and image cells."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from safetensors.numpy import save_file

from shardgen import config as cfg
from shardgen.errors import ConfigError, ShardgenError
from shardgen.models import heads
from shardgen.requests.results import PoolingSpec, result_spec
from shardgen.requests.tasks import KINDS
from tests.conftest import MODEL
from tests.unit.test_config import minimal


def checkpoint(d: Path, architecture: str, weights: list[str], **config) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": [architecture], "hidden_size": 8, **config}))
    save_file({name: np.zeros((1, 8), np.float32) for name in weights}, str(d / "model.safetensors"))
    return d


LABELS = {"id2label": {"0": "neg", "1": "neu", "2": "pos"}}


def test_a_sequence_classifier_has_a_head_with_its_labels_in_id_order(tmp_path):
    d = checkpoint(tmp_path, "LlamaForSequenceClassification", ["model.norm.weight", "score.weight"],
                   id2label={"2": "pos", "0": "neg", "1": "neu"})  # fmt: skip
    head = heads.Head.read(d)
    assert head.labels == ("neg", "neu", "pos") and head.has_head and head.embedding_size == 8
    assert KINDS["classify"].problems(head, {"model": "m"}, {}) == []


def test_classify_on_a_model_without_a_head_is_refused_naming_it(tmp_path):
    """vLLM would load it with an uninitialised head (docs/dev/vllm-pooling.md, Q5)."""
    d = checkpoint(tmp_path, "LlamaForCausalLM", ["model.norm.weight", "lm_head.weight"])
    (problem,) = KINDS["classify"].problems(heads.Head.read(d), {"model": "my-lm"}, {})
    assert "my-lm has none" in problem and "classification head" in problem
    # the same model embeds
    assert KINDS["embed"].problems(heads.Head.read(d), {"model": "my-lm"}, {}) == []


def test_a_classifier_architecture_without_head_weights_is_refused_too(tmp_path):
    d = checkpoint(tmp_path, "LlamaForSequenceClassification", ["model.norm.weight"], **LABELS)
    assert KINDS["classify"].problems(heads.Head.read(d), {"model": "m"}, {})


def test_reward_and_score_need_one_output(tmp_path):
    three = heads.Head.read(checkpoint(tmp_path / "a", "LlamaForSequenceClassification", ["score.weight"], **LABELS))
    one = heads.Head.read(
        checkpoint(tmp_path / "b", "LlamaForSequenceClassification", ["score.weight"], id2label={"0": "LABEL_0"})
    )
    for task in ("reward", "score"):
        assert "3 labels" in KINDS[task].problems(three, {"model": "m"}, {})[0]
        assert KINDS[task].problems(one, {"model": "m"}, {}) == []


def test_embed_on_a_classifier_checkpoint_is_refused(tmp_path):
    head = heads.Head.read(checkpoint(tmp_path, "LlamaForSequenceClassification", ["score.weight"], **LABELS))
    (problem,) = KINDS["embed"].problems(head, {"model": "clf"}, {})
    assert problem.startswith("task: embed on clf, a classifier")


def test_a_top_k_above_the_model_s_labels_is_refused(tmp_path):
    head = heads.Head.read(checkpoint(tmp_path, "LlamaForSequenceClassification", ["score.weight"], **LABELS))
    assert "more than the model's 3 labels" in KINDS["classify"].problems(head, {}, {"top_k": 4})[0]
    assert KINDS["classify"].problems(head, {}, {"top_k": 2}) == []


def test_the_embedding_size_is_the_last_sentence_transformers_dense_layer_s(tmp_path):
    d = checkpoint(tmp_path, "LlamaModel", ["model.norm.weight"])
    (d / "modules.json").write_text(json.dumps([{"path": "", "type": "sentence_transformers.models.Transformer"},
                                                {"path": "2_Dense", "type": heads.ST_DENSE}]))  # fmt: skip
    (d / "2_Dense").mkdir()
    (d / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 8, "out_features": 4}))
    assert heads.Head.read(d).embedding_size == 4


def test_the_demo_model_has_no_head_and_embeds_at_its_hidden_size():
    head = heads.Head.read(MODEL)
    assert not head.has_head and head.embedding_size == json.loads((MODEL / "config.json").read_text())["hidden_size"]


HEAD = heads.Head(("LlamaForSequenceClassification",), ("neg", "neu", "pos"), True, 4)


def test_classify_gives_the_top_label_and_a_float32_probability_per_label():
    spec = PoolingSpec(KINDS["classify"], HEAD)
    assert spec.names == ["row_index", "prompt_tokens", "label", "probs", "error", "result_source"]
    (row,) = spec.rows({"text": "x"}, 7, 3, [0.2, 0.1, 0.7])
    assert row["label"] == "pos" and row["row_index"] == 7
    table = pa.Table.from_pylist([row], schema=pa.schema([pa.field("text", pa.string()), *spec.fields()]))
    assert table.schema.field("probs").type == pa.struct([(n, pa.float32()) for n in ("neg", "neu", "pos")])
    assert math.isclose(sum(table.column("probs").to_pylist()[0].values()), 1.0, rel_tol=1e-6)


def test_classify_top_k_keeps_the_k_most_likely_labels_in_order():
    spec = PoolingSpec(KINDS["classify"], HEAD, {"top_k": 2})
    (row,) = spec.rows({}, 0, 3, [0.2, 0.1, 0.7])
    assert row["probs"] == [{"label": "pos", "prob": 0.7}, {"label": "neg", "prob": 0.2}]


def test_an_output_of_another_shape_than_the_config_says_fails_the_shard_not_the_row():
    with pytest.raises(ShardgenError, match="gave 2 class probabilities per row, but the model's config.json says 3"):
        PoolingSpec(KINDS["classify"], HEAD).rows({}, 0, 3, [0.5, 0.5])
    with pytest.raises(ShardgenError, match="gave 3 embedding values"):
        PoolingSpec(KINDS["embed"], HEAD).rows({}, 0, 3, [0.0, 0.0, 1.0])


def test_embeddings_are_a_fixed_size_float32_list_of_the_model_s_or_the_truncated_size():
    assert PoolingSpec(KINDS["embed"], HEAD).fields()[2].type == pa.list_(pa.float32(), 4)
    assert PoolingSpec(KINDS["embed"], HEAD, {"dimensions": 2}).fields()[2].type == pa.list_(pa.float32(), 2)


def test_reward_and_score_are_one_float32_and_a_per_token_reward_model_gives_a_list():
    (row,) = PoolingSpec(KINDS["reward"], HEAD).rows({}, 0, 3, [1.5])
    assert row["reward"] == 1.5 and PoolingSpec(KINDS["reward"], HEAD).fields()[2].type == pa.float32()
    per_token = heads.Head(("Qwen2ForProcessRewardModel",), ("LABEL_0",), True, 4)
    assert PoolingSpec(KINDS["reward"], per_token).fields()[2].type == pa.list_(pa.float32())
    assert PoolingSpec(KINDS["reward"], per_token).rows({}, 0, 3, [[0.1], [0.2], [0.3]])[0]["reward"] == [0.1, 0.2, 0.3]
    assert PoolingSpec(KINDS["score"], HEAD).rows({}, 0, 3, [0.25])[0]["score"] == 0.25


def test_an_error_row_has_every_pooled_column_null():
    (row,) = PoolingSpec(KINDS["embed"], HEAD).error_rows({"text": "x"}, 3, "null_value: column 'text' is null")
    assert row["embedding"] is None and row["error"].startswith("null_value") and row["row_index"] == 3


def test_the_registry_holds_each_task_the_schema_accepts_in_its_order():
    """A task is one class, registered in tasks.KINDS by its name."""
    assert list(KINDS) == cfg.schema()["properties"]["task"]["enum"]
    assert all(kind.name == name for name, kind in KINDS.items())
    assert [name for name, kind in KINDS.items() if kind.generates] == ["generate"]


def pooling_config(**over) -> dict:
    return {**minimal(), "task": "classify", "prompt": {"template": "{{ text }}", "chat": False}, **over}


def test_a_pooling_task_runs_the_pooling_runner_and_its_columns_are_reserved():
    config = cfg.RunConfig.from_dict(pooling_config())
    assert config.model["runner"] == "pooling" and config.kind is KINDS["classify"]
    assert result_spec(config).names == ["row_index", "prompt_tokens", "label", "probs", "error", "result_source"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (pooling_config(task="generate", pooling={"top_k": 2}), "pooling is set, but task is generate"),
        (pooling_config(model={"model": "m", "runner": "generate"}), "model.runner must be pooling"),
        (pooling_config(task="score"), "task: score needs prompt.pair_template"),
        (pooling_config(prompt={"template": "{{ a }}", "pair_template": "{{ b }}", "chat": False}),
         "prompt.pair_template is for task: score"),
        (pooling_config(sampling={"n": 2}), "task: classify generates no text"),
        (pooling_config(pooling={"dimensions": 4}), "pooling.dimensions is for task: embed, not task: classify"),
        (pooling_config(task="embed", pooling={"top_k": 2}), "pooling.top_k is for task: classify"),
        (pooling_config(task="score", prompt={"template": "{{ a }}", "pair_template": "{{ b }}"}),
         "prompt.pair_template makes text pairs"),
    ],
)  # fmt: skip
def test_keys_of_another_task_are_config_errors_naming_them(config, message):
    with pytest.raises(ConfigError, match=message):
        cfg.validate(config)


def test_the_fingerprint_of_a_pooling_run_follows_its_pooling_keys_and_not_sampling():
    base = cfg.content_fingerprint(cfg.validate(pooling_config()))
    assert cfg.content_fingerprint(cfg.validate(pooling_config(pooling={"top_k": 2}))) != base
    assert cfg.content_fingerprint(cfg.validate(pooling_config(sampling={"temperature": 0.5}))) == base
    assert cfg.content_fingerprint(cfg.validate(pooling_config(task="embed"))) != base


def test_a_text_pair_is_tokenized_as_the_tokenizer_joins_pairs():
    from transformers import AutoTokenizer

    from shardgen.engines.kinds import Tokenizer

    hf = AutoTokenizer.from_pretrained(MODEL)
    tok = Tokenizer(hf, 64, generates=False)
    pair, text = tok.encode_batch([("a query", "a passage"), "a text"])
    assert pair == hf("a query", "a passage")["input_ids"] and text == hf("a text")["input_ids"]
    # a prompt to pool may fill the context; one to generate from must leave a token
    assert len(Tokenizer(hf, len(text), generates=False).encode_batch(["a text"])[0]) == len(text)
    assert Tokenizer(hf, len(text)).encode_batch(["a text"])[0].reason == "prompt_too_long"


# -- LoRA adapters -----------------------------------------------------------------------------------


def lora_config(**lora) -> dict:
    return {**minimal(), "lora": {"adapters": {"a": "models/lora", "b": "models/lora"}, **lora}}


def test_declared_adapters_turn_the_engine_s_lora_support_on_and_are_fingerprinted():
    config = cfg.RunConfig.from_dict(lora_config(adapter="a"))
    assert config.model["enable_lora"] is True and config.lora.adapter == "a"
    assert cfg.content_fingerprint(cfg.validate(lora_config(adapter="a"))) != cfg.content_fingerprint(
        cfg.validate(lora_config(adapter="b"))
    )
    assert "lora" not in cfg.content_config(cfg.validate(minimal())), "runs without adapters keep their fingerprint"


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"adapter": "c"}, "lora.adapter: 'c' is not declared"),
        ({"adapter": "a", "column": "which"}, "both set"),
        ({}, "no row uses one"),
    ],
)
def test_an_adapter_not_declared_or_not_used_is_a_config_error(lora, message):
    with pytest.raises(ConfigError, match=message):
        cfg.validate(lora_config(**lora))


def test_each_row_runs_with_the_adapter_its_column_names_and_an_unknown_name_is_a_row_error():
    from shardgen.errors import RowError
    from shardgen.requests.lora import adapter_name

    lora = cfg.RunConfig.from_dict(lora_config(column="which")).lora
    assert adapter_name(lora, {"which": "b"}) == "b"
    assert adapter_name(lora, {"which": None}) is None and adapter_name(lora, {"which": ""}) is None
    with pytest.raises(RowError, match="'zz' is not one of lora.adapters"):
        adapter_name(lora, {"which": "zz"})
    assert adapter_name(cfg.RunConfig.from_dict(lora_config(adapter="a")).lora, {"which": "b"}) == "a"
    with pytest.raises(RowError, match="vLLM's CPU build would run this row with an adapter"):
        adapter_name(lora, {"which": None}, build="cpu")
    assert adapter_name(lora, {"which": "a"}, build="cpu") == "a"


def test_an_adapter_above_the_engine_s_largest_rank_or_not_an_adapter_is_a_preflight_problem(tmp_path):
    from shardgen.requests import lora

    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 24}))
    (tmp_path / "none").mkdir()
    big, missing = lora.problems({}, {"big": {"path": str(tmp_path / "big")}, "x": {"path": str(tmp_path / "none")}})
    assert "rank is 24, above model.max_lora_rank (16); set model.max_lora_rank: 32" in big
    assert missing.startswith("lora.adapters.x:") and "PEFT LoRA adapter" in missing
    assert lora.problems({"max_lora_rank": 32}, {"big": {"path": str(tmp_path / "big")}}) == []


def test_a_missing_adapter_stops_the_fetch_step_naming_it(tmp_path):
    from shardgen.models.fetch import FetchError, resolve_model

    with pytest.raises(FetchError, match="lora.adapters.mine: no such directory"):
        resolve_model({"model": str(MODEL)}, allow_download=False, adapters={"mine": str(tmp_path / "nope")})
    record = resolve_model({"model": str(MODEL)}, allow_download=False, adapters={"mine": str(MODEL)})
    assert record["adapters"]["mine"]["path"] == str(MODEL)


# -- Images ------------------------------------------------------------------------------------------


def test_an_image_cell_is_bytes_a_path_or_a_datasets_image_and_a_broken_one_is_a_row_error(tmp_path):
    import io

    from PIL import Image

    from shardgen.errors import RowError
    from shardgen.requests.images import decode

    buf = io.BytesIO()
    Image.new("L", (5, 4)).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    for cell in (buf.getvalue(), str(tmp_path / "a.png"), {"bytes": None, "path": str(tmp_path / "a.png")},
                 {"bytes": buf.getvalue(), "path": None}):  # fmt: skip
        img = decode("photo", cell)
        assert img.size == (5, 4) and img.mode == "RGB"
    for cell, why in ((b"GIF89a broken", "is not an image"), (None, "no image"), (str(tmp_path / "no.png"), "no.png")):
        with pytest.raises(RowError, match=f"column 'photo'.*{why}"):
            decode("photo", cell)


def test_images_go_before_the_text_of_the_user_message_and_need_chat_mode():
    from shardgen.requests.prompts import PromptRenderer

    r = PromptRenderer("Describe {{ topic }}.", images=["a", "b"])
    assert r.render({"topic": "x"}) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Describe x."}]}
    ]
    with pytest.raises(ConfigError, match="prompt.images"):
        PromptRenderer("{{ topic }}", chat=False, images=["a"])
    with pytest.raises(ConfigError, match="prompt.images are for task: generate"):
        cfg.validate(pooling_config(prompt={"template": "{{ text }}", "images": ["a"]}))


def test_the_keys_of_these_tasks_at_their_defaults_leave_earlier_runs_fingerprints_as_they_were():
    content = cfg.content_config(cfg.validate(minimal()))
    for section, keys in cfg.LATER_DEFAULTS.items():
        assert not set(keys) & set(content[section]), section
    assert "task" not in content and "pooling" not in content and "lora" not in content
    with_images = cfg.validate({**minimal(), "prompt": {"template": "{{ text }}", "images": ["photo"]}})
    assert cfg.content_fingerprint(with_images) != cfg.content_fingerprint(cfg.validate(minimal()))


def test_a_datasets_image_column_saved_to_disk_reaches_the_feed_as_cells_that_decode(tmp_path):
    """``input.disk`` with a ``datasets`` Image feature: the shard's rows carry ``{bytes, path}`` cells
    (how Arrow stores the feature), and each decodes to the image that was saved."""
    import datasets
    from PIL import Image

    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import build_manifest
    from shardgen.requests.images import row_images
    from tests.conftest import base_config

    colors = [(255, 0, 0), (0, 0, 255), (0, 128, 0)]
    ds = datasets.Dataset.from_dict({"id": ["a", "b", "c"], "photo": [Image.new("RGB", (6, 4), c) for c in colors]})
    ds.cast_column("photo", datasets.Image()).save_to_disk(tmp_path / "ds")
    config = base_config({"disk": str(tmp_path / "ds")}, prompt={"template": "Describe it.", "images": ["photo"]})
    manifest = Manifest(build_manifest(config))
    rows = [r for b in manifest.source().read(manifest.shard("00000").segments) for r in b.to_pylist()]
    assert set(rows[0]["photo"]) == {"bytes", "path"}
    assert [row_images(("photo",), r)[0].getpixel((0, 0)) for r in rows] == colors


def test_a_positions_log_probabilities_put_the_sampled_token_first_then_the_top_k_by_rank():
    """vLLM's dict of a position holds the top-k and the sampled token; which one was sampled is what
    OpenAI's logprobs need, and a temperature > 0 may sample any of them, or one outside the top-k."""
    from types import SimpleNamespace

    from shardgen.requests.tasks import _sample

    def lp(logprob: float, rank: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=f"t{rank}")

    inside = {3: lp(-1.5, 2), 1: lp(-0.5, 1), 7: lp(-2.0, 3)}  # sampled 3, rank 2 of the top 3
    outside = {9: lp(-6.0, 40), 1: lp(-0.2, 1), 2: lp(-1.9, 2), 4: lp(-2.2, 3)}  # sampled 9, rank 40
    out = SimpleNamespace(text="ab", token_ids=[3, 9], finish_reason="stop", index=0, logprobs=[inside, outside])
    positions = _sample(out).logprobs
    assert [[t for t, _, _ in p] for p in positions] == [[3, 1, 7], [9, 1, 2, 4]]
