"""Multi-turn rollouts with tools (``rollout``): each row is a conversation the model carries on,
calling Python tools.

A row starts as its prompt (``prompt``, a chat). When a turn ends with tool calls (parsed by the
named vLLM tool parser, ``rollout.tool_parser``; with ``tool_choice: required`` or a tool's name, the
turn is constrained to a valid call by vLLM's structured outputs, the JSON schema vLLM's own server
uses: ``vllm/tool_parsers/utils.py: get_json_schema_from_tools``), the tools run in worker processes
(pebble's ``ProcessPool``, as Python steps' functions do: a call past ``tool_timeout_seconds`` has its
process replaced), their results are appended, and the row's next turn goes to the engine at once,
while the engine goes on with the other rows (``feed.Turns``: the feeder asks between engine steps).
A tool that raises, hangs or dies gives the model an error message, not the row an error. A row ends
with a turn that calls no tool, or after ``max_turns`` turns (``finish_reason: max_turns``; the last
turn's calls are run, so that every call in ``messages`` has its result).

Columns: ``messages`` (the whole conversation in OpenAI's chat format, JSON text), ``turns`` and
``tool_calls``; ``generation`` is the last assistant message's text, and the token counts are summed
over the turns. With a reasoning parser each assistant message keeps its turn's trace in
``reasoning``.

Exactly once: a finished conversation is checkpointed as its row is; a conversation that was not
finished when its job died starts again from its first turn in the next attempt. Its turns are not
saved one by one: a tool may have side effects or depend on the time, so the only conversation
that is known whole is a finished one (a seeded row asks the same first turn again).

The tools' files (or modules' versions) are in the run's fingerprint; the preflight imports each on
the login node, builds its JSON schema from its signature and docstring (``transformers``'
``get_json_schema``, unless the config gives ``schema``), and runs it once on ``example``
arguments where the config gives them.
"""

# the task registers with config when imported
from shardgen.features.rollouts import calls, conversations, task, tools  # noqa: F401
