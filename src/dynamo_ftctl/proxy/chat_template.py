"""A model's own chat template, for continuing a chat on servers that cannot.

Some OpenAI servers refuse to continue an assistant message (`transformers serve`
and TensorRT-LLM reject `continue_final_message`), so a chat cut mid-answer on
them cannot go on through `/v1/chat/completions`. With the model's tokenizer
directory named in the inventory (`tokenizer:`), the proxy renders the
conversation itself, as the server would have, and continues on
`/v1/completions` from the rendered prompt plus the text generated so far.

The template is read as Hugging Face tokenizers keep it: `chat_template.jinja`,
else `chat_template` in `tokenizer_config.json` (a string, or a list of named
templates, "default" taken), with `bos_token`/`eos_token` from the same file.
It is rendered as `transformers` does (`apply_chat_template`): a sandboxed,
immutable Jinja environment with `trim_blocks`, `lstrip_blocks`, loop controls,
`raise_exception`, `tojson` and `strftime_now`. jinja2 is imported on first use.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.proxy.errors import TemplateFailed

__all__ = ["ChatTemplate", "TemplateFailed"]

# What a template or its config may weigh; real ones are a few KB (configs up to ~2 MB
# with their added-token tables).
_TEMPLATE_MAX = 1024 * 1024
_CONFIG_MAX = 16 * 1024 * 1024
# A rendered prompt longer than this is not a conversation a server would take.
_RENDERED_MAX = 64 * 1024 * 1024


def _read(path: Path, limit: int) -> str | None:
    """`path`'s text (`safefiles.read_regular`), None when there is no such file."""
    from dynamo_ftctl.safefiles import read_regular

    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        msg = f"{path}: not UTF-8 text"
        raise InvalidInput(msg) from None


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    """One model's chat template, ready to render (see the module docstring)."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = ""
    _compiled: list[Any] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def from_directory(cls, directory: Path) -> ChatTemplate:
        """The template of the tokenizer directory `directory`; `InvalidInput` (exit 2,
        naming the file) when it has none or it does not compile."""
        config_text = _read(directory / "tokenizer_config.json", _CONFIG_MAX)
        config: dict[str, Any] = {}
        if config_text is not None:
            try:
                loaded = loads(config_text)
            except ValueError as exc:
                msg = f"{directory / 'tokenizer_config.json'}: not JSON: {exc}"
                raise InvalidInput(msg) from None
            config = loaded if isinstance(loaded, dict) else {}
        source = _read(directory / "chat_template.jinja", _TEMPLATE_MAX)
        origin = str(directory / "chat_template.jinja")
        if source is None:
            source, origin = _from_config(config.get("chat_template")), str(
                directory / "tokenizer_config.json")
        if not source:
            msg = (f"{directory}: no chat template (neither chat_template.jinja nor "
                   "chat_template in tokenizer_config.json)")
            raise InvalidInput(msg)
        template = cls(source, _token(config.get("bos_token")), _token(config.get("eos_token")),
                       origin)
        template.compiled()  # a template that does not compile is refused at load
        return template

    def compiled(self) -> Any:
        """The Jinja template, compiled once."""
        if not self._compiled:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateFailed(message)

            def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                       separators: Any = None, sort_keys: bool = False) -> str:
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            def strftime_now(fmt: str) -> str:
                return datetime.datetime.now(tz=datetime.UTC).strftime(fmt)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            try:
                self._compiled.append(env.from_string(self.source))
            except jinja2.TemplateError as exc:
                msg = f"{self.origin}: the chat template does not compile: {exc}"
                raise InvalidInput(msg) from None
        return self._compiled[0]

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               tools: Any = None, extra: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model's prompt text; `TemplateFailed` when it cannot."""
        import jinja2

        try:
            text: str = self.compiled().render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                tools=tools, bos_token=self.bos_token, eos_token=self.eos_token,
                **dict(extra or {}))
        except TemplateFailed:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateFailed(f"the chat template failed: {exc}") from None
        if len(text) > _RENDERED_MAX:
            msg = "the rendered conversation is over 64 MiB"
            raise TemplateFailed(msg)
        return text

    def continuation_prompt(self, messages: Sequence[Any], generated: str, *,
                            tools: Any = None, extra: Mapping[str, Any] | None = None,
                            continue_final: bool = False) -> str:
        """The text prompt that continues the assistant's answer `generated` to
        `messages`: the conversation rendered with the generation prompt, then the
        answer so far. With `continue_final` the last message is the assistant's own
        beginning: rendered without a generation prompt and cut after its text, as
        transformers does for `continue_final_message`. A leading BOS token is left
        out: the server's completion tokenizer adds its own (two would change what the
        model sees)."""
        if continue_final:
            last = messages[-1] if messages else None
            content = last.get("content") if isinstance(last, Mapping) else None
            if not isinstance(content, str) or not content.strip():
                msg = "continue_final_message: the last message has no text to continue"
                raise TemplateFailed(msg)
            text = self.render(messages, add_generation_prompt=False, tools=tools,
                               extra=extra)
            end = text.rfind(content.strip())
            if end < 0:
                msg = "continue_final_message: the template does not show the last message"
                raise TemplateFailed(msg)
            text = text[:end + len(content.strip())]
        else:
            text = self.render(messages, add_generation_prompt=True, tools=tools, extra=extra)
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text + generated


def _from_config(value: Any) -> str:
    """`chat_template` from tokenizer_config.json: a string, or [{name, template}, ...]
    with "default" taken (else the first)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else ""
    return ""
