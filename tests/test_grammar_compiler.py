"""The grammar compiler's workers: a constraint still compiling (a regex can take seconds) does not hold
up the next one, also in the default pool of a one- or two-CPU machine, and the compiled grammars are the
ones asked for; the cache keeps the grammars used last."""

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
NEXT = Constraint(regex="(yes|no)")


def grammar_compiler(model_dir: str, num_workers: int | None) -> GrammarCompiler:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids, num_workers=num_workers)


@pytest.mark.parametrize(("num_workers", "num_cpus"), [(2, None), (None, 1), (None, 2)])
def test_a_constraint_compiles_while_another_is_still_compiling(
    llama_dir: str, num_workers: int | None, num_cpus: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the default pool on a machine of one or two CPUs (half of them is one thread)."""
    if num_cpus is not None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cpus)))
    compiler = grammar_compiler(llama_dir, num_workers=num_workers)
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
        slow_grammar = slow.result(timeout=PATIENCE_S)
    finally:
        release.set()
        compiler.shutdown()
    for compiled, accepted, refused in ((grammar, "yes", "maybe"), (slow_grammar, "ab@cd", "ab")):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(accepted) and matcher.is_completed()
        matcher = xgr.GrammarMatcher(compiled)
        assert not (matcher.accept_string(refused) and matcher.is_completed())


@pytest.mark.parametrize("num_workers", [None, 1])
def test_the_default_pool_has_at_least_one_worker(llama_dir: str, num_workers: int | None) -> None:
    compiler = grammar_compiler(llama_dir, num_workers)
    try:
        assert compiler.submit(NEXT).result(timeout=PATIENCE_S) is not None
        assert compiler.num_compiles == 1
    finally:
        compiler.shutdown()


def test_the_cache_keeps_the_grammars_used_last(llama_dir: str) -> None:
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match="^cache_size: must be >= 1$"):
        GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids, cache_size=0)
    compiler = GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids, cache_size=2, num_workers=1)
    a, b, c = (Constraint(regex=f"({x}|z)") for x in "abc")
    try:
        for constraint in (a, b, a, c):  # a used again after b: c takes b's place
            compiler.submit(constraint).result(timeout=PATIENCE_S)
        assert (compiler.num_compiles, compiler.num_cache_hits) == (3, 1)
        kept = compiler.submit(a)  # kept, and now used last
        compiler.submit(b).result(timeout=PATIENCE_S)  # compiled again, in c's place
        assert (compiler.num_compiles, compiler.num_cache_hits) == (4, 2)
        assert compiler.submit(a) is kept
        compiler.submit(c).result(timeout=PATIENCE_S)  # compiled again, in b's place
        compiler.submit(b).result(timeout=PATIENCE_S)
        assert (compiler.num_compiles, compiler.num_cache_hits) == (6, 3)
    finally:
        compiler.shutdown()
