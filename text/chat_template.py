"""Chat templates rendered as Hugging Face's ``apply_chat_template`` renders them.

A model's template is Jinja code from its checkpoint, run in jinja2's immutable sandbox with
what transformers gives it: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` tag (transformers uses it to find assistant tokens; here it
renders its body), ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson``
filter that neither escapes HTML nor forces ASCII, and ``dict`` / ``namespace`` that refuse
underscore names. The variables: ``messages``, ``tools`` and ``documents`` (None here),
``add_generation_prompt``, and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...).
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRefused(ValueError):
    """The template raised (``raise_exception``) or could not render these messages."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                      ).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes ({name!r})")


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` without underscore attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):  # Namespace's signature: ``self`` may be a keyword too
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)``, and nothing else of the type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def compile_template(source: str) -> jinja2.Template:
    """The template, compiled once; ValueError (naming the line) if it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: line {exc.lineno}: "
                         f"{exc.message}") from None


def render(template: jinja2.Template, messages: list[dict], add_generation_prompt: bool,
           special_tokens: dict[str, str]) -> str:
    """The conversation as text. ``TemplateRefused`` carries the template's own message
    (``raise_exception``) or what failed; the request that caused it is at fault."""
    try:
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.TemplateError as exc:
        raise TemplateRefused(f"the chat template refused the messages: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError) as exc:
        raise TemplateRefused(f"the chat template failed on the messages: "
                              f"{type(exc).__name__}: {exc}") from None
