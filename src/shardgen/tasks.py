"""What a shard job does with its rows: the seam between the feed and the kind of output.

The feed (``feed.ShardFeed``) is the same for every task: it reads the
shard's rows, renders and tokenizes them a batch at a time, keeps the engine
busy, saves finished rows, counts errors and stops on a signal. A task says
the rest:

- ``spec``: the columns a row's result adds (``results.ResultSpec``), and the
  rows of an input row that got no result (``spec.error_rows``);
- ``params(index, row)``: the parameters the engine gets for that row's request;
- ``finish(row, completion)``: the output rows of an engine output, and the
  tokens it generated.

Text generation (``GenerateTask``) is one implementation; the pooling tasks
(``PoolingTask``: a classifier, a reward model, an embedding model, a
cross-encoder) are another, with the same feed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardgen import engine as eng
from shardgen import rowsampling
from shardgen.heads import POOLING_TASKS
from shardgen.results import Columns, PoolingSpec, ResultSpec, Sample, choice_first_tokens

if TYPE_CHECKING:
    from shardgen.config import RunConfig
    from shardgen.feed import Completion


@dataclass
class Finished:
    """The output rows of one input row, its first error (or None), and the tokens the engine generated."""

    rows: list[dict[str, Any]]
    error: str | None
    generated_tokens: int


class Task(Protocol):
    spec: Columns

    def params(self, index: int, row: dict[str, Any]) -> Any: ...

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished: ...


class GenerateTask:
    """Text generation: every row's request gets the run's ``SamplingParams`` (with the row's own seed
    when ``sampling.seed`` is set), and its samples become output rows (``results.ResultSpec``).

    Args:
        tokenizer: the engine's, which decides the labels' first tokens for ``output.choice_probs``.
    """

    def __init__(self, config: RunConfig, tokenizer: eng.Tokenizer) -> None:
        choices = config.sampling.choices if config.output.choice_probs else None
        self.spec = ResultSpec.of(config, choice_first_tokens(tokenizer.hf, choices) if choices else None)
        self.sampling = eng.make_sampling_params(config.sampling, self.spec.choice_token_ids)
        self.run_sampling = config.sampling
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
                self.run_sampling, row[self.sampling_column], self.sampling_column, self.spec.choice_token_ids
            )
        else:
            params = copy.copy(self.sampling)
        params.skip_clone = True
        if own_seed is not None:
            params.seed = own_seed
        elif self.seed is not None:
            params.seed = eng.row_seed(self.seed, row[self.id_column] if self.id_column else index)
        return params

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished:
        samples = [_sample(o) for o in sorted(completion.output.outputs, key=lambda o: o.index)]
        rows = self.spec.rows(row, completion.key, completion.prompt_tokens, samples)
        error = next((r["error"] for r in rows if r["error"]), None)
        return Finished(rows, error, sum(s.generated_tokens for s in samples))


def _sample(out: Any) -> Sample:
    """A ``Sample`` from one of vLLM's ``CompletionOutput``s, with its log-probabilities if asked for."""
    positions = None
    first = None
    if out.logprobs:
        positions = []
        for lp in out.logprobs:
            ranked = sorted(lp.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
            positions.append([(int(t), v.decoded_token, float(v.logprob)) for t, v in ranked])
        first = {int(t): float(v.logprob) for t, v in out.logprobs[0].items()}
    return Sample(out.text, out.finish_reason, len(out.token_ids), positions, first)


class PoolingTask:
    """A pooling model's one result per row (``classify``, ``reward``, ``embed``, ``score``): every
    request gets its own ``PoolingParams`` with the pooling task set, and the engine's pooled
    tensor becomes the row's columns (``results.PoolingSpec``).

    The task is set on every request: left unset, vLLM picks the per-token
    variant (``token_classify``/``token_embed``) where the model has one
    (vllm/v1/engine/input_processor.py: ``InputProcessor._validate_params``).
    A request's params are its own, as vLLM sets fields on them.

    Args:
        head: the model's (``heads.Head``), which decides the columns' shapes.
    """

    def __init__(self, config: RunConfig, head: Any) -> None:
        self.spec = PoolingSpec(config.task, head, config.raw["pooling"])
        self.vllm_task = "token_classify" if self.spec.per_token else POOLING_TASKS[config.task]
        pooling = config.pooling
        # a reward is the model's raw score; probabilities and normalised embeddings otherwise
        self.use_activation = pooling.use_activation if pooling.use_activation is not None else config.task != "reward"
        self.dimensions = pooling.dimensions

    def params(self, index: int, row: dict[str, Any]) -> Any:
        from vllm import PoolingParams

        return PoolingParams(task=self.vllm_task, use_activation=self.use_activation, dimensions=self.dimensions)

    def finish(self, row: dict[str, Any], completion: Completion) -> Finished:
        data = completion.output.outputs.data.tolist()
        return Finished(self.spec.rows(row, completion.key, completion.prompt_tokens, data), None, 0)


def make_task(config: RunConfig, tokenizer: eng.Tokenizer, head: Any) -> Task:
    """The run's task, for the running engine's tokenizer and the model's head."""
    if config.task == "generate":
        return GenerateTask(config, tokenizer)
    return PoolingTask(config, head)
