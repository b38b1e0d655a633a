"""A model's own chat template (Jinja, from its tokenizer_config.json or its GGUF's
`tokenizer.chat_template`), rendered as transformers renders one: a sandbox, blocks trimmed,
`raise_exception` and `strftime_now` callable, `tojson` without ASCII escapes, the special
tokens' texts as `bos_token` / `eos_token`. The text is then tokenized without a BOS of the
tokenizer's own: the template writes one where the model wants it."""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that does not compile, or refuses the conversation; one line."""


def _raise(message: str):
    raise ChatTemplateError(f"chat_template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat_template: not a Jinja template ({e})") from None


def render(template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "") -> str:
    """The conversation in the template, ending where the next assistant reply begins when
    `add_generation_prompt`."""
    try:
        return _compiled(template).render(messages=messages,
                                          add_generation_prompt=add_generation_prompt,
                                          bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat_template: {str(e).splitlines()[0][:200]}") from None
