"""Turn a dataset row into a prompt: a Jinja2 template rendered in the sandbox.

The template sees the row's columns as variables. Rendering never runs code
from the config: the sandbox refuses access to Python internals, and a
template that tries gets a clear error instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.meta
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardgen.errors import ConfigError, RowError


class PromptRenderer:
    """Renders rows into prompts (chat messages or raw text).

    Args:
        template: Jinja2 template over the row's columns.
        system: Optional system message, placed first in chat mode.
        chat: Whether the prompt is a chat conversation (for the model's chat
            template) or raw completion text.
    """

    def __init__(self, template: str, system: str | None = None, chat: bool = True) -> None:
        self._env = ImmutableSandboxedEnvironment(
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
        )
        try:
            parsed = self._env.parse(template)
            self._template = self._env.from_string(parsed)
        except TemplateSyntaxError as e:
            raise ConfigError(f"prompt.template: syntax error on line {e.lineno}: {e.message}") from e
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise ConfigError(f"prompt.template: cannot compile it: {type(e).__name__}: {e}") from e
        self.columns: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        self.system = system
        self.chat = chat

    def render_text(self, row: Mapping[str, Any]) -> str:
        """Render the template for one row.

        Raises:
            RowError: a column the template uses is missing or null, the
                template fails on this row, or the result is empty.
        """
        values = dict(row)
        for name in sorted(self.columns):
            value = values.get(name)
            if name in values and value is None:
                raise RowError("null_value", f"column '{name}' is null")
            if isinstance(value, bytes):
                try:
                    values[name] = value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise RowError(
                        "undecodable_text", f"column '{name}' is not valid UTF-8 (byte {e.start}: {e.reason})"
                    ) from None
        try:
            text = self._template.render(values)
        except UndefinedError as e:
            raise RowError("template_error", f"template: {e.message}") from e
        except SecurityError as e:
            raise RowError("template_unsafe", f"template: unsafe operation refused by the sandbox: {e}") from e
        except Exception as e:
            raise RowError("template_error", f"template: {type(e).__name__}: {e}") from e
        if not text.strip():
            raise RowError("empty_prompt", "the rendered prompt is empty")
        return text

    def render(self, row: Mapping[str, Any]) -> str | list[dict[str, str]]:
        """The prompt for one row: chat messages in chat mode, else text."""
        text = self.render_text(row)
        if not self.chat:
            return text
        messages = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": text})
        return messages
