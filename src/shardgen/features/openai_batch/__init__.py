"""OpenAI's Batch API result format (``output.format: openai_batch``): the merged rows as the two files
a batch of requests gives back, so that code written for a hosted batch API reads a shardgen run.

``<dir>/openai/`` holds:

- ``output.jsonl``: a line per request that got a result, in input order:
  ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``,
  the body a chat completion (``task: generate``: a choice per sample, with
  its ``message``, ``finish_reason``, ``index`` and ``logprobs``; ``usage``
  with the prompt, completion and total tokens), a text completion for a
  ``/v1/completions`` request of ``input.openai_batch`` (``text`` for
  ``message``, OpenAI's completions ``logprobs``), or an embedding list
  (``task: embed``). A request that asked for log-probabilities (the run's
  ``sampling.logprobs``, or its own ``logprobs``/``top_logprobs``) gets them
  from the ``logprobs`` column: the sampled token of each position, and the
  ``top_logprobs`` most likely; the others get ``logprobs: null``. A
  ``task: score`` run gives vLLM's ``ScoreResponse`` (``data``: a score per
  pair, in the request's order) or, for a ``/rerank`` request, its
  ``RerankResponse`` (``results``: the documents by relevance, most relevant
  first, the ``top_n`` first when the request sets it), whose ``usage`` counts
  every pair's prompt tokens;
- ``errors.jsonl``: a line per request that did not, in input order, with
  ``status_code`` 400 and an ``error`` body: shardgen's per-row error as the
  ``message``, its reason (the error's first word) as the ``code``;
- ``provenance.json``: the run's provenance and the SHA-256 of both files.

A request's ``custom_id`` is its ``input.id_column`` value, else its row
index. Ids are deterministic (``batch_req_<row>``, ``chatcmpl-<row>``), so a
rerun writes the same lines. The files' shape is what the ``openai``
package's types accept (``openai.types.chat.ChatCompletion``,
``openai.types.CreateEmbeddingResponse``), and for scores vLLM's own
(``vllm.entrypoints.pooling.scoring.protocol``: ``ScoreResponse``,
``RerankResponse``; OpenAI has none), which the tests check.

Requests in (``input.openai_batch``, ``request_rows``): ``/v1/chat/completions``
and ``/v1/completions`` for ``task: generate``, ``/v1/embeddings`` for ``task:
embed``, and what vLLM's ``run-batch`` takes for a cross-encoder, ``/score``,
``/v1/score``, ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``, for ``task:
score``. A score request pairs its texts as vLLM does (``text_1`` with
``text_2``, or ``queries`` with ``documents`` or ``items``, or ``data_1`` with
``data_2``: one with each of N, or the i-th with the i-th), a rerank request
its ``query`` with each of its ``documents``; each pair is a row of its own
(the first text ``input``, the second ``pair``, its place ``pair_index``),
scored by its own engine request as vLLM scores it, and the merge gives the
request's pairs back as one result line.
"""

# each part registers with the core when imported: the config check, the source kind, the output format
from shardgen.features.openai_batch import api, requests_in, results_out  # noqa: F401
