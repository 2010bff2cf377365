"""Text <-> token ids, and chat rendering, on top of a Hugging Face `tokenizers.Tokenizer`.

Encoding follows transformers' `AutoTokenizer` on the same directory: the post-processor in
`tokenizer.json` alone decides which special tokens `add_special_tokens=True` adds (transformers 5 ignores
`add_bos_token` in `tokenizer_config.json` when a `tokenizer.json` exists), and the file's own
normalizer and pre-tokenizer run as written (transformers 4 and llama.cpp do the same; transformers 5
replaces an old Llama 2 / Mistral v0.1 file's `Prepend("▁")` normalizer with its own Metaspace, so a
leading space encodes differently there). Decoding never applies transformers'
`clean_up_tokenization_spaces`, so streamed text and whole decodes agree.

A model may ship named chat templates beside its default one (`additional_chat_templates/tool_use.jinja`, a
list of {"name", "template"} in `tokenizer_config.json`, a GGUF's `tokenizer.chat_template.tool_use`): as
transformers' `get_chat_template` and llama.cpp do, a request with tools is rendered by "tool_use" when the
model has one, by the default template otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.json_file import read_json_object
from sluice.engine.text.byte_level import ByteLevelVocab
from sluice.engine.text.chat_messages import json_text, lone_surrogate_error
from sluice.engine.text.chat_template import ChatTemplate, ChatTemplateOptions

# Named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TOOL_USE_TEMPLATE = "tool_use"  # the named template transformers and llama.cpp render a request with tools by
# A text is encoded first in prefixes of this many characters per token of the model's context, each this
# many times the last and none past half the text, so that one far past the context is refused from a
# prefix: encoded whole, 60 MB took the server 127 s and 3.7 GB to refuse (the tiny preset's tokenizer).
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_GROWTH = 4


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (one id, a list of ids, or absent) as a tuple of ids; anything else is
    refused naming the field."""
    if value is None:
        return ()
    ids = tuple(value) if isinstance(value, list) else (value,)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id: must be a token id or a list of them, got {value!r}")
    return ids


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a `Tokenizer` is made of, as plain data: how the engine core hands its tokenizer to a
    frontend process (`tokenizer_json` already holds any post-processor the constructor installed)."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    name: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    named_chat_templates: dict[str, str] = field(default_factory=dict)


class Tokenizer:
    """A tokenizer plus the model's chat template and end-of-sequence ids.

    `backend` may be mutated: when `add_bos_token` is set and its post-processor does not already prepend
    `bos_token`, one that does is installed (GGUF vocabularies come without a post-processor).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: tuple[int, ...],
        add_bos_token: bool,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        """named_chat_templates: name -> source of the templates beside the default `chat_template`."""
        self.backend = backend
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        head = () if eos_id is None else (eos_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(head + tuple(eos_token_ids)))
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        self.chat_template = None if chat_template is None else ChatTemplate(chat_template)
        self.named_chat_templates = {
            name: ChatTemplate(source) for name, source in (named_chat_templates or {}).items()
        }
        if add_bos_token and self.bos_token_id is not None:
            _ensure_bos_prepended(backend, bos_token, self.bos_token_id)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a file it cannot read
            raise ValueError(f"model: {str(path)!r} is no tokenizer the tokenizers library reads: {e}") from e
        # A file saved with truncation or padding on (a training run's last state: some checkpoints ship
        # max_length 2048) would cut or pad every prompt; transformers turns both off as it loads.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(directory / "tokenizer_config.json")
        special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        special = {name: token for name, token in special.items() if token is not None}
        _add_missing_tokens(backend, config, special.values())
        generation = _read_json(directory / "generation_config.json")
        templates = _load_chat_templates(directory, config)
        return cls(
            backend,
            chat_template=templates.pop("default", None),
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            eos_token_ids=token_ids(generation.get("eos_token_id")),
            add_bos_token=False,
            name=directory.name,
            special_tokens=special,
            named_chat_templates=templates,
        )

    def spec(self) -> TokenizerSpec:
        return TokenizerSpec(
            tokenizer_json=self.backend.to_str(),
            chat_template=None if self.chat_template is None else self.chat_template.source,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            eos_token_ids=self.eos_token_ids,
            name=self.name,
            special_tokens=dict(self.special_tokens),
            named_chat_templates={name: t.source for name, t in self.named_chat_templates.items()},
        )

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        return cls(
            tokenizers.Tokenizer.from_str(spec.tokenizer_json),
            chat_template=spec.chat_template,
            bos_token=spec.bos_token,
            eos_token=spec.eos_token,
            eos_token_ids=spec.eos_token_ids,
            add_bos_token=False,
            name=spec.name,
            special_tokens=spec.special_tokens,
            named_chat_templates=spec.named_chat_templates,
        )

    @functools.cached_property
    def byte_level_vocab(self) -> ByteLevelVocab | None:
        """Each id's bytes, for streaming decode by table, when the tokenizer is byte-level BPE; else None.
        Built on first use (tens of milliseconds for a 150k vocabulary)."""
        return ByteLevelVocab.of(self.backend)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, *, field: str = "text", context: int | None = None
    ) -> list[int]:
        """Through `encode_batch`, which releases the GIL while it runs (`encode` holds it: a 4 MB prompt
        tokenized by SmolLM2's tokenizer in a worker thread stalled the frontend's event loop for 2.2-2.5 s;
        now for 62-77 ms, the ids' conversion to a list) and is no slower.

        Raises InvalidRequestError naming `field` for text holding a lone surrogate, which no UTF-8 text
        holds (`tokenizers` refuses it with a TypeError that names no cause). `context` (the model's, for a
        prompt): a text that a prefix shows to be `context` tokens or more, which leaves no room for an
        output token, raises ContextLengthError naming the prompt without being encoded whole."""
        if context is not None:
            self._refuse_past_context(text, add_special_tokens, field, context)
        return self._encode(text, add_special_tokens, field)

    def _refuse_past_context(self, text: str, add_special_tokens: bool, field: str, context: int) -> None:
        """Encodes ever longer prefixes of a long `text`, each cut at a whitespace where its last half has
        one: the pre-tokenizers split there, so the prefix's tokens are the whole's first ones (a cut
        inside a word may split it into a few more: the margin). No prefix past half the text: one that
        fits costs at most ~1.7x its encoding (those a prefix could refuse are past 16 characters a token)."""
        margin = 16 + context // 16
        chars = PREFIX_CHARS_PER_TOKEN * context
        while 2 * chars < len(text):
            cut = max(text.rfind(" ", chars // 2, chars), text.rfind("\n", chars // 2, chars))
            cut = chars if cut <= 0 else cut
            count = len(self._encode(text[:cut], add_special_tokens, field))
            if count >= context + margin:
                raise ContextLengthError(
                    "prompt",
                    f"its first {cut:,} of {len(text):,} characters alone are {count:,} tokens, past the "
                    f"model's context of {context:,} tokens (shorten it, or set truncate_prompt_tokens)",
                )
            chars *= PREFIX_GROWTH

    def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        try:
            (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        except TypeError:
            if (error := lone_surrogate_error(field, text)) is None:
                raise
            raise error from None
        return encoding.ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation to the prompt text. InvalidRequestError("messages") without a template.

        `tools` are JSON-schema function tools, passed to the template as transformers passes them; with
        tools, the model's "tool_use" template renders the conversation where it has one. The rest are
        `ChatTemplateOptions`' (transformers' own arguments of these names, its **kwargs as a mapping)."""
        options = ChatTemplateOptions(
            chat_template_kwargs or {}, add_generation_prompt, continue_final_message
        )
        template = self.chat_template
        if tools is not None:
            template = self.named_chat_templates.get(TOOL_USE_TEMPLATE, template)
        if template is None:
            raise InvalidRequestError(
                "messages", f"model {self.name!r} has no chat template; send text instead"
            )
        return template.render(
            messages,
            special_tokens=self.special_tokens,
            options=options,
            tools=None if tools is None else list(tools),
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        context: int | None = None,
    ) -> list[int]:
        """Render (as `apply_chat_template`), then encode without adding special tokens (the template has
        them), as transformers. A lone surrogate in the render is refused naming "tools" where the tools
        hold one (a JSON schema's "\\ud83d" escape), else "messages". `context`: as `encode`'s."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt,
            tools,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        try:
            return self.encode(text, add_special_tokens=False, field="messages", context=context)
        except ContextLengthError:
            raise
        except InvalidRequestError as error:  # a lone surrogate: the tools' where they hold one
            raise lone_surrogate_error("tools", json_text(tools)) or error from None


def _ensure_bos_prepended(backend: tokenizers.Tokenizer, bos_token: str, bos_token_id: int) -> None:
    if backend.encode("a", add_special_tokens=True).ids[:1] == [bos_token_id]:
        return
    template = processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_token_id)],
    )
    existing = backend.post_processor
    backend.post_processor = template if existing is None else processors.Sequence([existing, template])


def _add_missing_tokens(backend: tokenizers.Tokenizer, config: dict, named: Any) -> None:
    # transformers adds tokens listed in the config but absent from tokenizer.json, keeping their flags.
    for entry in config.get("added_tokens_decoder", {}).values():
        if backend.token_to_id(entry["content"]) is None:
            flags = {
                k: entry[k]
                for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                if k in entry
            }
            backend.add_tokens([tokenizers.AddedToken(entry["content"], **flags)])
    missing = [token for token in named if backend.token_to_id(token) is None]
    if missing:
        backend.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
        )


def _load_chat_templates(directory: Path, config: dict) -> dict[str, str]:
    """Template name -> source, the default one as "default", read as transformers reads them: template files
    (`chat_template.jinja`, `additional_chat_templates/<name>.jinja`, as transformers >= 4.47 saves them)
    take priority over the config's `chat_template` (one template, or a list of {"name", "template"})."""
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = directory / "chat_template.jinja"
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        files.update({path.name.removesuffix(".jinja"): path for path in sorted(extra.glob("*.jinja"))})
    if files:
        return {name: path.read_text(encoding="utf-8") for name, path in files.items()}
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return {} if template is None else {"default": template}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}
