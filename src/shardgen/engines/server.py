"""The server engine (``engine.kind: server``): an OpenAI-compatible server behind the engine interface the
feed uses (``engine.Engine``: ``start``, ``tokenizer``, ``submit``, ``step``, ``abort``, ``close``).

Either the job starts the server (``engine.server.preset``: the launch line of vLLM, SGLang, TensorRT-LLM or
LMDeploy for the config's model, parallel sizes and memory settings; or ``engine.server.command``), bound to
127.0.0.1 on a free port with a random API key, waited for with a bounded readiness check that logs as it
waits, its output in the job's log, stopped with the job; or it reaches a running one
(``engine.server.url``, its key from the environment variable ``engine.server.api_key_env`` names, never from
the config).

The feed keeps its window of requests in flight as with vLLM in process: each request is a
``/v1/completions`` call on the prompt's token ids (the feed's own, so a row's prompt is the same as in
process), made by the ``openai`` client in a pool of threads, with the client's retries of 429 and 5xx
answers and connection errors (``engine.server.max_retries``) and a per-request timeout
(``engine.server.request_timeout_seconds``). A request the server refuses (400, 422) is its row's
``rejected_by_engine`` error; a server that cannot answer fails the attempt, whose retry resumes.

What a server run serves: text generation with the ``sampling`` settings, ``n`` samples, per-row sampling;
on vLLM's server also structured outputs (vLLM's ``structured_outputs`` fields), log-probabilities, the
labels' probabilities, rollouts and LoRA adapters by name (docs/engines.md). What it does not (yet) is
refused when the run plans, naming the key (``check_config``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shardgen import config as cfg
from shardgen.engines import kinds as eng
from shardgen.errors import ConfigError, ShardgenError
from shardgen.requests.results import ENGINE, EngineRequest

log = logging.getLogger(__name__)

KIND = "server"
HOST = "127.0.0.1"
# How often the readiness check looks, and how often it says it still waits.
POLL_SECONDS, SAY_EVERY_SECONDS = 1.0, 30.0
# How long a step waits for a request to finish before it returns none (the feed then looks at its stop flag).
STEP_WAIT_SECONDS = 0.2
# The key the job gives a server it starts (in its environment, never on its command line).
API_KEY_ENV = "SHARDGEN_SERVER_API_KEY"


class ServerFailed(ShardgenError):
    """The server did not start, died, or cannot answer: the attempt fails (its retry resumes)."""


# -- The launch lines ---------------------------------------------------------------------------------


def _flag(name: str, value: Any) -> list[str]:
    """One engine argument as a command-line flag, as vLLM's CLI spells it (``--max-model-len 1024``;
    booleans ``--enforce-eager`` / ``--no-enforce-eager``; dicts and lists as JSON)."""
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + name.replace("_", "-")]
    if isinstance(value, dict | list):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _vllm(model: Mapping[str, Any], port: int, adapters: Mapping[str, str]) -> list[str]:
    """vLLM's OpenAI-compatible server (``vllm serve``; the module, which the CPU build's ``vllm`` command
    cannot run: its CLI reads the ``vllm`` distribution's metadata) with every engine argument of the
    config (vllm/engine/arg_utils.py: each ``EngineArgs`` field is a flag), the key from ``VLLM_API_KEY``,
    and the run's LoRA adapters served by their names (``--lora-modules`` in its JSON form,
    vllm/entrypoints/launchers/cli_args.py: ``LoRAParserAction``), which a request names as its model."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", HOST, "--port", str(port),
           "--disable-uvicorn-access-log"]  # a line per request would fill the shard's log  # fmt: skip
    for name, value in model.items():
        if name in ("disable_log_stats",):
            continue
        cmd += _flag(name, value)
    if adapters:
        cmd += ["--lora-modules", *(json.dumps({"name": n, "path": p}) for n, p in sorted(adapters.items()))]
    return cmd


# SGLang (python/sglang/srt/server_args.py), TensorRT-LLM (tensorrt_llm/commands/serve.py) and LMDeploy
# (lmdeploy/cli/serve.py): the config's keys each one has a flag for. Built from their documentation only:
# none of them is installed here (docs/engines.md).
_SGLANG_FLAGS = {
    "tensor_parallel_size": "--tp-size",
    "pipeline_parallel_size": "--pp-size",
    "dtype": "--dtype",
    "max_model_len": "--context-length",
    "gpu_memory_utilization": "--mem-fraction-static",
    "max_num_seqs": "--max-running-requests",
    "quantization": "--quantization",
    "kv_cache_dtype": "--kv-cache-dtype",
    "seed": "--random-seed",
}
_TRTLLM_FLAGS = {
    "tensor_parallel_size": "--tp_size",
    "pipeline_parallel_size": "--pp_size",
    "max_model_len": "--max_seq_len",
    "max_num_seqs": "--max_batch_size",
    "gpu_memory_utilization": "--kv_cache_free_gpu_memory_fraction",
}
_LMDEPLOY_FLAGS = {
    "tensor_parallel_size": "--tp",
    "max_model_len": "--session-len",
    "max_num_seqs": "--max-batch-size",
    "gpu_memory_utilization": "--cache-max-entry-count",
    "dtype": "--dtype",
}


def _mapped(model: Mapping[str, Any], flags: Mapping[str, str]) -> list[str]:
    return [part for key, flag in flags.items() if model.get(key) is not None for part in (flag, str(model[key]))]


def _sglang(model: Mapping[str, Any], port: int, adapters: Mapping[str, str]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model["model"]),
           "--host", HOST, "--port", str(port), "--api-key", "{api_key}"]  # fmt: skip
    if model.get("trust_remote_code"):
        cmd.append("--trust-remote-code")
    return cmd + _mapped(model, _SGLANG_FLAGS)


def _trtllm(model: Mapping[str, Any], port: int, adapters: Mapping[str, str]) -> list[str]:
    cmd = ["trtllm-serve", "serve", str(model["model"]), "--host", HOST, "--port", str(port), "--backend", "pytorch"]
    if model.get("trust_remote_code"):
        cmd.append("--trust_remote_code")
    return cmd + _mapped(model, _TRTLLM_FLAGS)


def _lmdeploy(model: Mapping[str, Any], port: int, adapters: Mapping[str, str]) -> list[str]:
    cmd = ["lmdeploy", "serve", "api_server", str(model["model"]), "--server-name", HOST,
           "--server-port", str(port), "--api-keys", "{api_key}"]  # fmt: skip
    if model.get("trust_remote_code"):
        cmd.append("--trust-remote-code")
    return cmd + _mapped(model, _LMDEPLOY_FLAGS)


# preset -> (its launch line for the engine arguments and port, whether it takes the job's API key)
PRESETS = {"vllm": (_vllm, True), "sglang": (_sglang, True), "trtllm": (_trtllm, False), "lmdeploy": (_lmdeploy, True)}


def launch_command(
    server: Mapping[str, Any],
    model: Mapping[str, Any],
    port: int,
    api_key: str,
    adapters: Mapping[str, str] | None = None,
) -> list[str]:
    """The command that starts the server of ``engine.server`` for the engine arguments ``model``
    (``EngineSettings.kwargs``) and the LoRA adapters by name (``EngineSettings.adapters``; the ``vllm``
    preset's, which the others refuse) on ``port``: the preset's line, or ``engine.server.command`` with
    ``{model}``, ``{host}``, ``{port}`` and ``{api_key}`` filled in."""
    if server.get("command"):
        command = server["command"]
        parts = shlex.split(command) if isinstance(command, str) else list(command)
    else:
        build, _ = PRESETS[server["preset"]]
        parts = build(model, port, adapters or {})
    values = {"model": str(model.get("model", "")), "host": HOST, "port": str(port), "api_key": api_key}
    return [_filled(p, values) for p in parts]


def _filled(part: str, values: Mapping[str, str]) -> str:
    """``part`` with each ``{name}`` of ``values`` filled in; any other brace is kept (a JSON argument)."""
    for name, value in values.items():
        part = part.replace("{" + name + "}", value)
    return part


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# -- The answers, as the tasks read vLLM's ------------------------------------------------------------


@dataclass
class ServerSample:
    """One choice of a completion, with the fields of vLLM's ``CompletionOutput`` the tasks read."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: Any = None
    logprobs: Any = None
    cumulative_logprob: float | None = None


@dataclass
class ServerOutput:
    """A finished request, with the fields of vLLM's ``RequestOutput`` the feed reads; ``error``: why the
    server refused it (the row's error). Also the form of a stored answer (``store.rebuilt``): ``source``
    says where it came from (``results.ENGINE``, ``STORE``, ``DUPLICATE``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: Any  # a list of ServerSample; a stored pooled answer's ``results.Pooled``
    finished: bool = True
    metrics: Any = None
    num_cached_tokens: int = 0
    error: str | None = None
    source: str = ENGINE


# the SamplingParams fields a completion request carries under the same name (vllm/entrypoints/openai/
# completion/protocol.py: CompletionRequest; the ones past OpenAI's own go in the body as extra fields)
_SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                    "skip_special_tokens", "include_stop_str_in_output")  # fmt: skip
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar")


def completion_body(model: str, prompt_token_ids: list[int], params: Any) -> dict[str, Any]:
    """The ``/v1/completions`` request of a prompt's token ids and its ``SamplingParams``."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt_token_ids), "return_token_ids": True}
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name, None)
        if value is not None and value != []:
            body[name] = value
    if params.stop:
        body["stop"] = list(params.stop)
    structured = getattr(params, "structured_outputs", None)
    if structured is not None:
        body["structured_outputs"] = {
            name: getattr(structured, name) for name in _STRUCTURED_FIELDS if getattr(structured, name, None)
        }
    if getattr(params, "logprob_token_ids", None):  # output.choice_probs: the labels' first tokens
        body["logprob_token_ids"], body["logprobs"] = list(params.logprob_token_ids), 0
    elif getattr(params, "logprobs", None) is not None:
        body["logprobs"] = params.logprobs
    if "logprobs" in body:  # each position's tokens by id, not by text (vLLM's field)
        body["return_tokens_as_token_ids"] = True
    return body


class TokensByText(ValueError):
    """A server's log-probabilities that name tokens by their text (it ignored return_tokens_as_token_ids)."""


def position_logprobs(answer: Mapping[str, Any] | None, decode: Callable[[int], str]) -> list[dict[int, Any]] | None:
    """A choice's ``logprobs`` (OpenAI's completions format, tokens as ``token_id:N``) as vLLM's
    ``CompletionOutput.logprobs``: per position, token id -> its log-probability and text, the sampled
    token's and the top ones' (vllm/entrypoints/openai/completion/serving.py:
    ``_create_completion_logprobs``, which writes -inf as -9999.0).

    Raises:
        TokensByText: a token named otherwise.
    """
    if not answer or answer.get("top_logprobs") is None:
        return None
    positions = []
    for top in answer["top_logprobs"]:
        entry = {}
        for key, logprob in (top or {}).items():
            if not key.startswith("token_id:"):
                raise TokensByText(f"the server names its log-probabilities' tokens by text ({key!r}), not by id")
            token = int(key.removeprefix("token_id:"))
            entry[token] = SimpleNamespace(logprob=logprob, rank=None, decoded_token=decode(token))
        positions.append(entry)
    return positions


# -- The engine ----------------------------------------------------------------------------------------


@dataclass
class ServerEngine(eng.OutsideEngine):
    """A job's handle on a server (``engine.KINDS["server"]``), with ``engine.Engine``'s methods.

    Args:
        server: the config's ``engine.server``.
    """

    # the requests in flight at once when the model section sets no max_num_seqs (the feed keeps twice as many)
    MAX_NUM_SEQS = 64
    server: dict[str, Any] = field(default_factory=dict)
    starts: int = 0
    url: str | None = None
    model: str | None = None  # the name the server serves the model under
    _settings: Any = field(default=None, repr=False)
    _hf: Any = field(default=None, repr=False)
    _max_model_len: int = 0
    _key: str = field(default="", repr=False)  # the API key the server takes
    _process: subprocess.Popen | None = field(default=None, repr=False)
    _client: Any = field(default=None, repr=False)
    _pool: concurrent.futures.ThreadPoolExecutor | None = field(default=None, repr=False)
    _pending: dict[str, tuple[concurrent.futures.Future, list[int]]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: Any) -> ServerEngine:
        return cls(dict(config.engine.server))

    @property
    def running(self) -> bool:
        return self._client is not None

    def start(self, settings: eng.EngineSettings) -> ServerEngine:
        """Start the server (or reach ``engine.server.url``) and wait until it answers; load the model's
        tokenizer, which makes the prompts' token ids here as in process.

        Raises:
            ServerFailed: it ended, or did not answer within ``engine.server.start_timeout_seconds``.
        """
        if self._client is not None and settings.kwargs == self._settings.kwargs:
            return self
        self.close()
        import openai
        from transformers import AutoTokenizer

        self._settings = settings
        model = settings.kwargs
        if self.server.get("url"):
            self.url = self.server["url"].rstrip("/")
            key_env = self.server.get("api_key_env")
            key = os.environ.get(key_env, "") if key_env else ""
            if key_env and not key:
                raise ServerFailed(f"engine.server.api_key_env: the environment variable {key_env} is not set")
            self._wait_ready(key, self.server.get("start_timeout_seconds") or 60)
        else:
            port, key = _free_port(), secrets.token_urlsafe(24)
            cmd = launch_command(self.server, model, port, key, settings.adapters)
            env = {**os.environ, API_KEY_ENV: key, "VLLM_API_KEY": key}
            shown = " ".join(shlex.quote(p.replace(key, "<key>")) for p in cmd)
            log.info("starting the server: %s", shown)
            # its output is the job's (the shard's log); its own session, so that close ends all of it
            self._process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            self.url = f"http://{HOST}:{port}"
            self._wait_ready(key, self.server.get("start_timeout_seconds") or 1200)
        self._key = key
        self._client = openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=key or "none",
            max_retries=int(self.server.get("max_retries", 5)),
            timeout=float(self.server.get("request_timeout_seconds") or 600),
        )
        self.model = self.server.get("model") or self._served_model(key)
        self._hf = AutoTokenizer.from_pretrained(
            model.get("tokenizer") or model["model"], trust_remote_code=bool(model.get("trust_remote_code"))
        )
        hf_config = json.loads((Path(model["model"]) / "config.json").read_text())
        self._max_model_len = int(model.get("max_model_len") or hf_config.get("max_position_embeddings") or 2048)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * self.max_num_seqs, thread_name_prefix="req")
        self.starts += 1
        return self

    def _get(self, path: str, key: str, timeout: float = 5.0) -> bytes:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read()

    def _wait_ready(self, key: str, timeout: float) -> None:
        """Until ``/v1/models`` answers, at most ``timeout`` seconds, saying every 30 s that it waits."""
        started = last_said = time.monotonic()
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise ServerFailed(
                    f"the server ended with exit code {self._process.returncode} before it answered "
                    "(its output is above in this log)"
                )
            try:
                self._get("/v1/models", key)
                log.info("the server answers at %s after %.0f s", self.url, time.monotonic() - started)
                return
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    self.close()
                    raise ServerFailed(
                        f"the server at {self.url} refused the API key (HTTP {e.code})"
                        + (f" in ${self.server['api_key_env']}" if self.server.get("api_key_env") else "")
                    ) from None
                error: Exception = e
            except OSError as e:  # not listening yet (URLError is an OSError)
                error = e
            waited = time.monotonic() - started
            if waited > timeout:
                self.close()
                raise ServerFailed(
                    f"the server at {self.url} did not answer within {timeout:.0f} s "
                    f"(engine.server.start_timeout_seconds): {error}"
                ) from None
            if time.monotonic() - last_said > SAY_EVERY_SECONDS:
                log.info("waiting for the server at %s (%.0f s so far, at most %.0f)", self.url, waited, timeout)
                last_said = time.monotonic()
            time.sleep(POLL_SECONDS)

    def _served_model(self, key: str) -> str:
        models = json.loads(self._get("/v1/models", key))["data"]
        return next((m["id"] for m in models if not m.get("parent")), models[0]["id"])  # not a LoRA adapter

    def tokenizer(self, generates: bool = True, chat_template_kwargs: Any = None) -> eng.Tokenizer:
        return eng.Tokenizer(self._hf, self._max_model_len, generates, chat_template_kwargs)

    # -- Requests -------------------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> list[Exception | None]:
        assert self._pool is not None
        for r in requests:
            ids = list(r.prompt["prompt_token_ids"])
            # a row's LoRA adapter is a model the server serves by its name (vLLM's --lora-modules)
            body = completion_body(r.lora.name if r.lora is not None else self.model or "", ids, r.params)
            self._pending[r.request_id] = (self._pool.submit(self._complete, body), ids)
        return [None] * len(requests)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One completion: the answer, or ``{"error": ...}`` for a request the server refused."""
        import openai

        standard = {k: body[k] for k in ("model", "prompt", "n", "max_tokens", "temperature", "top_p", "seed",
                                         "presence_penalty", "frequency_penalty", "stop") if k in body}  # fmt: skip
        extra = {k: v for k, v in body.items() if k not in standard}
        try:
            return self._client.completions.create(**standard, extra_body=extra).model_dump()
        except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
            return {"error": f"{type(e).__name__}: {e.message}"}

    def step(self) -> list[ServerOutput]:
        """The requests that finished (waiting up to ``STEP_WAIT_SECONDS`` for one).

        Raises:
            ServerFailed: the server could not answer a request (after the client's retries).
        """
        if not self._pending:
            return []
        futures = {f: rid for rid, (f, _) in self._pending.items()}
        done, _ = concurrent.futures.wait(futures, STEP_WAIT_SECONDS, concurrent.futures.FIRST_COMPLETED)
        out = []
        for f in done:
            request_id = futures[f]
            _, ids = self._pending.pop(request_id)
            try:
                answer = f.result()
            except Exception as e:
                raise ServerFailed(f"the server at {self.url} did not answer a request: {type(e).__name__}: {e}") from e
            if "error" in answer:
                out.append(ServerOutput(request_id, ids, [], error=answer["error"]))
                continue
            try:
                samples = [
                    ServerSample(c["index"], c["text"], c.get("token_ids") or [], c["finish_reason"],
                                 c.get("stop_reason"), position_logprobs(c.get("logprobs"), self._decode))
                    for c in sorted(answer["choices"], key=lambda c: c["index"])
                ]  # fmt: skip
            except TokensByText as e:
                out.append(ServerOutput(request_id, ids, [], error=str(e)))
                continue
            out.append(ServerOutput(request_id, ids, samples))
        return out

    def _decode(self, token: int) -> str:
        return self._hf.decode([token])

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests: those not sent yet are not sent; the answers of those sent are ignored."""
        for request_id in request_ids:
            if (pending := self._pending.pop(request_id, None)) is not None:
                pending[0].cancel()

    def close(self, wait: float | None = 30.0) -> None:
        """Stop sending, and stop the server this handle started (SIGTERM to its session, then SIGKILL)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self._client = None
        if self._process is not None and self._process.poll() is None:
            log.info("stopping the server (process %d)", self._process.pid)
            try:
                os.killpg(self._process.pid, signal.SIGTERM)
                self._process.wait(wait or 5.0)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
            except ProcessLookupError:
                pass
        self._process = None


# -- What a server run can serve, checked when the run plans ----------------------------------------------


def check_config(config: dict[str, Any]) -> None:
    """``engine.server`` goes with ``engine.kind: server``, which needs exactly one of ``preset``,
    ``command`` and ``url``, and serves what ``completion_body`` carries.

    Raises:
        ConfigError: naming the key and the engine.
    """
    engine = config.get("engine") or {}
    server = engine.get("server") or {}
    kind = engine.get("kind", "vllm")
    if kind != KIND:
        if any(server.get(k) for k in ("preset", "command", "url", "api_key_env", "model")):
            raise ConfigError(f"engine.server is set, but engine.kind is {kind}: set kind: server")
        return
    given = [k for k in ("preset", "command", "url") if server.get(k)]
    if len(given) != 1:
        raise ConfigError(
            "engine.kind: server needs one of engine.server.preset (a server the job starts), "
            f"engine.server.command (a command that starts one) or engine.server.url (a running one); got {given}"
        )
    if server.get("api_key_env") and not server.get("url"):
        raise ConfigError(
            "engine.server.api_key_env is for engine.server.url: a server the job starts gets a key of its own"
        )
    task = cfg.task_kind(config)
    refused = []
    if task.name != "generate" or not task.uses_engine:
        refused.append(f"task: {task.name}")
    if (config.get("prompt") or {}).get("images"):
        refused.append("prompt.images")
    sampling = config.get("sampling") or {}
    for key in ("prompt_logprobs", "reasoning_parser", "thinking_token_budget"):
        if sampling.get(key) is not None:
            refused.append(f"sampling.{key}")
    other = server.get("preset") not in (None, "vllm")  # a preset of another engine (url, command: any server)
    if other:
        # vLLM's request fields: SGLang names structured outputs json_schema, regex and ebnf
        # (python/sglang/srt/entrypoints/openai/protocol.py), and no other preset's server takes
        # return_tokens_as_token_ids or logprob_token_ids; a rollout's required calls are structured outputs
        for key, given in (("sampling.structured_outputs", sampling.get("structured_outputs")),
                           ("sampling.logprobs", sampling.get("logprobs") is not None),
                           ("output.choice_probs", (config.get("output") or {}).get("choice_probs")),
                           ("lora.adapters", (config.get("lora") or {}).get("adapters")),
                           ("rollout", config.get("rollout"))):  # fmt: skip
            if given:
                refused.append(f"{key} on preset {server['preset']} (vLLM's request fields)")
    if refused:
        raise ConfigError(
            f"engine.kind: server does not serve {', '.join(refused)} yet (it serves text generation with the "
            "sampling settings, n samples, and on vLLM's server structured outputs, log-probabilities, "
            "output.choice_probs, rollouts and LoRA adapters): use engine.kind: vllm"
        )


def content(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The server's part of the fingerprint: which server makes the rows (its preset or command; an
    endpoint's address and key change none)."""
    server = engine.get("server") or {}
    return {"preset": server.get("preset"), "command": server.get("command")}


eng.KINDS[KIND] = ServerEngine
cfg.register_check(check_config)
cfg.register_engine(KIND, content)
