"""The feed of a shard's rows to the engine: prepared a small batch at a time, kept ahead of the
engine, saved as they finish.

Three layers, each with its own state:

- ``prepared_requests``: the shard's remaining rows, rendered and tokenized
  ``PREPARE_BATCH`` at a time (one call of the chat template and one of the
  fast tokenizer per batch, several times cheaper per row than a call per
  row), pulled only when the engine has room. With ``prompt.order: prefix``
  a moving window of up to ``order_window`` prepared requests gives out the
  one whose tokens sort first, so prompts that share a prefix are submitted
  together and hit the prefix cache before it is evicted; the window fills
  while the engine already runs, so nothing waits for a whole block.
- ``Feeder``: keeps ``window`` requests in flight in the engine (more than its
  ``max_num_seqs``, so its scheduler always has requests waiting), and yields
  each completion as soon as it finishes. This is what ``LLM.generate`` does
  internally (``add_request`` + ``step``), minus holding every prompt and
  every output at once.
- ``ShardFeed``: one shard's loop: the task turns completions into output
  rows, finished rows are saved every ``checkpoint.rows`` rows or
  ``checkpoint.seconds`` seconds, errors count against the error budget,
  progress is reported, and SIGTERM/SIGINT stop it after a last save.
"""
