"""Splits a chat's output into reasoning and content, delta by delta, as vLLM's `--reasoning-parser`.

Thinking models write their reasoning between `<think>` and `</think>`, then the answer. The tags are in
neither part. As vLLM's parsers (`vllm/reasoning/deepseek_r1_reasoning_parser.py`,
`qwen3_reasoning_parser.py`, `basic_parsers.py`):

- deepseek_r1: the output may lack the opening `<think>` (the chat template put it in the prompt); what
  comes before `</think>` is reasoning, what follows it content; an output without `</think>` is all
  reasoning (it was cut short while thinking).
- qwen3: the same, and a `<tool_call>` followed (past whitespace) by `<function=` or `<function ` ends the
  reasoning without `</think>` (Qwen3.5 may call a tool from inside its thinking); the `<tool_call>` is the
  content's start, as vLLM's streaming split has it (its one-shot split, given a `</think>` after the call,
  ends the reasoning there instead). Only the first `<tool_call>` of the reasoning is looked at.
- both: a prompt whose think block the template closed (`enable_thinking: false` renders
  `<think>\\n\\n</think>\\n\\n`; vLLM's `prompt_is_reasoning_end`) gives content only. A constrained
  output is split as any other where its constraint applies after the think block or writes `</think>`
  itself (the output processor's module says when; elsewhere it is all content, unsplit).

Only the first `<think>` before `</think>` is a tag, as vLLM strips only the first; text before it stays
reasoning (vLLM's one-shot split drops it, its streaming keeps it: the streaming one is followed here, as
it is the one that agrees with itself at every split). After `</think>` the text is content, tags or not.

Streaming: a tag split across deltas (`</th` then `ink>`) is held back until it is resolved, so that the
deltas' parts concatenate to the one-shot split of the whole text, wherever the text was split.
"""

from __future__ import annotations

import re

from sluice.engine.config import REASONING_PARSERS

THINK_START, THINK_END, _TOOL_CALL = "<think>", "</think>", "<tool_call>"
_FUNCTION = "<function"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")


class ReasoningParser:
    """One output's split; `feed` each text delta, the last with `final=True`."""

    def __init__(
        self, name: str, *, prompt_ends_reasoning: bool = False, only_think_end: bool = False
    ) -> None:
        """`only_think_end`: the reasoning ends at `</think>` alone, not at qwen3's tool call (a constrained
        chat's, whose constraint starts at the `</think>` token: a call written while thinking is
        reasoning, and the constrained one follows the block)."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {REASONING_PARSERS}, got {name!r}")
        self._in_reasoning = not prompt_ends_reasoning
        ends_at_call = name == "qwen3" and not only_think_end
        self._tags = [THINK_END, THINK_START] + ([_TOOL_CALL] if ends_at_call else [])
        self._held = ""  # text whose part waits on what follows (a tag's start)

    @classmethod
    def split(cls, name: str, text: str, *, prompt_ends_reasoning: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        return cls(name, prompt_ends_reasoning=prompt_ends_reasoning).feed(text, final=True)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of this delta; what may start a tag is held back unless `final`."""
        text, self._held = self._held + text, ""
        if not self._in_reasoning:
            return "", text
        reasoning = ""
        while True:
            found = [(text.find(tag), tag) for tag in self._tags if tag in text]
            if not found:
                keep = 0 if final else self._partial_tag_length(text)
                self._held = text[len(text) - keep :]
                return reasoning + text[: len(text) - keep], ""
            index, tag = min(found)
            reasoning += text[:index]
            if tag == THINK_END:
                self._in_reasoning = False
                return reasoning, text[index + len(THINK_END) :]
            if tag == THINK_START:
                self._tags.remove(THINK_START)  # only the first is a tag
                text = text[index + len(THINK_START) :]
                continue
            after = text[index + len(_TOOL_CALL) :].lstrip()
            if _FUNCTION_OPEN.match(after):
                self._in_reasoning = False
                return reasoning, text[index:]
            if not final and len(after) <= len(_FUNCTION) and _FUNCTION.startswith(after):
                self._held = text[index:]
                return reasoning, ""
            self._tags.remove(_TOOL_CALL)  # not a call: reasoning, and no later one is looked at
            end = index + len(_TOOL_CALL)
            reasoning, text = reasoning + text[index:end], text[end:]

    def _partial_tag_length(self, text: str) -> int:
        """The longest end of `text` that a tag starts with."""
        return max((n for tag in self._tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def prompt_ends_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt's last think tag closes its block (`<think>\\n\\n</think>\\n\\n` of a template
    with thinking off): the output is then all content."""
    return prompt_tail.rfind(THINK_END) > prompt_tail.rfind(THINK_START)
