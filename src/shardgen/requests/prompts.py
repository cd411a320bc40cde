"""Turn a dataset row into a prompt: a Jinja2 template rendered in the sandbox,
or a column that already holds the conversation.

The template sees the row's columns as variables. Rendering never runs code
from the config: the sandbox refuses access to Python internals, and bounds
the size of what a template builds and the time a render takes
(``shardgen.base.sandbox``); a template that tries gets a clear error instead. A
rendered prompt longer than ``max_chars`` (set by the job from the context
length and the tokenizer) is a ``prompt_too_long`` row error before anything
is tokenized. In chat mode the prompt is a
list of messages: the system message, the few-shot turns, then the row's own
message(s), so that everything shared by all rows comes first and is reused
from the prefix cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError

from shardgen import config as cfg
from shardgen.base.sandbox import (
    MAX_ITEMS,
    BoundedSandbox,
    RenderBudget,
    TemplateBoundError,
    TemplateTimeout,
    recursive_macros,
)
from shardgen.errors import ConfigError, RowError

if TYPE_CHECKING:
    from shardgen.config import PromptConfig

ROLES = ("system", "user", "assistant")
# A row's prompt: raw text, chat messages, or (task score) a pair of texts.
Prompt = str | list[dict[str, str]] | tuple[str, str]


class PromptRenderer:
    """Renders rows into prompts (chat messages or raw text).

    Args:
        template: Jinja2 template over the row's columns (the user message).
        system: Optional system message, placed first in chat mode.
        chat: Whether the prompt is a chat conversation (for the model's chat
            template) or raw completion text.
        few_shot: Example turns (``{"role", "content"}``) placed before the row's own.
        messages_column: A column holding the row's messages, instead of ``template``.
        pair_template: the second text of a pair (task score): each prompt is then a
            ``(template's text, pair_template's text)`` pair, for the tokenizer to join.
        images: image columns (``prompt.images``): the user message gets one image part per
            column before its text, for the model's chat template to place.
        key: the config key the template came from, for messages.
    """

    def __init__(
        self,
        template: str | None,
        system: str | None = None,
        chat: bool = True,
        few_shot: list[dict[str, str]] | None = None,
        messages_column: str | None = None,
        pair_template: str | None = None,
        images: list[str] | tuple[str, ...] | None = None,
        key: str = "prompt.template",
    ) -> None:
        if (template is None) == (messages_column is None):
            raise ConfigError("prompt: set exactly one of prompt.template and prompt.messages_column")
        if not chat and (messages_column or few_shot):
            key = "prompt.messages_column" if messages_column else "prompt.few_shot"
            raise ConfigError(f"{key} needs chat mode (prompt.chat: true): it is a list of chat messages")
        self._template = None
        self.columns: frozenset[str] = frozenset()
        # the longest prompt (characters) that could fit the context; the job sets it from the tokenizer
        self.max_chars = MAX_ITEMS
        if template is not None:
            env = BoundedSandbox(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
            try:
                parsed = env.parse(template)
                if recursive := recursive_macros(parsed):
                    raise ConfigError(f"{key}: the macro(s) {', '.join(recursive)} call themselves; "
                                      "recursion is not allowed in prompt templates")  # fmt: skip
                with RenderBudget() as budget, budget.render():
                    self._template = env.from_string(parsed)
            except TemplateTimeout:
                raise ConfigError(f"{key}: compiling it took too long") from None
            except TemplateSyntaxError as e:
                raise ConfigError(f"{key}: syntax error on line {e.lineno}: {e.message}") from e
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(f"{key}: cannot compile it: {type(e).__name__}: {e}") from e
            self.columns = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        else:
            self.columns = frozenset({messages_column})
        self.messages_column = messages_column
        self.images = tuple(images or ())
        if self.images and (not chat or messages_column):
            raise ConfigError("prompt.images go into the user message: they need prompt.template and prompt.chat: true")
        self.pair: PromptRenderer | None = None
        if pair_template is not None:
            if chat or messages_column:
                raise ConfigError("prompt.pair_template makes text pairs: it needs prompt.template, prompt.chat: false")
            self.pair = PromptRenderer(pair_template, chat=False, key="prompt.pair_template")
            self.columns |= self.pair.columns
        self.system = system
        self.chat = chat
        self.prefix: list[dict[str, str]] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": t["role"], "content": t["content"]} for t in few_shot or []
        ]

    @classmethod
    def from_config(cls, prompt: PromptConfig) -> PromptRenderer:
        """The renderer for the config's ``prompt`` section."""
        return cls(prompt.template, prompt.system, prompt.chat, list(prompt.few_shot), prompt.messages_column,
                   prompt.pair_template, prompt.images)  # fmt: skip

    def render_text(self, row: Mapping[str, Any], budget: RenderBudget | None = None) -> str:
        """Render the template for one row (within ``budget``'s batch, or a budget of its own).

        Raises:
            RowError: a column the template uses is missing or null, the
                template fails on this row, or the result is empty.
        """
        assert self._template is not None
        values = dict(row)
        for name in sorted(self.columns):
            value = values.get(name)
            if name in values and value is None:
                raise RowError("null_value", f"column '{name}' is null")
            if isinstance(value, bytes):
                values[name] = _decode(name, value)
        try:
            with contextlib.nullcontext(budget) if budget else RenderBudget() as b, b.render():
                text = self._render(values)
        except TemplateTimeout:
            seconds = budget.seconds if budget else RenderBudget().seconds
            raise RowError(
                "template_error",
                f"template: rendering took more than {seconds:g} s; templates are bounded in size and time",
            ) from None
        except RowError:
            raise
        except UndefinedError as e:
            raise RowError("template_error", f"template: {e.message}") from e
        except TemplateBoundError as e:
            raise RowError("template_error", f"template: {e}; templates are bounded in size and time") from e
        except SecurityError as e:
            raise RowError("template_unsafe", f"template: unsafe operation refused by the sandbox: {e}") from e
        except Exception as e:
            raise RowError("template_error", f"template: {type(e).__name__}: {e}") from e
        if not text.strip():
            raise RowError("empty_prompt", "the rendered prompt is empty")
        return text

    def _render(self, values: dict[str, Any]) -> str:
        """Render piece by piece, stopping once the prompt is longer than ``max_chars`` (a cell of a
        gigabyte is never copied, let alone tokenized)."""
        assert self._template is not None
        pieces, length = [], 0
        for piece in self._template.generate(values):
            length += len(piece)
            if length > self.max_chars:
                raise RowError("prompt_too_long", self._too_long())
            pieces.append(piece)
        return "".join(pieces)

    def _too_long(self) -> str:
        return f"the prompt has more than {self.max_chars} characters, more than the context (max_model_len) can hold"

    def row_messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """The messages of ``prompt.messages_column`` for one row, checked.

        Raises:
            RowError: the value is null, not a list of role/content records,
                has an unknown role or empty content, or repeats the system
                message that ``prompt.system`` already gives.
        """
        name = self.messages_column
        value = row.get(name)
        if value is None:
            raise RowError("null_value", f"column '{name}' is null")
        if not isinstance(value, list) or not value:
            raise RowError("invalid_messages", f"column '{name}' must hold a non-empty list of messages")
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise RowError("invalid_messages", f"column '{name}', message {i}: needs 'role' and 'content'")
            role, content = m["role"], m["content"]
            if isinstance(content, bytes):
                content = _decode(name, content)
            if role not in ROLES:
                raise RowError("invalid_messages", f"column '{name}', message {i}: unknown role {role!r}")
            if not isinstance(content, str) or not content.strip():
                raise RowError("invalid_messages", f"column '{name}', message {i}: empty or non-text content")
            if role == "system" and self.system:
                raise RowError(
                    "invalid_messages", f"column '{name}', message {i}: a system message, and prompt.system is set too"
                )
            messages.append({"role": role, "content": content})
        if sum(len(m["content"]) for m in messages) > self.max_chars:
            raise RowError("prompt_too_long", self._too_long())
        if messages[-1]["role"] == "assistant":
            raise RowError("invalid_messages", f"column '{name}': the last message is the assistant's, not a question")
        return messages

    def render(self, row: Mapping[str, Any], budget: RenderBudget | None = None) -> Prompt:
        """The prompt for one row: chat messages in chat mode, a pair of texts with a pair template,
        else text."""
        if self.messages_column:
            return self.prefix + self.row_messages(row)
        text = self.render_text(row, budget)
        if self.pair is not None:
            self.pair.max_chars = self.max_chars
            return (text, self.pair.render_text(row, budget))
        if not self.chat:
            return text
        if self.images:
            parts: list[dict[str, str]] = [{"type": "image"} for _ in self.images]
            return [*self.prefix, {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        return [*self.prefix, {"role": "user", "content": text}]

    def render_batch(self, rows: list[Mapping[str, Any]]) -> list[Prompt | RowError]:
        """The prompt of each row, or the ``RowError`` it gets, under one render budget."""
        out: list[Any] = []
        with RenderBudget() as budget:
            for row in rows:
                try:
                    out.append(self.render(row, budget))
                except RowError as e:
                    out.append(e)
        return out


def _decode(column: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError(
            "undecodable_text", f"column '{column}' is not valid UTF-8 (byte {e.start}: {e.reason})"
        ) from None


def check_config(config: dict[str, Any]) -> None:
    """The run's templates compile: a syntax error, or one that cannot compile, is a config error.

    Raises:
        ConfigError: naming the key.
    """
    prompt = config["prompt"]
    PromptRenderer(
        prompt.get("template"), prompt.get("system"), prompt.get("chat", True), prompt.get("few_shot"),
        prompt.get("messages_column"), prompt.get("pair_template"), prompt.get("images"),
    )  # fmt: skip


cfg.register_check(check_config)
