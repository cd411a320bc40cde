"""What OpenAI's batch files in and out share: the routes, the file names, the finish reasons, and the
config's check of a run that reads or writes them (registered with config)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardgen import config as cfg
from shardgen.errors import ConfigError

if TYPE_CHECKING:
    pass

OUTPUT, ERRORS, PROVENANCE = "output.jsonl", "errors.jsonl", "provenance.json"
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
# vLLM's scoring routes (vllm/entrypoints/pooling/scoring/api_router.py), which its run-batch takes too
SCORE, RERANK = ("/score", "/v1/score"), ("/rerank", "/v1/rerank", "/v2/rerank")
# the tasks OpenAI's batch format serves, and the url of each (generation without chat: COMPLETIONS;
# a score run serves SCORE and RERANK)
URLS = {"generate": CHAT, "embed": EMBEDDINGS, "score": SCORE[1]}
ALL_URLS = (CHAT, COMPLETIONS, EMBEDDINGS, *SCORE, *RERANK)
# the finish reasons a chat completion may have; vLLM's others ("abort") make the row an error line
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


# -- The config: what batch files in and out need (registered with config) --------------------------------


def check_config(config: dict[str, Any]) -> None:
    """``input.openai_batch`` (``batch_input``) and ``output.format: openai_batch`` in a run's config.

    Raises:
        ConfigError: naming the key.
    """
    if config["input"].get("openai_batch"):
        batch_input(config)
    output = config["output"]
    if output.get("format") == "openai_batch":
        if config["task"] not in URLS:
            raise ConfigError(f"output.format openai_batch is for task {', '.join(URLS)}, not {config['task']}")
        if output.get("push_to_hub"):
            raise ConfigError(
                "output.push_to_hub needs a dataset: output.format parquet, jsonl or hf, not openai_batch"
            )


def batch_input(config: dict[str, Any]) -> None:
    """input.openai_batch: the requests decide the prompt, the row id and each row's sampling; the
    settings that say so are filled in here (and refused when set otherwise).

    Raises:
        ConfigError: naming the key.
    """
    task, prompt, inputs = config["task"], config["prompt"], config["input"]
    if task not in URLS:
        raise ConfigError(f"input.openai_batch is for task {', '.join(URLS)}, not {task}")
    own_prompt = (("template", "{{ input }}"), ("messages_column", "messages"), ("pair_template", "{{ pair }}"))
    for key, own in own_prompt:
        if prompt.get(key) not in (None, own):
            raise ConfigError(f"prompt.{key}: the requests of input.openai_batch are the prompts; leave it unset")
    if URLS[task] == CHAT and prompt.get("chat", True):
        prompt["messages_column"] = "messages"
    else:  # an embedding's input, a completion's prompt, the first text of a pair to score
        prompt.update(template="{{ input }}", chat=False)
    if cfg.task_kind(config).pairs:
        prompt["pair_template"] = "{{ pair }}"  # the second text (openai_batch.request_rows)
    sampling = "body" if cfg.task_kind(config).generates else None
    for key, own in (("id_column", "custom_id"), ("sampling_column", sampling)):
        if inputs.get(key) not in (None, own):
            raise ConfigError(f"input.{key}: input.openai_batch sets it ({own}); leave it unset")
        inputs[key] = own


# before the core's checks: the settings the requests decide are filled in first
cfg.register_check(check_config, before_core=True)
