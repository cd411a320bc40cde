"""Config: the schema fills defaults, names bad keys, and the fingerprint tracks content only."""

from __future__ import annotations

import copy

import pytest
import yaml

from shardgen import config as cfg
from shardgen.errors import ConfigError
from tests.conftest import ROOT


def minimal() -> dict:
    return {
        "input": {"parquet": ["data/*.parquet"]},
        "prompt": {"template": "{{ text }}"},
        "model": {"model": "m"},
    }


def test_defaults_are_filled_in_every_section():
    c = cfg.validate(minimal())
    assert c["shards"]["rows_per_shard"] == 10000
    assert c["prompt"]["chat"] is True and c["prompt"]["system"] is None
    assert c["model"]["enable_prefix_caching"] is True and c["model"]["trust_remote_code"] is False
    assert c["sampling"]["max_tokens"] == 256
    assert c["output"]["dir"] == "results"
    assert c["checkpoint"] == {"rows": 1000, "seconds": 300}


def test_the_example_config_is_valid():
    cfg.load(ROOT / "config" / "config.yaml")


def test_an_unknown_key_is_named_with_the_nearest_valid_one():
    c = minimal()
    c["shards"] = {"rows_per_shrd": 5}
    with pytest.raises(ConfigError, match=r"unknown key 'shards.rows_per_shrd' \(did you mean 'rows_per_shard'\?\)"):
        cfg.validate(c)


def test_an_unknown_top_level_key_is_named():
    c = minimal() | {"sampling_params": {}}
    with pytest.raises(ConfigError, match="unknown key 'sampling_params' \\(did you mean 'sampling'"):
        cfg.validate(c)


def test_a_wrong_type_names_the_key_path():
    c = minimal()
    c["model"]["max_model_len"] = "long"
    with pytest.raises(ConfigError, match=r"model.max_model_len: 'long' is not of type"):
        cfg.validate(c)


def test_two_inputs_at_once_are_refused():
    c = minimal()
    c["input"]["disk"] = "ds"
    with pytest.raises(ConfigError, match="exactly one of input.parquet, input.hf or input.disk"):
        cfg.validate(c)


def test_max_tokens_must_leave_room_for_the_prompt():
    c = minimal()
    c["model"]["max_model_len"] = 512
    c["sampling"] = {"max_tokens": 512}
    with pytest.raises(ConfigError, match=r"sampling.max_tokens \(512\) must be smaller than model.max_model_len"):
        cfg.validate(c)


def test_fingerprint_changes_with_a_sampling_key():
    a = cfg.validate(minimal())
    b = copy.deepcopy(a)
    b["sampling"]["temperature"] = 0.7
    assert cfg.content_fingerprint(a) != cfg.content_fingerprint(b)


def test_fingerprint_ignores_memory_and_speed_settings():
    a = cfg.validate(minimal())
    b = copy.deepcopy(a)
    b["model"].update(gpu_memory_utilization=0.5, max_num_seqs=8, enforce_eager=True)
    b["resources"]["runtime"] = 999
    b["checkpoint"]["rows"] = 7
    assert cfg.content_fingerprint(a) == cfg.content_fingerprint(b)


def _keys(node: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.get("properties", {}).items():
        out.add(prefix + k)
        out |= _keys(v, prefix + k + ".")
    return out


def test_every_schema_key_has_a_description_and_is_documented_in_config_readme():
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    readme = (ROOT / "config" / "README.md").read_text()

    def walk(node, path):
        for k, v in node.get("properties", {}).items():
            assert v.get("description"), f"{path}{k} has no description"
            walk(v, f"{path}{k}.")

    walk(schema, "")
    missing = sorted(k for k in _keys(schema) if f"`{k}`" not in readme)
    assert not missing, f"config/README.md does not document: {missing}"
