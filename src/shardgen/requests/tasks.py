"""The run's task (``config.task``): one class per kind, registered in ``KINDS``, and what a shard job
does with its rows.

A kind says what differs between tasks: the config keys that apply to it
(``check_config``), its part of the fingerprint (``content``), its result
columns (``columns``), whether it generates text (``generates``: sampling
applies, stats count output tokens) or needs the model's head
(``needs_head``: the fetch step's record, ``problems``).

The feed (``feed.ShardFeed``) is the same for every task: it reads the
shard's rows, renders and tokenizes them a batch at a time, keeps the engine
busy, saves finished rows, counts errors and stops on a signal. A kind's
instance, the shard job's task, says the rest:

- ``spec``: the columns a row's result adds (``results.ResultSpec``), and the
  rows of an input row that got no result (``spec.error_rows``);
- ``params(index, row)``: the parameters the engine gets for that row's request;
- ``finish(row, completion)``: the output rows of an engine output, and the
  tokens it generated.

Text generation (``GenerateTask``) is one kind; the pooling tasks
(``PoolingTask``: a classifier, a reward model, an embedding model, a
cross-encoder) are the others, with the same feed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa

from shardgen import config as cfg
from shardgen.base.registry import Registry
from shardgen.engines import kinds as eng
from shardgen.errors import ConfigError
from shardgen.models import heads
from shardgen.requests import reasoning, rowsampling
from shardgen.requests.results import (
    LABEL_PROB_TYPE,
    Columns,
    Completion,
    PoolingSpec,
    ResultSpec,
    Sample,
    choice_first_tokens,
)

if TYPE_CHECKING:
    from shardgen.config import RunConfig


@dataclass
class Finished:
    """The output rows of one input row, its first error (or None), and the tokens the engine generated."""

    rows: list[dict[str, Any]]
    error: str | None
    generated_tokens: int


class Task:
    """A kind of task (``config.task``), registered in ``KINDS``; an instance is a shard job's
    (``spec``, ``params``, ``finish``)."""

    name: ClassVar[str]
    generates: ClassVar[bool] = False
    needs_head: ClassVar[bool] = False
    # whether each prompt is a pair of texts (prompt.pair_template)
    pairs: ClassVar[bool] = False
    # the keys of `pooling` that are this task's only
    pooling_keys: ClassVar[tuple[str, ...]] = ()
    # whether its rows go through a vLLM engine (a model); one without runs them itself (``run_rows``)
    uses_engine: ClassVar[bool] = True
    # the most rows the preflight samples for ``check_rows`` (None: ``preflight.sample_rows``)
    preflight_rows: ClassVar[int | None] = None
    spec: Columns

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """The keys of a config (a dict, validated against the schema) that belong to another task.

        Raises:
            ConfigError: naming the keys.
        """
        raise NotImplementedError

    @classmethod
    def content(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The task's part of the content config (``config.content_config``)."""
        raise NotImplementedError

    @classmethod
    def columns(cls, config: RunConfig, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> Columns:
        """The result columns of a run, for the model's ``head`` (``heads.Head``; without it only the
        column names are known)."""
        raise NotImplementedError

    @classmethod
    def problems(cls, head: heads.Head, model_cfg: Mapping[str, Any], pooling: Mapping[str, Any]) -> list[str]:
        """Why the model cannot do the task, before any job (empty when it can)."""
        return []

    def params(self, index: int, row: dict[str, Any]) -> Any:
        raise NotImplementedError

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished:
        raise NotImplementedError

    @classmethod
    def chat_template_kwargs(cls, config: RunConfig) -> dict[str, Any]:
        """What the task adds to the chat template's variables (``prompt.chat_template_kwargs``): a
        rollout's ``tools``."""
        return {}

    @classmethod
    def check_model(cls, config: RunConfig, tokenizer: Any) -> tuple[list[str], list[str]]:
        """The preflight's check of what the task adds, with the model's (Hugging Face) tokenizer:
        (problems, notes)."""
        return [], []

    def turns(self) -> Any:
        """A task whose rows come back to the engine (``feed.Turns``: a rollout's conversations), or None."""
        return None

    # -- A task without an engine (``uses_engine`` false) -------------------------------------------------

    def run_rows(self, work: Any, stop: Any, counters: Any) -> dict[str, Any]:
        """The shard's remaining rows (``feed.ShardWork``) into its checkpoint, until done or ``stop()``,
        counted in ``counters`` (``stats.AttemptCounters``); returns what it saw (the stats' ``feed``)."""
        raise NotImplementedError

    @classmethod
    def provenance(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """What the output's provenance names besides the model (a task without an engine: instead of it):
        code the run called. Paths in it are shortened unless ``output.provenance_paths``."""
        return {}

    @classmethod
    def check_rows(cls, config: RunConfig, rows: list[tuple[int, dict[str, Any]]], schema: pa.Schema) -> tuple:
        """The preflight's check of the task on sample ``rows`` of ``schema``: (problems, notes), and
        optionally a dict of fields for the preflight's report (a function's ``function_calls``)."""
        return [], []


# Output keys that change what a shard file holds (its columns), not just the merged file's format.
CONTENT_OUTPUT_KEYS = ("samples", "choice_probs")


class GenerateTask(Task):
    """Text generation: every row's request gets the run's ``SamplingParams`` (with the row's own seed
    when ``sampling.seed`` is set), and its samples become output rows (``results.ResultSpec``); with
    ``sampling.reasoning_parser``, each sample's trace apart from its answer (``reasoning.Splitter``).

    Args:
        tokenizer: the engine's, which decides the labels' first tokens for ``output.choice_probs``
            and the reasoning parser's markers.
    """

    name = "generate"
    generates = True

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        model, prompt = config["model"], config["prompt"]
        if model.get("runner") == "pooling":
            raise ConfigError("model.runner is pooling, but task is generate: set task (classify, embed, ...)")
        pooling_keys = (("pooling", any(v is not None for v in config["pooling"].values())),
                        ("prompt.pair_template", prompt.get("pair_template") is not None))  # fmt: skip
        for key, given in pooling_keys:
            if given:
                raise ConfigError(f"{key} is set, but task is generate: it is for the pooling tasks (task: ...)")

    @classmethod
    def content(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """Sampling and the output's columns, without ``task``: the fingerprints of generation runs made
        before ``task`` existed stay as they were."""
        out = {
            "sampling": config.get("sampling", {}),
            "output": {k: config["output"].get(k) for k in CONTENT_OUTPUT_KEYS},
        }
        if config.get("sampling", {}).get("logprobs") is not None or config["input"].get("sampling_column"):
            # each position's log-probabilities list the sampled token first (results.py), and a run with
            # a sampling column has the column: shards made before are not this run's
            out["logprobs"] = "sampled first"
        return out

    @classmethod
    def columns(cls, config: RunConfig, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> Columns:
        return ResultSpec.of(config, choice_token_ids)

    def __init__(self, config: RunConfig, tokenizer: eng.Tokenizer, head: Any = None) -> None:
        choices = config.sampling.choices if config.output.choice_probs else None
        self.spec = ResultSpec.of(config, choice_first_tokens(tokenizer.hf, choices) if choices else None)
        self.run_sampling: Mapping[str, Any] = config.sampling
        self.splitter = None
        if name := config.sampling.reasoning_parser:
            self.splitter = reasoning.Splitter.of(name, tokenizer.hf, config.prompt.chat_template_kwargs)
            if self.splitter.keep_special_tokens and "skip_special_tokens" not in config.sampling:
                self.run_sampling = {**config.sampling, "skip_special_tokens": False}
        # the engine kind's parameters: vLLM's SamplingParams in process, plain attributes for the others
        self.make_params = eng.KINDS[config.engine.kind].sampling_params
        self.sampling = self.make_params(self.run_sampling, self.spec.choice_token_ids)
        self.seed = config.sampling.seed
        self.id_column = config.input.id_column
        self.sampling_column = config.input.sampling_column

    def params(self, index: int, row: dict[str, Any]) -> Any:
        """The request's own ``SamplingParams``: a shallow copy of the run's, marked ``skip_clone``.

        vLLM deep-copies the params of every request it is given unless they
        are marked as the request's own (``InputProcessor.process_inputs``,
        ``SamplingParams.clone``): 55 us a row measured here, about 5% of a
        feed-bound row, and twice that with a row seed. A shallow copy is the
        request's own at the top level, where vLLM sets what is per request
        (the seed, the stop ids from the generation config); what stays
        shared (the labels, the schema, the token ids to score) is the same
        for every request of a run, which is what ``skip_clone`` asks for.
        A row with its own sampling (``input.sampling_column``) gets its own
        params (``rowsampling.sampling_params``).

        Raises:
            RowError: the row's own sampling is not valid.
        """
        own_seed = None
        if self.sampling_column and row.get(self.sampling_column) is not None:  # input.sampling_column
            params, own_seed = rowsampling.sampling_params(
                self.run_sampling, row[self.sampling_column], self.sampling_column, self.spec.choice_token_ids,
                own_n=self.spec.as_list, make=self.make_params,
            )  # fmt: skip
        else:
            params = copy.copy(self.sampling)
        params.skip_clone = True
        if own_seed is not None:
            params.seed = own_seed
        elif self.seed is not None:
            params.seed = eng.row_seed(self.seed, row[self.id_column] if self.id_column else index)
        return params

    def sample(self, out: Any, prompt_token_ids: Any = None) -> Sample:
        """One of vLLM's ``CompletionOutput``s as a ``Sample`` (with a reasoning parser: its answer apart
        from its trace)."""
        return _sample(out, self.splitter, prompt_token_ids)

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished:
        out = completion.output
        samples = [self.sample(o, out.prompt_token_ids) for o in sorted(out.outputs, key=lambda o: o.index)]
        rows = self.spec.rows(row, completion.key, completion.prompt_tokens, samples)
        error = next((r["error"] for r in rows if r["error"]), None)
        return Finished(rows, error, sum(s.generated_tokens for s in samples))


def _sample(out: Any, splitter: reasoning.Splitter | None = None, prompt_token_ids: Any = None) -> Sample:
    """A ``Sample`` from one of vLLM's ``CompletionOutput``s, with its log-probabilities if asked for;
    with a ``splitter``, its answer apart from its trace, and the label probabilities of the answer's
    first position (the position after the end marker), not the trace's."""
    split = splitter.split(out.text, out.token_ids, out.finish_reason, prompt_token_ids) if splitter else None
    answer_at = split.reasoning_tokens if split else 0
    positions = None
    first = None
    if out.logprobs:
        positions = []
        # the sampled token first (which the top-k alone would not tell: OpenAI's logprobs need it),
        # then the top-k, most likely first
        for sampled, lp in zip(out.token_ids, out.logprobs, strict=False):
            ranked = sorted(
                lp.items(), key=lambda kv: (kv[0] != sampled, kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob)
            )
            positions.append([(int(t), v.decoded_token, float(v.logprob)) for t, v in ranked])
        if answer_at < len(out.logprobs) and not (split and split.error):
            first = {int(t): float(v.logprob) for t, v in out.logprobs[answer_at].items()}
    if split is None:
        return Sample(out.text, out.finish_reason, len(out.token_ids), positions, first)
    return Sample(split.answer, out.finish_reason, len(out.token_ids), positions, first,
                  split.reasoning, split.reasoning_tokens, split.error)  # fmt: skip


class PoolingTask(Task):
    """A pooling model's one result per row (``classify``, ``reward``, ``embed``, ``score``): every
    request gets its own ``PoolingParams`` with the pooling task set, and the engine's pooled
    tensor becomes the row's columns (``results.PoolingSpec``, with the kind's ``pooled_fields``
    and ``pooled`` values).

    The task is set on every request: left unset, vLLM picks the per-token
    variant (``token_classify``/``token_embed``) where the model has one
    (vllm/v1/engine/input_processor.py: ``InputProcessor._validate_params``).
    A request's params are its own, as vLLM sets fields on them.

    Args:
        head: the model's (``heads.Head``), which decides the columns' shapes.
    """

    needs_head = True
    # the pooling task of each request (vllm/pooling_params.py: PoolingParams.task); a per-token
    # reward model pools every token
    pooling_task: ClassVar[str] = "classify"
    # whether the pooled values go through the model's activation (pooling.use_activation unset)
    activation: ClassVar[bool] = True
    # whether the model's head must have one output (a reward model or cross-encoder)
    one_output: ClassVar[bool] = False

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """The keys that belong to another task; the task gets vLLM's pooling runner."""
        task, model, prompt = cls.name, config["model"], config["prompt"]
        if prompt.get("images"):
            raise ConfigError(f"prompt.images are for task: generate (a vision-language model), not task: {task}")
        if model.get("runner") == "generate":
            raise ConfigError(f"task: {task} pools the prompt: model.runner must be pooling (or unset), not generate")
        model["runner"] = model.get("runner") or "pooling"
        if cls.pairs != (prompt.get("pair_template") is not None):
            raise ConfigError(
                f"task: {task} needs prompt.pair_template (the second text of each pair)"
                if cls.pairs
                else f"prompt.pair_template is for task: score, not task: {task}"
            )
        pooling = config["pooling"]
        owners = {key: kind.name for kind in KINDS.values() for key in kind.pooling_keys}
        for key in sorted(owners):
            if pooling.get(key) is not None and owners[key] != task:
                raise ConfigError(f"pooling.{key} is for task: {owners[key]}, not task: {task}")
        sampling = config.get("sampling") or {}
        text_keys = ("structured_outputs", "reasoning_parser", "thinking_token_budget")
        if any(sampling.get(k) for k in text_keys) or sampling.get("n", 1) > 1 or config["output"].get("choice_probs"):
            raise ConfigError(f"task: {task} generates no text: drop sampling and output.choice_probs")

    @classmethod
    def content(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return {"task": cls.name, "pooling": config.get("pooling", {})}

    @classmethod
    def columns(cls, config: RunConfig, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> Columns:
        return PoolingSpec(cls, head, config.raw.get("pooling") or {})

    @classmethod
    def problems(cls, head: heads.Head, model_cfg: Mapping[str, Any], pooling: Mapping[str, Any]) -> list[str]:
        """A classifier, a reward model and a cross-encoder need a classification head (a per-token
        reward model pools every token)."""
        task, name = cls.name, model_cfg.get("model")
        overrides = (model_cfg.get("extra") or {}).get("hf_overrides") or {}
        if head.per_token_reward:
            return []
        if "classifier_from_token" not in overrides and not (head.has_head and heads.is_classifier(head)):
            return [
                f"task: {task} needs a model with a classification head, and {name} has none "
                f"(architectures {list(head.architectures)}, no score/classifier weights): vLLM would run it "
                "with an uninitialised head and every row would get a meaningless label. Use a "
                "*ForSequenceClassification checkpoint, or task: embed"
            ]
        if cls.one_output and len(head.labels) != 1:
            return [
                f"task: {task} needs a model with one output (a reward model or cross-encoder); {name} has "
                f"{len(head.labels)} labels {list(head.labels)[:8]}: use task: classify"
            ]
        return []

    @classmethod
    def pooled_fields(cls, spec: PoolingSpec) -> list[pa.Field]:
        """The task's columns, between ``prompt_tokens`` and ``error``."""
        raise NotImplementedError

    @classmethod
    def pooled(cls, spec: PoolingSpec, data: list[Any]) -> dict[str, Any]:
        """The task's columns of a row whose pooled output is ``data`` (the engine's tensor as a list)."""
        raise NotImplementedError

    def __init__(self, config: RunConfig, tokenizer: eng.Tokenizer | None = None, head: Any = None) -> None:
        self.spec = self.columns(config, head)
        self.vllm_task = "token_classify" if self.spec.per_token else self.pooling_task
        pooling = config.pooling
        self.use_activation = pooling.use_activation if pooling.use_activation is not None else self.activation
        self.dimensions = pooling.dimensions
        self.make_params = eng.KINDS[config.engine.kind].pooling_params

    def params(self, index: int, row: dict[str, Any]) -> Any:
        return self.make_params(self.vllm_task, self.use_activation, self.dimensions)

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished:
        data = completion.output.outputs.data.tolist()
        return Finished(self.spec.rows(row, completion.key, completion.prompt_tokens, data), None, 0)


def _flat(data: list[Any]) -> list[Any]:
    return [x for v in data for x in (v if isinstance(v, list) else [v])]


class ClassifyTask(PoolingTask):
    """``label``, the most likely class, and ``probs``, each class's probability as a struct with a
    float32 field per class named by the model's ``id2label``; with ``pooling.top_k``, ``probs`` is
    instead the k most likely classes, a list of ``{label, prob}``, most likely first."""

    name = "classify"
    pooling_keys = ("top_k",)

    @classmethod
    def problems(cls, head: heads.Head, model_cfg: Mapping[str, Any], pooling: Mapping[str, Any]) -> list[str]:
        out = super().problems(head, model_cfg, pooling)
        if (pooling.get("top_k") or 0) > len(head.labels):
            out.append(f"pooling.top_k ({pooling['top_k']}) is more than the model's {len(head.labels)} labels")
        if len(set(head.labels)) != len(head.labels):
            out.append(
                f"the model's id2label names a label twice ({list(head.labels)}): the probs columns need distinct names"
            )
        return out

    @classmethod
    def pooled_fields(cls, spec: PoolingSpec) -> list[pa.Field]:
        probs = LABEL_PROB_TYPE if spec.top_k else pa.struct([(label, pa.float32()) for label in spec.labels])
        return [pa.field("label", pa.string()), pa.field("probs", probs)]

    @classmethod
    def pooled(cls, spec: PoolingSpec, data: list[Any]) -> dict[str, Any]:
        spec.expect(len(data), len(spec.labels), "class probabilities", "id2label's labels")
        ranked = sorted(range(len(data)), key=lambda i: -data[i])
        if spec.top_k:
            probs: Any = [{"label": spec.labels[i], "prob": data[i]} for i in ranked[: spec.top_k]]
        else:
            probs = dict(zip(spec.labels, data, strict=True))
        return {"label": spec.labels[ranked[0]], "probs": probs}


class RewardTask(PoolingTask):
    """``reward``, float32 (a list of float32, one per prompt token, for a per-token reward model).

    A reward model is a classifier with one output (vLLM 0.32 has no "reward" task: the docstring of
    vllm/entrypoints/pooling/offline.py: encode); its reward is the model's raw score.
    """

    name = "reward"
    activation = False
    one_output = True

    @classmethod
    def pooled_fields(cls, spec: PoolingSpec) -> list[pa.Field]:
        return [pa.field("reward", pa.list_(pa.float32()) if spec.per_token else pa.float32())]

    @classmethod
    def pooled(cls, spec: PoolingSpec, data: list[Any]) -> dict[str, Any]:
        flat = _flat(data)
        return {"reward": flat if spec.per_token else flat[0]}


class EmbedTask(PoolingTask):
    """``embedding``, a fixed-size list of float32 (the Arrow type vector indexes read), of the
    model's embedding size or ``pooling.dimensions``; normalised unless ``pooling.use_activation``
    says otherwise."""

    name = "embed"
    pooling_task = "embed"
    pooling_keys = ("dimensions",)

    @classmethod
    def problems(cls, head: heads.Head, model_cfg: Mapping[str, Any], pooling: Mapping[str, Any]) -> list[str]:
        if not heads.is_classifier(head):
            return []
        # vLLM runs such a checkpoint as a classifier (its pooler has no embed task), so every row would
        # be refused; convert="embed" on it picks the Transformers backend instead (docs/dev/vllm-pooling.md)
        return [
            f"task: embed on {model_cfg.get('model')}, a classifier ({list(head.architectures)}): vLLM serves it "
            "only as one; use task: classify, or embed with the base model it was trained from"
        ]

    @classmethod
    def pooled_fields(cls, spec: PoolingSpec) -> list[pa.Field]:
        return [pa.field("embedding", pa.list_(pa.float32(), spec.dim) if spec.dim else pa.list_(pa.float32()))]

    @classmethod
    def pooled(cls, spec: PoolingSpec, data: list[Any]) -> dict[str, Any]:
        if spec.dim:
            spec.expect(len(data), spec.dim, "embedding values", "the declared embedding size")
        return {"embedding": data}


class ScoreTask(PoolingTask):
    """``score``, float32, the cross-encoder's score of the pair of ``prompt.template`` and
    ``prompt.pair_template``."""

    name = "score"
    pairs = True
    one_output = True

    @classmethod
    def pooled_fields(cls, spec: PoolingSpec) -> list[pa.Field]:
        return [pa.field("score", pa.float32())]

    @classmethod
    def pooled(cls, spec: PoolingSpec, data: list[Any]) -> dict[str, Any]:
        return {"score": _flat(data)[0]}


# Every task, by its name (the schema's `task` enum, in its order); config asks for them there.
KINDS: dict[str, type[Task]] = Registry(
    {kind.name: kind for kind in (GenerateTask, ClassifyTask, RewardTask, EmbedTask, ScoreTask)}
)
cfg.register_tasks(KINDS)


def make_task(config: RunConfig, tokenizer: eng.Tokenizer, head: Any) -> Task:
    """The run's task, for the running engine's tokenizer and the model's head."""
    return config.kind(config, tokenizer, head)
