"""Compiles constraints to xgrammar grammars off the engine's step path, and caches them.

Background threads compile (half the CPUs, as vLLM's structured-output manager sizes its pool, and at
least two: xgrammar compiles outside the GIL, and one slow constraint, e.g. a regex that takes seconds,
must not hold up the others, also on a machine of one or two CPUs), and one more thread compiles the
sources over LARGE_SOURCE_CHARS, one at a time (the source's size is the proxy: a short one that expands,
`(a|b){200000}`, still compiles among the others); `submit` returns at once with a future. Futures are
cached by `Constraint.key` (least recently used dropped past `cache_size`), so a request whose constraint
was seen before gets a finished future and waits for nothing. The xgrammar vocabulary is built in that
thread on the first submit, so a server that never sees a constraint never pays for it; xgrammar itself is
imported there too (it imports transformers: ~2 s of every engine start, where no request asks for a
constraint, saved).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.schema_patterns import json_escaped, xgrammar_regex

if TYPE_CHECKING:
    import xgrammar as xgr

    from sluice.engine.text.tokenizer import Tokenizer

# xgrammar prefixes its messages with "[12:09:21] /project/cpp/regex_converter.cc:83: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


# The character class xgrammar gives length- or format-bounded JSON strings lets control characters
# through (its unbounded strings exclude them, as RFC 8259 requires); `strict_json_strings` closes it.
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


# xgrammar's grammars of these formats let through strings the format refuses (and parsers with it, Python's
# `ipaddress` and `datetime` among them): an IPv4 octet with a leading zero ("01.2.3.4", octal to some
# parsers; in an IPv6 address too), a day its month lacks ("2023-02-30", "2023-11-31", Feb 29 of 2023) or
# the year 0000, a leap second (":60", valid at a few instants only), a hostname label over 63 characters.
# They compile as these patterns instead, which keep the rest of xgrammar's grammar (its lowercase
# hostnames, its time offsets). A hostname's 253 characters in all stay unchecked.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# Years 0001-9999, as Python's datetime has them (RFC 3339's 0000 too, which `date.fromisoformat` refuses).
_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
# RFC 3986's IPv6address, its last 32 bits as two groups or an IPv4 address (whose octets xgrammar's own
# grammar let have leading zeros: "::01.2.3.4").
_H16 = r"[0-9a-fA-F]{1,4}"
_LS32 = rf"({_H16}:{_H16}|({_OCTET}\.){{3}}{_OCTET})"
_IPV6 = "|".join(
    [
        rf"({_H16}:){{6}}{_LS32}",
        rf"::({_H16}:){{5}}{_LS32}",
        rf"({_H16})?::({_H16}:){{4}}{_LS32}",
        *(rf"(({_H16}:){{0,{n}}}{_H16})?::({_H16}:){{{4 - n}}}{_LS32}" for n in (1, 2)),
        rf"(({_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
        rf"(({_H16}:){{0,4}}{_H16})?::{_LS32}",
        rf"(({_H16}:){{0,5}}{_H16})?::{_H16}",
        rf"(({_H16}:){{0,6}}{_H16})?::",
    ]
)
STRICT_FORMATS = {
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "hostname": rf"^{_LABEL}(\.{_LABEL})*$",
    "ipv6": rf"^({_IPV6})$",
}
# Keywords whose values are data, never schemas: a "format" or "pattern" in them is neither.
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
# A group's `?` quantifier (and its lazy `??`), outside character classes and escapes.
_OPTIONAL_GROUP = re.compile(r"(\\.|\[(?:\\.|[^\]])*\])|\)\?\??")


def xgrammar_schema(node: object) -> object:
    """A JSON schema (or a structural tag holding schemas) as xgrammar compiles it to the grammar the schema
    means: each format of STRICT_FORMATS made the pattern that enforces it (beside such a format a schema
    has no pattern: `Constraint` refuses one), each pattern's optional groups written `{0,1}` (given
    `(xy+)?`, xgrammar's patterns match "y": the group's first part went optional on its own), and its
    literal quotes, backslashes and control characters written as their JSON escapes (`json_escaped`),
    after `xgrammar_regex`. A structural tag's `{"type": "regex"}` format matches text, not a JSON string
    (no JSON schema has that type): `xgrammar_regex` alone."""
    if isinstance(node, list):
        return [xgrammar_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "regex":  # a structural tag's regex format: it matches text
        pattern = node.get("pattern")
        return {**node, "pattern": xgrammar_regex(pattern, text=True)} if isinstance(pattern, str) else node
    rewritten = {k: v if k in _DATA_KEYWORDS else xgrammar_schema(v) for k, v in node.items()}
    format_pattern = STRICT_FORMATS.get(node["format"]) if isinstance(node.get("format"), str) else None
    if format_pattern is not None and "pattern" not in node:
        del rewritten["format"]
        rewritten["pattern"] = format_pattern
    if isinstance(rewritten.get("pattern"), str):
        rewritten["pattern"] = json_string_regex(rewritten["pattern"])
    if isinstance(rewritten.get("patternProperties"), dict):
        properties = rewritten["patternProperties"].items()
        rewritten["patternProperties"] = {json_string_regex(k): v for k, v in properties}
    return rewritten


def json_string_regex(pattern: str) -> str:
    """A schema's pattern as xgrammar is to match it against a JSON string's text."""
    return bounded_optional_groups(json_escaped(xgrammar_regex(pattern, text=False)))


def bounded_optional_groups(pattern: str) -> str:
    """The regex `pattern` with each group's `?` quantifier written `{0,1}`: the same strings."""
    return _OPTIONAL_GROUP.sub(lambda m: m[1] or "){0,1}", pattern)


def structural_tag_grammar(source: str) -> xgr.Grammar:
    """The grammar of a structural tag's JSON text, in either form `Constraint` takes (the older one
    through xgrammar's StructuralTagItem list, as vLLM compiles it)."""
    import xgrammar as xgr

    tag = xgrammar_schema(json.loads(source))
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return xgr.Grammar.from_structural_tag(items, tag["triggers"])


def strict_json_strings(ebnf: str) -> str:
    """The EBNF of an xgrammar JSON schema grammar with control characters banned inside every string."""
    return ebnf.replace(_LENIENT_STRING_CHAR, _STRICT_STRING_CHAR)


class GrammarCompileError(Exception):
    """The constraint's source does not compile; the message says why (without the field)."""


# A constraint whose source is longer than this compiles in a lane of its own, one at a time: compile time
# and memory grow faster than the source (a 10,000-value enum, 120 kB, ~1 s with SmolLM2's vocabulary; a
# 200,000-value one, 3 MB, 300 s and 1.2 GB with the tiny Llama's), and a few such requests held every
# worker from everyone's grammars. Below it (a 3,000-value enum, 36 kB, ~0.15 s; tool schemas of a few kB)
# they share the others.
LARGE_SOURCE_CHARS = 64 * 1024


class GrammarCompiler:
    """Thread-safe. `submit` from the engine thread; compilation runs in `num_workers` threads (None:
    half the CPUs this process may use, at least two), a source over LARGE_SOURCE_CHARS in one more
    thread of its own."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = 256,
        num_workers: int | None = None,
    ) -> None:
        if cache_size < 1:
            raise ValueError("cache_size: must be >= 1")
        if num_workers is None:
            num_workers = max(2, (len(os.sched_getaffinity(0)) + 1) // 2)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="sluice-grammar")
        self._large_executor = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar-large")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # the first compiles build it once
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0  # total time spent compiling (vocabulary setup excluded)

    def submit(self, constraint: Constraint) -> Future:
        """A future of the compiled grammar; it raises GrammarCompileError if the source is invalid."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            executor = self._large_executor if len(key[1]) > LARGE_SOURCE_CHARS else self._executor
            future = executor.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def cancel(self, constraint: Constraint, future: Future) -> bool:
        """Cancels the compile of `future` (from `submit(constraint)`) if it has not started, for when no
        request waits for it any longer: a worker is then free for the next, and the cache forgets it, so
        a later request of the same source compiles afresh. One under way runs on (xgrammar cannot stop
        it) and stays cached. Returns whether it was cancelled."""
        with self._lock:
            if not future.cancel():
                return False
            if self._cache.get(constraint.key) is future:
                del self._cache[constraint.key]
        return True

    def shutdown(self) -> None:
        for executor in (self._executor, self._large_executor):
            executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        import xgrammar as xgr  # here, in the worker thread, not at start: module docstring

        compiler = self._get_compiler()
        kind, source = key
        start = time.perf_counter()
        try:
            if kind == "json_schema":
                schema = json.dumps(xgrammar_schema(json.loads(source)))
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
                compiled = compiler.compile_grammar(strict_json_strings(str(grammar)))
            elif kind == "regex":
                compiled = compiler.compile_regex(xgrammar_regex(source, text=True))
            elif kind == "structural_tag":
                compiled = compiler.compile_grammar(strict_json_strings(str(structural_tag_grammar(source))))
            else:
                compiled = compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(_XGRAMMAR_PREFIX.sub("", str(e)).strip()) from e
        finally:
            with self._lock:
                self.num_compiles += 1
                self.compile_seconds += time.perf_counter() - start
        return compiled

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from sluice.engine.structured.tokenizer_info import build_tokenizer_info

                info = build_tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                # xgrammar's own cache stays off: ours holds the futures, so in-flight compiles are shared.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler
