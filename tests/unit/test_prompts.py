"""Prompt rendering: template over columns, system prompt, chat on/off, per-row errors, sandbox."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardgen import config as cfg
from shardgen.errors import ConfigError, RowError
from shardgen.requests.prompts import PromptRenderer


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


# Templates that would exhaust the login node or a job: each is refused, at compile time or for
# the row, instead of being computed (before the bounds, the first took 13.6 s to compile and the
# second 436 MiB).
HOSTILE_TEMPLATES = {
    "huge_power": "{{ 3**(2*10**7) }}",
    "huge_repetition": "{{ 'a'*10**8 }}",
    "center_filter": "{{ text|center(10**8) }}",
    "ljust_method": "{{ text.ljust(10**8) }}",
    "percent_width": "{{ '%099999999d' % 1 }}",
    "format_width": "{{ '{:>99999999}'.format(1) }}",
    "replace_blowup": "{{ (text * 1000)|replace('a', 'b' * 100000) }}",
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "doubling_in_a_namespace": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling_by_assignments": "{% set s = text %}" + "{% set s = s ~ s %}" * 40 + "{{ s|length }}",
    "list_repetition": "{{ (range(10)|list) * 10**8 }}",
    "slice_filter": "{{ [1]|slice(10**8)|list|length }}",
    # a result's size that depends on its arguments, checked before it is built (issue 25)
    "format_width_argument": "{{ '{0:>{1}}'.format(1, 10**8) }}",
    "percent_star_width": "{{ '%*d' % (10**8, 1) }}",
    "format_filter_star_width": "{{ '%*d'|format(10**8, 1) }}",
    "format_map_width_argument": "{{ '{a:>{w}}'.format_map({'a': 1, 'w': 10**8}) }}",
    "many_fields": "{{ ('{0}' * 1000).format(text * 1000000) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(10**5) }}",
    "indent": "{{ ('x\n' * 1000)|indent(10**6) }}",
    "join_filter": "{{ ([text * 1000000] * 100)|join }}",
    "join_method": "{{ ''.join([text * 1000000] * 100) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_template_that_would_build_something_huge_is_refused_not_computed(name):
    import tracemalloc

    tracemalloc.start()
    try:
        renderer = PromptRenderer(HOSTILE_TEMPLATES[name], chat=False)
        with pytest.raises(RowError, match="template_error: template: .*bounded in size and time"):
            renderer.render({"text": "abcdefgh"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"


def test_a_recursive_macro_is_a_config_error():
    with pytest.raises(ConfigError, match=r"prompt.template: the macro\(s\) f call themselves"):
        PromptRenderer("{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s }}{% endmacro %}{{ f(text, 40) }}")


def test_a_render_that_runs_too_long_is_stopped_at_its_deadline(monkeypatch):
    import shardgen.base.sandbox

    monkeypatch.setattr(shardgen.base.sandbox, "RENDER_SECONDS", 0.2)
    # loops over the row's own data with nothing inside: no call, no output, only the alarm stops it
    template = "{% for a in xs %}{% for b in xs %}{% for c in xs %}{% endfor %}{% endfor %}{% endfor %}x"
    with pytest.raises(RowError, match=r"rendering took more than 0.2 s"):
        PromptRenderer(template, chat=False).render({"xs": list(range(2000))})


def test_a_compile_error_of_any_kind_is_a_config_error_not_a_traceback():
    with pytest.raises(ConfigError, match="prompt.template"):
        PromptRenderer("{{ x|no_such_filter }}")


def test_a_rendered_prompt_longer_than_the_context_can_hold_is_a_row_error_before_tokenizing():
    renderer = PromptRenderer("Summarize: {{ text }}", chat=False)
    renderer.max_chars = 1000
    with pytest.raises(RowError, match="prompt_too_long: the prompt has more than 1000 characters"):
        renderer.render({"text": "x" * 995})
    assert renderer.render({"text": "x" * 900}).endswith("x")
    # a template may use a slice of a long cell: only what it renders counts
    assert len(PromptRenderer("{{ text[:10] }}", chat=False).render({"text": "y" * 10**6})) == 10
    messages = PromptRenderer(None, messages_column="m")
    messages.max_chars = 50
    with pytest.raises(RowError, match="prompt_too_long"):
        messages.render({"m": [{"role": "user", "content": "z" * 60}]})


def test_the_render_deadline_covers_the_render_only_not_the_batch_around_it(monkeypatch):
    """A batch decodes each row's bytes before it renders it. The alarm of the row before must not
    fire there: a row that rendered in just under the deadline would end the attempt."""
    import time

    from shardgen.base import sandbox
    from shardgen.requests import prompts

    monkeypatch.setattr(sandbox, "RENDER_SECONDS", 0.2)
    real_decode = prompts._decode

    def slow_decode(column, value):
        time.sleep(0.4)  # longer than the deadline, outside any render
        return real_decode(column, value)

    monkeypatch.setattr(prompts, "_decode", slow_decode)
    out = PromptRenderer("Q: {{ q }}", chat=False).render_batch([{"q": "one"}, {"q": b"two"}, {"q": b"three"}])
    assert out == ["Q: one", "Q: two", "Q: three"]


def test_chat_template_kwargs_reach_the_template_and_an_unused_one_is_named(model_dir):
    """prompt.chat_template_kwargs, rendered by shardgen's own apply_chat_template call: a template
    that switches a reasoning trace off (as Qwen3's does) gets the variable; one it never reads is
    named by the preflight."""
    from transformers import AutoTokenizer

    from shardgen.engines.kinds import Tokenizer
    from shardgen.jobs.preflight import unused_template_kwargs

    hf = AutoTokenizer.from_pretrained(model_dir)
    hf.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    )
    chat = [{"role": "user", "content": "Hi?"}]
    assert Tokenizer(hf, 512)._chat_texts([chat]) == ["<|user|>Hi?\n<|assistant|><think>"]
    off = Tokenizer(hf, 512, chat_template_kwargs={"enable_thinking": False})
    assert off._chat_texts([chat]) == ["<|user|>Hi?\n<|assistant|><think></think>"]
    assert unused_template_kwargs(hf, {"enable_thinking": False, "enable_thinkng": True}) == ["enable_thinkng"]


def test_chat_template_kwargs_are_in_the_fingerprint_and_the_calls_own_arguments_are_refused():
    base = {"input": {"parquet": ["x.parquet"]}, "prompt": {"template": "{{ text }}"}, "model": {"model": "m"}}
    plain = cfg.RunConfig.from_dict(base)
    off = cfg.RunConfig.from_dict({**base, "prompt": {"template": "{{ text }}", "chat_template_kwargs": {"x": 1}}})
    assert off.fingerprint != plain.fingerprint and off.prompt.chat_template_kwargs == {"x": 1}
    for prompt, said in [
        ({"chat_template_kwargs": {"tokenize": True}}, "prompt.chat_template_kwargs.tokenize: shardgen sets it"),
        ({"chat_template_kwargs": {"x": 1}, "chat": False}, "but prompt.chat is false"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            cfg.RunConfig.from_dict({**base, "prompt": {"template": "{{ text }}", **prompt}})
