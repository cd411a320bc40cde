"""What a config may do: the trust boundaries checked before any job runs.

- Credentials: a key named like one, or a value that looks like one, at any
  depth of the config, is refused by its key path (never its value): the
  config is copied into plans, logs, stats and provenance.
- Engine arguments that import code by name or path, or open network
  endpoints, are refused unless ``model.allow_unsafe_engine_args``.
- A JSON schema given as a file must be a JSON Schema file; provenance shows
  its digest, not its content.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from shardgen.base import credentials
from shardgen.errors import ConfigError

# Keys that would put a credential in the config, where it would be copied
# into plans, logs and provenance. Tokens come from the environment only.
SECRET_KEYS = frozenset({"token", "hf_token", "use_auth_token", "api_key", "hf_api_token", "access_token"})
# Key names that hold a credential, at any depth (not inside a JSON schema, whose property names are data).
_SECRET_KEY = re.compile(
    r"(^|[_-])(token|secret|password|passwd|api_?key|apikey|credentials?|private_?key|access_?key|auth)($|[_-])"
    r"|client-(key|certificate)-data",
    re.IGNORECASE,
)
# Names that the pattern above misreads as credentials: vLLM's own, and the name of the environment
# variable that holds a server's key (engine.server.api_key_env; the schema allows only a variable's name).
NOT_SECRET_KEYS = frozenset({"thinking_token_budget", "api_key_env"})
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
    "a password in a URL": credentials.USER_PASSWORD,
    "a token in a URL": credentials.USER_TOKEN,
    "a credential in a URL": credentials.QUERY_CREDENTIAL,
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
SAFE_VALUES = {
    "distributed_executor_backend": ({None, "mp", "uni"}, "other backends import a class by name or start Ray"),
    "data_parallel_backend": ({None, "mp"}, "'ray' starts a Ray cluster (v1/engine/utils.py)"),
    "kv_offloading_backend": ({None, "native"}, "'lmcache' connects to tcp://localhost:5555 (config/vllm.py)"),
    "load_format": (
        {None, "auto", "hf", "safetensors", "pt", "npcache", "dummy", "fastsafetensors", "mistral", "sharded_state"},
        "other loaders read sockets, object stores or external packages (model_loader/)",
    ),
}
# Sub-keys of dict-valued engine arguments that import code (the rest of these arguments is safe).
UNSAFE_SUBKEYS = {
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
        elif key in SAFE_VALUES and value not in SAFE_VALUES[key][0]:
            found.append(f"{where}: {value!r}: {SAFE_VALUES[key][1]}")
        elif key in UNSAFE_SUBKEYS and isinstance(value, dict) and (bad := sorted(UNSAFE_SUBKEYS[key] & set(value))):
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


def secret_message(key: str) -> str:
    return (
        f"'{key}' would put a credential in the config: credentials are read from the environment only "
        "(the Hugging Face token: HF_TOKEN; object storage: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE or ~/.aws/credentials); remove the key"
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
            named = isinstance(key, str) and key not in NOT_SECRET_KEYS and _SECRET_KEY.search(key)
            if not in_data and named and value not in (None, "", False):
                found.append(secret_message(".".join(sub)))
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
    """Refuse a config that holds a credential anywhere (before any message could quote a value), or
    that is too large to walk (``check_size``).

    Raises:
        ConfigError: naming the key path of the first one.
    """
    check_size(config)  # the walk below visits every value an alias repeats
    found = find_credentials(config)
    if found:
        raise ConfigError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))


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


def read_json_schema(path: str) -> dict[str, Any]:
    """A JSON Schema from a file: a .json/.yaml/.yml file whose top-level keys are JSON Schema keywords.

    Anything else (a kubeconfig, a settings file) is refused before its
    content can reach the config, and from there the stats or the report.
    """
    key = "sampling.structured_outputs.json"
    if not path.endswith(JSON_SCHEMA_SUFFIXES):
        raise ConfigError(
            f"{key}: '{path}' is not a JSON Schema file; give a .json, .yaml or .yml file (or the schema inline)"
        )
    data = read_mapping(path, f"{key}: the schema file")
    keywords = _json_schema_keywords()
    other = sorted(k for k in map(str, data) if k not in keywords)
    if other or not _SHAPE_KEYWORDS & set(data):
        why = f"keys that are not JSON Schema keywords: {', '.join(other[:5])}" if other else "no type or properties"
        raise ConfigError(f"{key}: '{path}' does not hold a JSON Schema ({why}); point it at the schema file")
    return data


def check_json_schema(schema_: dict[str, Any]) -> None:
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema_).check_schema(schema_)
    except SchemaError as e:
        raise ConfigError(f"sampling.structured_outputs.json: not a valid JSON schema: {e.message}") from e


# The most values a config may hold once YAML's aliases are expanded: a real config has hundreds (a
# JSON schema for structured outputs, a chat template: thousands). An "alias bomb" of a few hundred
# bytes expands to billions, which every walk of it (the secret scan, the digest) would take hours on.
MAX_CONFIG_VALUES = 100_000


def check_size(data: Any, what: str = "the config", limit: int = MAX_CONFIG_VALUES) -> None:
    """Refuse ``data`` when it holds more than ``limit`` values, counting a value each time an alias
    repeats it: a walk that stops at the limit, so it costs at most ``limit`` steps.

    Raises:
        ConfigError: naming ``what``.
    """
    stack, seen = [data], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > limit:
            raise ConfigError(
                f"{what} holds more than {limit:,} values once its YAML aliases (&name, *name) are expanded; "
                "a config that large is a mistake or an attack (an 'alias bomb'). Write it out without aliases"
            )
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML (or JSON) file that holds a mapping; errors say which file, and what it was for."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {what} '{path}': {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} '{path}' is not valid YAML or JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys to values")
    check_size(data, f"{what} '{path}'")
    return data
