"""The grammar compiler's default pool on a machine of one or two CPUs (half of them is one thread): a
constraint still compiling (a regex can take seconds) does not hold up the next one there either."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import xgrammar as xgr
from service_harness import PATIENCE_S

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.grammar_compiler import GrammarCompiler
from sluice.engine.text.tokenizer import Tokenizer

SLOW = Constraint(regex="[a-z]{1,40}@[a-z]{1,20}")
NEXT = Constraint(choice=("yes", "no"))


@pytest.mark.parametrize("num_cpus", [1, 2])
def test_the_default_pool_compiles_beside_a_slow_constraint(
    llama_dir: str, num_cpus: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cpus)))
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    vocab_size = json.loads((Path(llama_dir) / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)  # the default pool
    compiling, release = threading.Event(), threading.Event()
    compile_now = compiler._compile

    def compile_held(key: tuple[str, str]) -> xgr.CompiledGrammar:
        if key == SLOW.key:  # a compile that has not finished until the test says so
            compiling.set()
            assert release.wait(PATIENCE_S)
        return compile_now(key)

    compiler._compile = compile_held
    try:
        slow = compiler.submit(SLOW)
        assert compiling.wait(PATIENCE_S)
        grammar = compiler.submit(NEXT).result(timeout=PATIENCE_S)
        assert not slow.done()
        release.set()
        assert slow.result(timeout=PATIENCE_S) is not None
    finally:
        release.set()
        compiler.shutdown()
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string("yes") and matcher.is_completed()
