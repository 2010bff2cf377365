"""A constraint with a source over LARGE_SOURCE_CHARS compiles in a lane of its own, one at a time: a small
one submitted after two large ones compiles while the first still runs and the second waits. Before, they
shared the workers: a 200,000-value enum compiled for 300 s (1.2 GB) in one, and a few such requests held
every worker from every other request's grammar."""

from __future__ import annotations

import threading

import pytest
from checkpoints import VOCAB_SIZE

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.grammar_compiler import LARGE_SOURCE_CHARS, GrammarCompiler
from sluice.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)
PATIENCE_S = 60.0


def _large_regex(letter: str) -> str:
    """A regex longer than LARGE_SOURCE_CHARS: one of many words, each of `letter` and a number."""
    words, size = [], 0
    while size <= LARGE_SOURCE_CHARS:
        words.append(f"{letter}{len(words)}")
        size += len(words[-1]) + 1
    return "(" + "|".join(words) + ")"


def test_a_small_grammar_compiles_while_large_ones_hold_their_own_lane(llama_dir: str, monkeypatch) -> None:
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids, num_workers=1)
    first, second = Constraint(regex=_large_regex("x")), Constraint(regex=_large_regex("y"))
    started = {first.key: threading.Event(), second.key: threading.Event()}
    gate = threading.Event()
    compile_ = compiler._compile

    def compile_gated(key):
        if key in started:  # a large compile holds its worker until the test sets the gate
            started[key].set()
            assert gate.wait(PATIENCE_S)
        return compile_(key)

    monkeypatch.setattr(compiler, "_compile", compile_gated)
    try:
        large = [compiler.submit(first), compiler.submit(second)]
        assert started[first.key].wait(PATIENCE_S)
        small = compiler.submit(Constraint(regex="b+"))
        assert small.result(PATIENCE_S) is not None  # the one other worker is free
        # One large compile at a time: the second waits for the first's thread.
        assert not started[second.key].is_set() and not large[0].done()
        gate.set()
        assert all(future.result(PATIENCE_S) is not None for future in large)
    finally:
        gate.set()
        compiler.shutdown()
