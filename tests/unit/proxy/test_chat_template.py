"""The model's own chat template (proxy/chat_template.py): loading from a tokenizer
directory as Hugging Face keeps it, rendering as transformers does, and the text that
continues an assistant's answer on /v1/completions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.errors import FtctlError, InvalidInput
from dynamo_ftctl.proxy.chat_template import ChatTemplate, TemplateFailed

# The suite's tiny Llama's template (tests/integration/vllm/write_tiny_llama.py).
TINY = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}


def tokenizer_dir(tmp_path: Path, *, jinja: str | None = TINY,
                  config: dict[str, object] | None = None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config or CONFIG))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_renders_as_the_model_would_and_continues_without_a_second_bos(tmp_path: Path) -> None:
    """The tiny Llama's conversation, its generation prompt, and the continuation text:
    rendered prompt minus the leading <s> (the server adds its own), then the answer."""
    template = ChatTemplate.from_directory(tokenizer_dir(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "<s><|user|>\nhi\n<|assistant|>\n"
    assert template.eos_token == "</s>"
    assert template.continuation_prompt(messages, "Hello, wo") == (
        "<|user|>\nhi\n<|assistant|>\nHello, wo")


def test_a_template_kept_in_tokenizer_config_is_found(tmp_path: Path) -> None:
    """No chat_template.jinja: `chat_template` of tokenizer_config.json, a string or named
    templates ("default" taken)."""
    named = {**CONFIG, "chat_template": [{"name": "tool_use", "template": "T"},
                                         {"name": "default", "template": "D{{ messages|length }}"}]}
    template = ChatTemplate.from_directory(tokenizer_dir(tmp_path, jinja=None, config=named))
    assert template.render([{"role": "user", "content": "x"}]) == "D1"
    plain = {**CONFIG, "chat_template": "P"}
    assert ChatTemplate.from_directory(
        tokenizer_dir(tmp_path, jinja=None, config=plain)).render([]) == "P"


@pytest.mark.parametrize(("jinja", "config", "says"), [
    (None, CONFIG, "no chat template"),
    ("{% for %}", CONFIG, "does not compile"),
])
def test_a_directory_without_a_usable_template_is_refused(
        tmp_path: Path, jinja: str | None, config: dict[str, object], says: str) -> None:
    """One line naming the directory or file: no template, or one that does not compile."""
    with pytest.raises(InvalidInput, match=says) as caught:
        ChatTemplate.from_directory(tokenizer_dir(tmp_path, jinja=jinja, config=config))
    assert "\n" not in str(caught.value)
    assert str(tmp_path) in str(caught.value)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge"])
def test_hostile_template_files_are_refused(tmp_path: Path, kind: str) -> None:
    """A link, a FIFO or an endless file where the template is expected: refused (exit 2),
    never followed, never blocking."""
    folder = tokenizer_dir(tmp_path, jinja=None)
    target = folder / "chat_template.jinja"
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text(TINY)
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("x" * (1024 * 1024 + 1))
    with pytest.raises(FtctlError) as caught:
        ChatTemplate.from_directory(folder)
    assert caught.value.exit_code == 2


def test_raise_exception_and_sandbox_escapes_are_template_failures(tmp_path: Path) -> None:
    """A template's own raise_exception, and an attempt to reach Python internals, end as
    TemplateFailed (the continuation then fails cleanly), never run."""
    raising = ChatTemplate.from_directory(tokenizer_dir(
        tmp_path, jinja="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(TemplateFailed, match="roles must alternate"):
        raising.render([])
    escape = ChatTemplate.from_directory(tokenizer_dir(
        tmp_path, jinja="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(TemplateFailed):
        escape.render([])


def test_transformers_helpers_are_there(tmp_path: Path) -> None:
    """tojson (as transformers': no ASCII escaping), loop controls, strftime_now, tools."""
    jinja = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
             "{{ m|tojson }}{% endfor %}|{{ tools|length }}|{{ strftime_now('%Y')|length }}")
    template = ChatTemplate.from_directory(tokenizer_dir(tmp_path, jinja=jinja))
    out = template.render([{"role": "user", "content": "é"}, {"role": "x", "content": "y"}],
                          tools=[{"type": "function"}])
    assert out == '{"role": "user", "content": "é"}|1|4'


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), texts),
                      max_size=6), generated=texts)
def test_the_continuation_is_the_rendered_prompt_then_the_answer(
        turns: list[tuple[str, str]], generated: str) -> None:
    """For any conversation and partial answer: the continuation prompt is the rendered
    conversation (without its BOS) followed by exactly the answer so far, and every
    message's text is in it, in order."""
    template = ChatTemplate(TINY, "<s>", "</s>", "test")
    messages = [{"role": r, "content": c} for r, c in turns]
    prompt = template.continuation_prompt(messages, generated)
    rendered = template.render(messages)
    assert prompt == rendered.removeprefix("<s>") + generated
    position = 0
    for _, content in turns:
        position = prompt.index(content, position)


def test_a_final_assistant_message_is_continued_where_it_stops(tmp_path: Path) -> None:
    """continue_final_message: the conversation up to the assistant's own beginning, cut
    after its text (no end-of-turn), then what was generated."""
    template = ChatTemplate.from_directory(tokenizer_dir(tmp_path))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert template.continuation_prompt(messages, "lo", continue_final=True) == (
        "<|user|>\nhi\n<|assistant|>\nHello")
    with pytest.raises(TemplateFailed):
        template.continuation_prompt([{"role": "assistant", "content": ""}], "x",
                                     continue_final=True)


def test_a_text_chat_continuation_goes_through_the_template() -> None:
    """With a template on the ledger, a chat cut after text without ids continues as a
    completion: the rendered conversation plus the text, the remaining max_tokens, no
    chat-only fields."""
    from dynamo_ftctl.proxy.continuation import continuation_request, first_request
    from dynamo_ftctl.proxy.ledger import StreamLedger

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0, "add_generation_prompt": True}
    ledger = StreamLedger("chat", body)
    first_request(ledger)
    ledger._text_parts.append("Hello")  # two tokens of text, no ids
    ledger.generated_count = 2
    ledger.chat_template = ChatTemplate(TINY, "<s>", "</s>", "test")
    up = continuation_request(ledger)
    assert ledger.upstream_endpoint == "completions"
    assert up["prompt"] == "<|user|>\nhi\n<|assistant|>\nHello"
    assert up["max_tokens"] == 8
    assert "messages" not in up
    assert "add_generation_prompt" not in up
