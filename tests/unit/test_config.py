"""Config: the schema fills defaults, names bad keys, and the fingerprint tracks content only."""

from __future__ import annotations

import contextlib
import copy
import os
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shardgen import config as cfg
from shardgen import trust
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


def test_min_tokens_above_max_tokens_is_a_contradiction():
    c = minimal() | {"sampling": {"max_tokens": 8, "min_tokens": 9}}
    with pytest.raises(ConfigError, match=r"sampling.min_tokens \(9\) is larger than sampling.max_tokens \(8\)"):
        cfg.validate(c)


def test_a_system_prompt_without_chat_is_a_contradiction():
    c = minimal()
    c["prompt"] |= {"system": "Be brief.", "chat": False}
    with pytest.raises(ConfigError, match="prompt.system is set but prompt.chat is false"):
        cfg.validate(c)


def test_model_extra_may_not_shadow_a_model_key():
    c = minimal()
    c["model"]["extra"] = {"max_num_seqs": 4}
    with pytest.raises(ConfigError, match="model.extra.max_num_seqs: .* set model.max_num_seqs instead"):
        cfg.validate(c)


@pytest.mark.parametrize(("section", "key"), [("input.hf", "token"), ("model.extra", "hf_token")])
def test_a_token_key_in_the_config_is_refused(section, key):
    c = minimal()
    if section == "input.hf":
        c["input"] = {"hf": {"path": "x", key: "hf_secret"}}
    else:
        c["model"]["extra"] = {key: "hf_secret"}
    with pytest.raises(ConfigError, match=rf"'{section}.{key}' would put a credential in the config.*HF_TOKEN") as e:
        cfg.validate(c)
    assert "hf_secret" not in str(e.value)


@pytest.mark.parametrize("path", ["../out", "a/../../out", ".."])
def test_an_output_dir_leaving_the_working_directory_is_refused(path):
    c = minimal() | {"output": {"dir": path}}
    with pytest.raises(ConfigError, match=rf"output.dir: '{re.escape(path)}' leads outside the working directory"):
        cfg.validate(c)


def test_an_absolute_output_dir_is_taken_as_given():
    assert cfg.validate(minimal() | {"output": {"dir": "/scratch/run1"}})["output"]["dir"] == "/scratch/run1"


def test_a_template_syntax_error_is_a_config_error():
    c = minimal()
    c["prompt"]["template"] = "{% for x in rows %}{{ x }}"
    with pytest.raises(ConfigError, match="prompt.template: syntax error"):
        cfg.validate(c)


def test_trust_remote_code_gives_a_warning_naming_the_model():
    c = minimal()
    assert cfg.warnings(cfg.validate(copy.deepcopy(c))) == []
    c["model"]["trust_remote_code"] = True
    (w,) = cfg.warnings(cfg.validate(c))
    assert "trust_remote_code" in w and "'m'" in w


# Values a fuzzed config is built from: real keys, near misses, odd types.
_keys_st = st.sampled_from(
    [
        "input",
        "prompt",
        "model",
        "sampling",
        "output",
        "shards",
        "template",
        "model",
        "max_tokens",
        "dir",
        "parquet",
        "hf",
        "disk",
        "path",
        "extra",
        "max_model_len",
        "min_tokens",
        "system",
        "chat",
        "tokn",
        "",
    ]
)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys_st, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys_st, _values, max_size=6), st.booleans())
def test_fuzzed_configs_are_accepted_or_refused_with_a_config_error(data, start_valid):
    config = minimal() if start_valid else {}
    config.update(data)
    try:
        cfg.validate(config)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_fuzzed_yaml_files_load_or_give_a_config_error(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(text)
    with contextlib.suppress(ConfigError):
        cfg.load(path)


def test_template_and_messages_column_together_are_a_contradiction():
    c = minimal()
    c["prompt"]["messages_column"] = "chat"
    with pytest.raises(ConfigError, match="set exactly one of prompt.template and prompt.messages_column"):
        cfg.validate(c)


def test_choice_probs_need_choices_and_exclude_top_logprobs():
    c = minimal() | {"output": {"choice_probs": True}}
    with pytest.raises(ConfigError, match="output.choice_probs needs sampling.structured_outputs.choice"):
        cfg.validate(copy.deepcopy(c))
    c["sampling"] = {"structured_outputs": {"choice": ["a", "b"]}, "logprobs": 3}
    with pytest.raises(ConfigError, match="output.choice_probs and sampling.logprobs cannot be combined"):
        cfg.validate(c)


def test_a_max_tokens_that_could_cut_a_choice_label_is_refused_naming_the_label():
    c = minimal() | {"sampling": {"max_tokens": 7, "structured_outputs": {"choice": ["positive", "négatif"]}}}
    with pytest.raises(ConfigError, match=r"sampling.max_tokens \(7\) can cut the label 'positive'.* at least 8"):
        cfg.validate(copy.deepcopy(c))
    c["sampling"]["max_tokens"] = 8  # 'négatif' is 8 bytes too
    cfg.validate(c)


SECRET = "hf_ShardgenTestSecret0123456789abcdefXYZ"
CREDENTIALS = {
    "nested_token_key": (
        {"model": {"model": "m", "speculative_config": {"method": "ngram", "hf_token": "abc"}}},
        "'model.speculative_config.hf_token' would put a credential",
    ),
    "token_value_in_a_prompt": ({"prompt": {"template": "{{ text }}", "system": f"key {SECRET}"}}, "prompt.system"),
    "password_in_a_data_files_url": (
        {"input": {"hf": {"path": "parquet", "data_files": [f"https://me:{SECRET[3:]}@data.example/x.parquet"]}}},
        r"input.hf.data_files\[0\]: the value looks like a password in a URL",
    ),
    "signed_url": (
        {
            "input": {
                "hf": {"path": "parquet", "data_files": {"train": f"s3://b/x.parquet?X-Amz-Signature={SECRET[3:]}"}}
            }
        },
        "input.hf.data_files.train: the value looks like a credential in a URL",
    ),
    "private_key_in_extra": (
        {"model": {"model": "m", "extra": {"hf_overrides": {"k": "-----BEGIN RSA PRIVATE KEY-----\nMII"}}}},
        "model.extra.hf_overrides.k: the value looks like a private key",
    ),
}


@pytest.mark.parametrize("case", sorted(CREDENTIALS))
def test_a_credential_anywhere_in_the_config_is_refused_by_its_key_path_never_quoted(case):
    change, message = CREDENTIALS[case]
    c = minimal() | change
    with pytest.raises(ConfigError, match=message) as e:
        cfg.validate(c)
    assert SECRET not in str(e.value) and SECRET[3:] not in str(e.value)


def test_a_schema_may_name_a_property_password_without_being_a_credential():
    schema = {"type": "object", "properties": {"password": {"type": "string"}, "token": {"type": "string"}}}
    cfg.validate(minimal() | {"sampling": {"structured_outputs": {"json": schema}}})


UNSAFE_ARGS = {
    "kv_events_publisher": (
        {"extra": {"kv_events_config": {"enable_kv_cache_events": True}}},
        "model.extra.kv_events_config",
    ),
    "traces_off_the_node": ({"extra": {"otlp_traces_endpoint": "http://collector:4317"}}, "otlp_traces_endpoint"),
    "worker_class_by_name": ({"extra": {"worker_cls": "mypkg.Worker"}}, "model.extra.worker_cls: imports"),
    "logits_processor_import": ({"extra": {"logits_processors": ["mod:Proc"]}}, "logits_processors"),
    "reasoning_plugin_file": ({"extra": {"reasoning_parser_plugin": "/tmp/p.py"}}, "reasoning_parser_plugin"),
    "compilation_pass_import": (
        {"extra": {"compilation_config": {"inductor_passes": {"p": "this.s"}}}},
        "model.extra.compilation_config.inductor_passes: imports code",
    ),
    "ray_executor": ({"extra": {"distributed_executor_backend": "ray"}}, "distributed_executor_backend: 'ray'"),
    "custom_proposer": (
        {"speculative_config": {"method": "custom_class", "model": "x"}},
        "model.speculative_config: a custom proposer class",
    ),
    "dotted_proposer_model": ({"speculative_config": {"model": "my_pkg.MyProposer"}}, "custom proposer"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_ARGS))
def test_engine_arguments_that_load_code_or_open_ports_are_refused_unless_allowed_and_then_named(case):
    change, message = UNSAFE_ARGS[case]
    c = minimal()
    c["model"].update(copy.deepcopy(change))
    with pytest.raises(ConfigError, match=rf"would load code by name or reach the network: .*{message}.*"
                       "allow_unsafe_engine_args: true"):  # fmt: skip
        cfg.validate(copy.deepcopy(c))
    c["model"]["allow_unsafe_engine_args"] = True
    assert any(re.search(message, w) for w in cfg.warnings(cfg.validate(c)))


def test_everyday_engine_arguments_pass():
    c = minimal()
    c["model"]["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}
    c["model"]["extra"] = {
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]},
        "distributed_executor_backend": "mp",
        "load_format": "safetensors",
    }
    assert not [w for w in cfg.warnings(cfg.validate(c)) if "allow_unsafe" in w]


def test_the_unsafe_engine_argument_names_are_engine_arguments_of_the_installed_vllm():
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    named = set(trust.UNSAFE_ENGINE_ARGS) | set(trust.SAFE_VALUES) | set(trust.UNSAFE_SUBKEYS)
    assert named - fields == set(), "every name must be a field of vLLM's EngineArgs"


def test_structured_outputs_take_exactly_one_kind():
    c = minimal() | {"sampling": {"structured_outputs": {"choice": ["a", "b"], "regex": "a|b"}}}
    with pytest.raises(ConfigError, match="sampling.structured_outputs"):
        cfg.validate(c)


def test_a_json_schema_file_is_read_into_the_config_so_its_content_is_fingerprinted(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    c = cfg.validate(minimal() | {"sampling": {"structured_outputs": {"json": str(path)}}})
    assert c["sampling"]["structured_outputs"]["json"]["properties"]["a"] == {"type": "integer"}
    before = cfg.content_fingerprint(c)
    path.write_text('{"type": "object", "properties": {"a": {"type": "string"}}}')
    after = cfg.content_fingerprint(cfg.validate(minimal() | {"sampling": {"structured_outputs": {"json": str(path)}}}))
    assert before != after


def test_a_broken_json_schema_names_the_key(tmp_path):
    c = minimal() | {"sampling": {"structured_outputs": {"json": {"type": "objekt"}}}}
    with pytest.raises(ConfigError, match="sampling.structured_outputs.json: not a valid JSON schema"):
        cfg.validate(c)
    missing = minimal() | {"sampling": {"structured_outputs": {"json": str(tmp_path / "nope.json")}}}
    with pytest.raises(ConfigError, match="cannot read sampling.structured_outputs.json: the schema file"):
        cfg.validate(missing)


def test_a_file_that_is_not_a_json_schema_is_refused_before_its_content_reaches_the_config(tmp_path):
    """The reproduction: a kubeconfig given as the schema."""
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: []\nusers:\n- name: me\n  user: {client-key-data: LS0tQ}\n"
    )
    c = minimal() | {"sampling": {"structured_outputs": {"json": str(kubeconfig)}}}
    with pytest.raises(ConfigError, match=r"does not hold a JSON Schema \(keys that are not JSON Schema keywords: "
                       r"apiVersion, clusters, kind, users\)") as e:  # fmt: skip
        cfg.validate(c)
    assert "LS0tQ" not in str(e.value)
    notes = tmp_path / "schema.txt"
    notes.write_text('{"type": "object"}')
    with pytest.raises(ConfigError, match=r"is not a JSON Schema file; give a .json, .yaml or .yml file"):
        cfg.validate(minimal() | {"sampling": {"structured_outputs": {"json": str(notes)}}})


def test_provenance_shows_a_json_schema_by_its_digest_not_its_content():
    schema = {"type": "object", "properties": {"secret_field_name": {"type": "string"}}}
    c = cfg.validate(minimal() | {"sampling": {"structured_outputs": {"json": schema}, "max_tokens": 9}})
    published = cfg.published_sampling(c["sampling"])
    assert published["structured_outputs"] == {"json": {"digest": cfg.digest(schema)}}
    assert published["max_tokens"] == 9 and "secret_field_name" not in str(published)


def test_a_runs_config_file_is_named_by_its_content_and_a_changed_one_is_refused(tmp_path):
    a = cfg.validate(minimal())
    b = cfg.validate(minimal() | {"sampling": {"max_tokens": 9}})
    path_a, path_b = cfg.write_resolved(a, tmp_path), cfg.write_resolved(b, tmp_path)
    assert path_a != path_b, "a second config (a dry run of it, say) gets its own file"
    assert cfg.write_resolved(a, tmp_path) == path_a and cfg.load(path_a) == a
    with open(path_a, "a") as f:
        f.write(" ")  # the same content: still valid
    assert cfg.load(path_a) == a
    text = open(path_a).read().replace('"max_tokens": 256', '"max_tokens": 300')
    open(path_a, "w").write(text)
    with pytest.raises(ConfigError, match="was changed after the run wrote it"):
        cfg.load(path_a)


def test_the_submission_order_is_not_part_of_the_fingerprint_but_samples_are():
    base = cfg.content_fingerprint(cfg.validate(minimal()))
    assert (
        cfg.content_fingerprint(cfg.validate(minimal() | {"prompt": {"template": "{{ text }}", "order": "input"}}))
        == base
    )
    assert cfg.content_fingerprint(cfg.validate(minimal() | {"sampling": {"n": 2}})) != base
    assert cfg.content_fingerprint(cfg.validate(minimal() | {"output": {"samples": "list"}})) != base


def test_greedy_sampling_with_several_samples_warns():
    (w,) = cfg.warnings(cfg.validate(minimal() | {"sampling": {"n": 3, "temperature": 0}}))
    assert "every sample of a row will be the same" in w


def test_a_controller_without_vllm_asks_the_shardgen_on_path_for_the_engine_version(tmp_path, monkeypatch):
    from shardgen.base import installed

    fake = tmp_path / "shardgen"
    fake.write_text('#!/bin/sh\n[ "$SHARDGEN_ENGINE_PROBE" = 1 ] && [ "$1" = engine-version ] && echo 9.9.9\n')
    fake.chmod(0o755)
    monkeypatch.setattr(installed, "vllm", lambda: None)  # no vLLM in this environment
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cfg.engine_version.cache_clear()
    try:
        assert cfg.engine_version() == "9.9.9"
        cfg.engine_version.cache_clear()
        monkeypatch.setenv("SHARDGEN_ENGINE_PROBE", "1")  # the probe itself never probes again
        assert cfg.engine_version() == "unknown"
    finally:
        cfg.engine_version.cache_clear()


def test_the_typed_config_has_a_field_for_every_key_of_its_schema_section_and_no_other():
    import dataclasses

    for section, cls in cfg.SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == set(cfg.schema()["properties"][section]["properties"]), section
    # and a run of steps: its steps, and what shardgen sets on each step's config (shardgen.features.steps); a
    # Python step's function and a rollout, which their features read (shardgen.features.functions, .rollouts)
    sections = {"model", "sampling", "task", "steps", "step", "function", "rollout"}
    assert set(cfg.SECTIONS) | sections == set(cfg.schema()["properties"])
    # defaults come from the schema, through validation, whatever the dataclass says
    run = cfg.RunConfig.from_dict(minimal())
    for section in cfg.SECTIONS:
        typed = dataclasses.asdict(getattr(run, section))
        for key, value in run.raw[section].items():  # keys with no default (input.hf, ...) may be absent
            assert typed[key] == (tuple(value) if isinstance(value, list) else value), f"{section}.{key}"
    assert run.model.gpus == 1 and run.sampling.max_tokens == 256 and dict(run.model) == run.raw["model"]


def test_the_cpus_a_job_asks_for_follow_its_gpus_unless_set():
    def run(**model):
        return cfg.RunConfig.from_dict(minimal() | {"model": {"model": "m", **model}})

    assert run().cpus_per_job == 8
    assert run(tensor_parallel_size=4).cpus_per_job == 12
    assert run(tensor_parallel_size=4, pipeline_parallel_size=2).cpus_per_job == 20
    assert cfg.RunConfig.from_dict(minimal() | {"resources": {"cpus_per_task": 3}}).cpus_per_job == 3


ALIAS_BOMB = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
prompt: {template: "{{ topic }}", stop: *h}
"""


def test_a_yaml_alias_bomb_is_refused_before_any_walk_of_it(tmp_path):
    """A few hundred bytes that expand to 43 million values (9 to the 8th): refused at once, by the file's reader
    and by validate (Snakemake loads the --configfile itself and hands shardgen the shared structure),
    where the secret scan and the digest would have walked it for hours."""
    import time

    import yaml

    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"bomb.yaml' holds more than 100,000 values once its YAML aliases"):
        cfg.load(path)
    with pytest.raises(ConfigError, match=r"the config holds more than 100,000 values"):
        cfg.validate(minimal() | yaml.safe_load(ALIAS_BOMB))
    # the Snakefile's first walk, before validate (the whole Snakefile: tests/integration/test_preflight.py)
    with pytest.raises(ConfigError, match=r"the config holds more than 100,000 values"):
        trust.check_credentials(minimal() | yaml.safe_load(ALIAS_BOMB))
    assert time.monotonic() - started < 1


@pytest.mark.parametrize(
    ("path", "fingerprint"),
    [
        ("config/config.yaml", "d6214d1bda39ec49"),
        ("config/examples/classify.yaml", "0217b09a0e8c0aa5"),
        ("config/examples/synthetic-samples.yaml", "37007f6cff2a3067"),
    ],
)
def test_a_config_that_sets_no_new_key_keeps_its_fingerprint(path, fingerprint):
    """Pinned: a key added to the schema with a default (LATER_DEFAULTS) must not rerun every existing
    run's shards. (input.sampling_column once changed every fingerprint.)"""
    assert cfg.RunConfig.load(ROOT / path).fingerprint_with("0.32.0") == fingerprint


def test_a_config_that_sets_no_new_key_is_not_planned_again():
    """Pinned like the fingerprints: the plan's digest (plan.smk) of the demo config, as before."""
    assert cfg.plan_digest(cfg.RunConfig.load(ROOT / "config" / "config.yaml").raw, []) == "b1e0423f5ea0aba3"


def test_an_openai_batch_planned_for_score_requests_is_planned_again_for_another_task():
    """A batch of /score or /rerank requests is planned a row per pair, any other a row per line: the
    same file and shards are another plan (a Parquet input's rows do not depend on the task)."""
    batch = {"input": {"openai_batch": ["b.jsonl"]}, "shards": {"rows_per_shard": 8}}
    parquet = {"input": {"parquet": ["p.parquet"]}, "shards": {"rows_per_shard": 8}}
    assert cfg.plan_digest(batch | {"task": "score"}, []) != cfg.plan_digest(batch | {"task": "embed"}, [])
    assert cfg.plan_digest(batch | {"task": "embed"}, []) == cfg.plan_digest(batch, [])
    assert cfg.plan_digest(parquet | {"task": "score"}, []) == cfg.plan_digest(parquet, [])


def test_a_thinking_budget_without_a_reasoning_parser_is_refused_naming_both_keys():
    c = minimal() | {"sampling": {"thinking_token_budget": 64}}
    with pytest.raises(ConfigError, match=r"sampling.thinking_token_budget needs sampling.reasoning_parser: vLLM"):
        cfg.validate(c)


def test_the_reasoning_parser_is_set_once_under_sampling_not_as_an_extra_engine_argument():
    c = minimal() | {"sampling": {"reasoning_parser": "qwen3"}}
    c["model"] = {"model": "m", "extra": {"reasoning_parser": "qwen3"}}
    with pytest.raises(ConfigError, match=r"model.extra.reasoning_parser: set sampling.reasoning_parser instead"):
        cfg.validate(c)


def test_a_label_must_fit_after_the_thinking_budget_and_its_end_marker():
    sampling = {"reasoning_parser": "deepseek_r1", "thinking_token_budget": 4,
                "structured_outputs": {"choice": ["positive", "negative"]}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"sampling.max_tokens \(12\) can cut the label 'positive' short after a "
                       r"trace of sampling.thinking_token_budget \(4\) and its end marker.* at least 13"):  # fmt: skip
        cfg.validate(minimal() | {"sampling": {**sampling, "max_tokens": 12}})
    cfg.validate(minimal() | {"sampling": {**sampling, "max_tokens": 13}})


def test_the_reasoning_parser_is_in_the_fingerprint_and_a_budget_at_max_tokens_is_a_warning():
    base = cfg.content_fingerprint(cfg.validate(minimal()), "0.32.0")
    parsed = cfg.validate(minimal() | {"sampling": {"reasoning_parser": "qwen3"}})
    assert cfg.content_fingerprint(parsed, "0.32.0") != base
    budget = cfg.validate(minimal() | {"sampling": {"reasoning_parser": "qwen3", "thinking_token_budget": 256}})
    (warning,) = cfg.warnings(budget)
    assert warning.startswith("sampling.thinking_token_budget (256) is not below sampling.max_tokens (256)")


def test_a_pooling_task_refuses_a_reasoning_parser():
    c = minimal() | {"task": "embed", "sampling": {"reasoning_parser": "qwen3"}}
    with pytest.raises(ConfigError, match=r"task: embed generates no text"):
        cfg.validate(c)
