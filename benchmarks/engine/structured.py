"""Constrained decoding cost on the embedded SmolLM2-135M, offline: TPOT with a JSON schema against the
same requests unconstrained, at concurrency 1 and 16; grammar compile time, first and cached.

    python -m sluice.benchmarks.engine.structured                  # table on stdout
    python -m sluice.benchmarks.engine.structured --json out.json

Same workload both ways: the constrained run goes first (greedy, so it ends when the JSON is complete);
the unconstrained run then generates exactly as many tokens per request (ignore_eos, max_tokens set to
the constrained length), so TPOT compares like with like. Grammars are compiled before timing TPOT.
The same prompts run twice on one engine, so it runs with prefix caching off (the second run would
otherwise skip the prefills the first ran); the table's "cached" column shows that none was cached.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from sluice.benchmarks.engine.completion_timing import tpot_ms
from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.grammar_compiler import GrammarCompiler
from sluice.engine.structured.tokenizer_info import build_tokenizer_info
from sluice.engine.structured.tool_calls import Tool, ToolUse

ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["customer", "city", "items", "urgent"],
    "additionalProperties": False,
}
NAMES = ["Ana Silva", "Bo Chen", "Carla Diaz", "Dev Patel", "Eli Cohen", "Fay Wong", "Gus Berg", "Hana Ito"]
CITIES = ["Lisbon", "Taipei", "Lima", "Pune", "Haifa", "Macau", "Oslo", "Kyoto"]
PRODUCTS = ["apples", "pencils", "cables", "tea", "notebooks", "lamps", "socks", "cups"]


@dataclass(frozen=True)
class TpotRow:
    concurrency: int
    num_requests: int
    output_tokens: int
    num_complete_json: int  # constrained outputs that ended (not cut by max_tokens) and parse
    tpot_unconstrained_ms: float
    tpot_json_schema_ms: float
    cached_tokens: int  # prompt tokens served from the prefix cache, both runs (prefix caching is off)

    @property
    def ratio(self) -> float:
        return self.tpot_json_schema_ms / self.tpot_unconstrained_ms


def conversation(i: int) -> list[dict[str, str]]:
    name, city = NAMES[i % len(NAMES)], CITIES[(3 * i) % len(CITIES)]
    items = ", ".join(f"{2 + (i + k) % 9} {PRODUCTS[(i + 2 * k) % len(PRODUCTS)]}" for k in range(1 + i % 3))
    text = f"{name} from {city} ordered {items}. Please ship it as soon as possible."
    return [{"role": "user", "content": f"Extract the order as JSON: {text}"}]


def run(llm: LLM, conversations: list, params: list[SamplingParams], concurrency: int) -> list[Completion]:
    completions = []
    for start in range(0, len(conversations), concurrency):
        completions += llm.chat(
            conversations[start : start + concurrency], params[start : start + concurrency]
        )
    return completions


def measure_tpot(llm: LLM, concurrency: int, num_requests: int, max_tokens: int) -> TpotRow:
    conversations = [conversation(i) for i in range(num_requests)]
    constraint = Constraint(json_schema=json.dumps(ORDER))
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
    ] * num_requests
    with_schema = run(llm, conversations, constrained, concurrency)
    free = [
        SamplingParams(temperature=0.0, max_tokens=len(c.token_ids), ignore_eos=True) for c in with_schema
    ]
    without = run(llm, conversations, free, concurrency)
    assert [len(c.token_ids) for c in without] == [len(c.token_ids) for c in with_schema]
    complete = sum(c.finish_reason == "stop" and _is_json(c.text) for c in with_schema)
    output_tokens = sum(len(c.token_ids) for c in with_schema)
    cached = sum(c.cached_tokens for c in with_schema + without)
    return TpotRow(
        concurrency, num_requests, output_tokens, complete, tpot_ms(without), tpot_ms(with_schema), cached
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def measure_compile(llm: LLM) -> dict[str, float]:
    """Seconds: the vocabulary for xgrammar, then each constraint compiled the first time and again."""
    core = llm.engine.core
    start = time.perf_counter()
    build_tokenizer_info(core.tokenizer, core.model_info.vocab_size, core.eos_token_ids)
    seconds = {"tokenizer_info": time.perf_counter() - start}
    compiler = GrammarCompiler(core.tokenizer, core.model_info.vocab_size, core.eos_token_ids)
    compiler.submit(Constraint(regex="x")).result()  # builds the vocabulary in the compile thread
    tools = ToolUse(
        (Tool("add_to_order", parameters=json.dumps(ORDER["properties"]["items"]["items"])),), "required"
    )
    constraints = {
        "json_schema": Constraint(json_schema=json.dumps(ORDER)),
        "regex": Constraint(regex=r"[A-Z][a-z]{1,10} [0-9]{1,3}(, [A-Z][a-z]{1,10} [0-9]{1,3}){0,4}"),
        "grammar": Constraint(grammar='root ::= item ("," item){0,5}\nitem ::= [a-z]{1,8} "=" [0-9]{1,4}'),
        "choice": Constraint(choice=("positive", "negative", "neutral")),
        "tool_required": tools.constraint(),
    }
    for name, constraint in constraints.items():
        for attempt in ("first", "cached"):
            start = time.perf_counter()
            compiler.submit(constraint).result()
            seconds[f"{name}_{attempt}"] = time.perf_counter() - start
    compiler.shutdown()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.structured", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=16, help="requests per TPOT run")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    llm = LLM(enable_prefix_caching=False)
    compile_seconds = measure_compile(llm)
    warm = SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint(json_schema=json.dumps(ORDER)))
    llm.chat([conversation(0)], warm)  # compiles the grammar in the engine and warms the model
    print("Grammar compile seconds (first / cached)")
    print(f"  tokenizer_info (once per engine): {compile_seconds['tokenizer_info']:.3f}")
    for name in ("json_schema", "regex", "grammar", "choice", "tool_required"):
        first, cached = compile_seconds[f"{name}_first"], compile_seconds[f"{name}_cached"]
        print(f"  {name:<14} {first:>8.4f} / {cached:.6f}", flush=True)
    rows = [measure_tpot(llm, c, args.requests if c > 1 else 4, args.max_tokens) for c in (1, 16)]
    print("\nTPOT, SmolLM2-135M offline (greedy, same tokens per request both ways)")
    print(
        f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'json ok':>7} "
        f"{'free ms':>8} {'schema ms':>9} {'ratio':>6} {'cached':>6}"
    )
    for r in rows:
        print(
            f"{r.concurrency:>11} {r.num_requests:>8} {r.output_tokens:>7} {r.num_complete_json:>7} "
            f"{r.tpot_unconstrained_ms:>8.2f} {r.tpot_json_schema_ms:>9.2f} {r.ratio:>6.3f} "
            f"{r.cached_tokens:>6}"
        )
    if args.json:
        result = {"tpot": [asdict(r) | {"ratio": r.ratio} for r in rows], "compile_seconds": compile_seconds}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
