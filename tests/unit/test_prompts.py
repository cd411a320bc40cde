"""Prompt rendering: template over columns, system prompt, chat on/off, per-row errors, sandbox."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardgen.errors import ConfigError, RowError
from shardgen.prompts import PromptRenderer


def test_chat_mode_gives_system_then_user_message():
    r = PromptRenderer("Summarize: {{ text }}", system="Be brief.", chat=True)
    assert r.render({"text": "a b c"}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Summarize: a b c"},
    ]


def test_chat_mode_without_system_has_only_the_user_message():
    assert PromptRenderer("{{ q }}").render({"q": "hi"}) == [{"role": "user", "content": "hi"}]


def test_completion_mode_gives_the_rendered_text():
    assert PromptRenderer("Q: {{ q }}\nA:", chat=False).render({"q": "2+2?"}) == "Q: 2+2?\nA:"


def test_template_columns_are_found_for_checks_before_the_run():
    r = PromptRenderer("{{ title }}: {% for t in tags %}{{ t }} {% endfor %}")
    assert r.columns == {"title", "tags"}


def test_a_syntax_error_names_the_key():
    with pytest.raises(ConfigError, match=r"prompt.template: syntax error on line 1"):
        PromptRenderer("{{ text ")


def test_a_missing_column_is_a_row_error():
    with pytest.raises(RowError, match="template_error: template: 'text' is undefined"):
        PromptRenderer("{{ text }}").render({"other": 1})


def test_a_null_value_is_a_row_error_naming_the_column():
    with pytest.raises(RowError, match="null_value: column 'text' is null"):
        PromptRenderer("{{ text }}").render({"text": None})


def test_an_empty_prompt_is_a_row_error():
    with pytest.raises(RowError, match="empty_prompt"):
        PromptRenderer("{{ text }}").render({"text": "  "})


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ text.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_the_sandbox_refuses_python_internals(template):
    with pytest.raises(RowError) as e:
        PromptRenderer(template).render({"text": "x"})
    assert e.value.reason in {"template_unsafe", "template_error"}


def test_rendering_cannot_mutate_row_values():
    row = {"items": [1, 2]}
    with pytest.raises(RowError):
        PromptRenderer("{{ items.append(3) }}").render(row)
    assert row["items"] == [1, 2]


def test_bytes_that_are_not_utf8_are_a_row_error_naming_the_column():
    r = PromptRenderer("{{ text }}")
    assert r.render_text({"text": "é".encode()}) == "é"
    with pytest.raises(RowError, match=r"undecodable_text: column 'text' is not valid UTF-8"):
        r.render_text({"text": b"\xff\xfe"})


_template_st = st.lists(
    st.sampled_from(
        [
            "{{",
            "}}",
            "{%",
            "%}",
            " x ",
            " if ",
            " for ",
            " in ",
            " endfor ",
            " endif ",
            "|",
            "upper",
            ".",
            "__class__",
            "(",
            ")",
            "[",
            "]",
            "'",
            "1",
            "+",
            " y ",
            "mro",
            "{#",
            "#}",
            "text",
            "\n",
            " set ",
            "=",
        ]
    ),
    max_size=12,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(template=_template_st, value=st.none() | st.text(max_size=5) | st.integers() | st.binary(max_size=4))
def test_fuzzed_templates_render_or_fail_with_a_config_or_row_error(template, value):
    try:
        r = PromptRenderer(template)
    except ConfigError:
        return
    try:
        out = r.render({"x": value, "y": [value], "text": value})
    except RowError:
        return
    assert isinstance(out, list)


def test_few_shot_turns_come_after_the_system_message_and_before_the_row():
    r = PromptRenderer(
        "Review: {{ text }}",
        system="Label reviews.",
        few_shot=[{"role": "user", "content": "Review: great"}, {"role": "assistant", "content": "positive"}],
    )
    assert r.render({"text": "awful"}) == [
        {"role": "system", "content": "Label reviews."},
        {"role": "user", "content": "Review: great"},
        {"role": "assistant", "content": "positive"},
        {"role": "user", "content": "Review: awful"},
    ]


def test_a_messages_column_is_the_conversation_after_the_shared_prefix():
    r = PromptRenderer(None, system="Be brief.", messages_column="chat")
    assert r.columns == {"chat"}
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye?"},
    ]
    assert r.render({"chat": chat}) == [{"role": "system", "content": "Be brief."}, *chat]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "null_value: column 'chat' is null"),
        ([], "invalid_messages: column 'chat' must hold a non-empty list"),
        ([{"role": "robot", "content": "x"}], "invalid_messages: column 'chat', message 0: unknown role 'robot'"),
        ([{"role": "user"}], "invalid_messages: column 'chat', message 0: needs 'role' and 'content'"),
        ([{"role": "user", "content": " "}], "invalid_messages: column 'chat', message 0: empty"),
        ([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "prompt.system is set too"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "the last message is the assistant",
        ),
    ],
)
def test_a_bad_messages_value_is_a_row_error_naming_the_column(value, message):
    r = PromptRenderer(None, system="S", messages_column="chat")
    with pytest.raises(RowError, match=message.replace("(", r"\(").replace(")", r"\)")):
        r.render({"chat": value})


def test_template_and_messages_column_together_are_refused():
    with pytest.raises(ConfigError, match="set exactly one of prompt.template and prompt.messages_column"):
        PromptRenderer("{{ x }}", messages_column="chat")
    with pytest.raises(ConfigError, match="set exactly one"):
        PromptRenderer(None)


def test_few_shot_and_messages_need_chat_mode():
    with pytest.raises(ConfigError, match=r"prompt.few_shot needs chat mode"):
        PromptRenderer("{{ x }}", chat=False, few_shot=[{"role": "user", "content": "a"}])
    with pytest.raises(ConfigError, match=r"prompt.messages_column needs chat mode"):
        PromptRenderer(None, chat=False, messages_column="chat")
