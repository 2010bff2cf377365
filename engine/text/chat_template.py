"""Chat templates rendered with jinja2 exactly as Hugging Face transformers renders them.

Same environment as `transformers.utils.chat_template_utils`: an `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension, a `tojson` filter that does not escape
HTML, `raise_exception` and `strftime_now` globals, and the `{% generation %}` tag (rendered as plain text).
Messages reach the template as transformers passes them: None-valued keys dropped, and a message's reasoning,
under any of its names (`REASONING_FIELDS`), under all of them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.engine.errors import InvalidRequestError

# Names a message's reasoning goes by: Qwen3 / DeepSeek templates read the first, gpt-oss's the second,
# vLLM's API sends the third.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One compiled chat template. Compilation happens once per distinct source string."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: invalid jinja2 template: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
        **variables: Any,
    ) -> str:
        """Render `messages`; `special_tokens` maps e.g. "bos_token" to "<s>" (template variables).

        Raises InvalidRequestError("messages", ...) for a bad conversation or a template `raise_exception`.
        """
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        conversation = [_normalize_message(i, message) for i, message in enumerate(messages)]
        context = {"tools": None, "documents": None, **special_tokens, **variables}
        try:
            return self._template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **context
            )
        except InvalidRequestError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise InvalidRequestError("messages", f"chat template failed: {e}") from e


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    # transformers drops None-valued keys (OpenAI clients send content=None) before rendering.
    if not isinstance(message, Mapping):
        raise InvalidRequestError(
            "messages", f"message {index} must be a mapping, got {type(message).__name__}"
        )
    normalized = {key: value for key, value in message.items() if value is not None}
    # transformers' `_alias_reasoning_fields`: the first name given fills "reasoning_content", and
    # "thinking" unless the message has its own.
    reasoning = next((normalized[key] for key in REASONING_FIELDS if key in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    return normalized


def _raise_exception(message: str) -> None:
    raise InvalidRequestError("messages", str(message))


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that rejects underscore-prefixed attributes, as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} must not start with '_'")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)
