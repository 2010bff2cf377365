"""Chat templates rendered with jinja2 exactly as Hugging Face transformers renders them.

Same environment as `transformers.utils.chat_template_utils`: an `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension, a `tojson` filter that does not escape
HTML, `raise_exception` and `strftime_now` globals, and the `{% generation %}` tag (rendered as plain text).
Messages reach the template as transformers passes them: None-valued keys dropped, and a message's reasoning,
under any of its names (`REASONING_FIELDS`), under "reasoning_content" and "thinking" too ("reasoning" only
where the caller used it). `ChatTemplateOptions` are the rendering
options of vLLM's chat API (extra template variables, the generation prompt, continuing the last message).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
# transformers' marker: appended to the message to continue, it shows where that message's content ends in
# the render (searching for the content itself can find it in the template's own text, "end" in "<|im_end|>").
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# What a template's render raises on a conversation it cannot take (vLLM answers 400 to ValueError,
# TypeError, RuntimeError and TemplateError): RecursionError (a recursive macro over a deeply nested tool
# schema), the sandbox's OverflowError (a range past its limit), a ZeroDivisionError.
_RENDER_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    ValueError,
    RuntimeError,
    ArithmeticError,
)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation is rendered, as vLLM's chat API (and transformers' apply_chat_template) takes it.

    `chat_template_kwargs`: extra template variables, e.g. {"enable_thinking": False} for Qwen3's templates;
    a name Sluice passes the template itself is refused when rendering. `add_generation_prompt`: the
    assistant turn's header after the conversation. `continue_final_message`: the prompt ends right after
    the last message's content (an assistant's), for the model to continue it.
    """

    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.chat_template_kwargs, Mapping):
            raise InvalidRequestError(
                "chat_template_kwargs", f"must be a mapping, got {type(self.chat_template_kwargs).__name__}"
            )
        key = next((key for key in self.chat_template_kwargs if not isinstance(key, str)), None)
        if key is not None:
            raise InvalidRequestError("chat_template_kwargs", f"keys must be strings, got {key!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message",
                "cannot be combined with add_generation_prompt: set add_generation_prompt to false",
            )

    def as_kwargs(self) -> dict[str, Any]:
        """The keywords `Tokenizer.apply_chat_template` and `encode_chat` take."""
        return {
            "chat_template_kwargs": self.chat_template_kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


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
        special_tokens: Mapping[str, str],
        options: ChatTemplateOptions | None = None,
        **variables: Any,
    ) -> str:
        """Render `messages`; `special_tokens` maps e.g. "bos_token" to "<s>" (template variables), as do
        `variables` (e.g. tools) and `options.chat_template_kwargs`, which must not rename any of them.

        Raises InvalidRequestError("messages", ...) for a bad conversation or a template `raise_exception`,
        InvalidRequestError naming the option for options this conversation or template cannot take.
        """
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        options = options or ChatTemplateOptions()
        conversation = [_normalize_message(i, message) for i, message in enumerate(messages)]
        context = {"tools": None, "documents": None, **special_tokens, **variables}
        _check_no_reserved_names(options.chat_template_kwargs, context)
        final_content = None
        if options.continue_final_message:
            final_content = _content_to_continue(conversation[-1], len(conversation) - 1)
            conversation[-1] = {**conversation[-1], "content": final_content + CONTINUE_FINAL_MESSAGE_TAG}
        variables = {"add_generation_prompt": options.add_generation_prompt, **options.chat_template_kwargs}
        try:
            try:
                rendered = self._template.render(messages=conversation, **variables, **context)
            except _RENDER_ERRORS:
                # A template that reads every message's content (SmolLM2's, ChatML's) fails on messages
                # without one (transformers' form: a tool-call message, content None): they get vLLM's
                # empty content instead, as over gRPC (a ChatMessage's content is "" when unset).
                if not (with_content := _with_empty_content(conversation)):
                    raise
                rendered = self._template.render(messages=with_content, **variables, **context)
        except InvalidRequestError:
            raise
        except _RENDER_ERRORS as e:
            raise InvalidRequestError("messages", f"chat template failed: {e}") from e
        return rendered if final_content is None else _cut_at_tag(rendered, final_content)


def _check_no_reserved_names(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    """`chat_template_kwargs` may not replace what Sluice passes the template: its variables (`context`,
    messages, add_generation_prompt) and the environment's functions (raise_exception, namespace, ...)."""
    reserved = {"messages", "add_generation_prompt", *context, *_environment().globals}
    name = next((name for name in sorted(kwargs) if name in reserved), None)
    if name is not None:
        raise InvalidRequestError(
            f"chat_template_kwargs.{name}",
            "is a name Sluice passes the chat template itself; it cannot be set",
        )


def _content_to_continue(message: Mapping[str, Any], index: int) -> str:
    """The content of the last message, which continue_final_message needs to be an assistant's text."""
    role = message.get("role")
    if role != "assistant":
        raise InvalidRequestError(
            "continue_final_message",
            f"the last message (messages[{index}]) must be an assistant message, got role {role!r}",
        )
    content = message.get("content")
    if not isinstance(content, str):
        raise InvalidRequestError(
            "continue_final_message", f"the last message (messages[{index}]) has no text content to continue"
        )
    return content


def _cut_at_tag(rendered: str, content: str) -> str:
    """The render up to the end of the continued message's `content`, as transformers cuts it: at the
    tag, or, where the template trimmed the spacing after the tag, at the tag less the spacing before it."""
    tag = CONTINUE_FINAL_MESSAGE_TAG.strip()
    if content.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError(
            "continue_final_message",
            "the last message's content does not appear in the chat template's render, so the prompt cannot "
            "end inside it",
        )
    position = rendered.rindex(tag)
    if rendered[position : position + len(CONTINUE_FINAL_MESSAGE_TAG)] == CONTINUE_FINAL_MESSAGE_TAG:
        return rendered[:position]
    return rendered[:position].rstrip()


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


def _with_empty_content(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`conversation` with content "" on its messages that have none; None if it has none such."""
    if all("content" in message for message in conversation):
        return None
    return [message if "content" in message else {**message, "content": ""} for message in conversation]


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
