"""Speculative decoding (n-gram prompt lookup) on the embedded SmolLM2-135M, offline, batch 1: TPOT with
speculation against the same requests without it, in the same run, on four workloads.

    python -m sluice.benchmarks.engine.speculative                 # table on stdout
    python -m sluice.benchmarks.engine.speculative --json out.json

  grounded:   the model is asked to repeat a ~300-token passage from its prompt with one light edit: its
              output copies its input, where prompt lookup drafts well.
  chat:       free-form questions: little to copy, so drafts are few and mostly rejected; speculation
              must not make it slower.
  extraction: a person's name, city, job and employer from a short text into a JSON schema (structured
              output): the values are copied from the prompt, the keys between them forced by the
              grammar (drafted too), and each verify row is grammar-masked.
  penalised:  how-to questions with repetition_penalty 1.1 (the value many models' generation configs
              ship): each verify row is penalised as if the drafts before it were accepted, and the
              penalty steers the output away from the words that the lookup would copy.

Greedy both ways, so the two runs produce the same tokens (checked). Requests run one at a time,
alternating between the engine without and the engine with speculation. TPOT per request is (last token
time - first token time) / (tokens - 1); the table gives the mean over requests, the speedup (TPOT off /
TPOT on) and the acceptance rate per draft position.

Every request (and the warm-up) is a conversation of its own, so neither engine's prefix cache holds
more of a prompt than the chat template's system prompt that all share; the "cached" column gives the
prompt tokens each engine served from it and flags a workload served more.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace

from sluice.benchmarks.engine.cache_hits import CacheHits, common_prefix_len
from sluice.benchmarks.engine.completion_timing import tpot_ms
from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.outputs import EngineStats
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

PASSAGES = [
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the island itself. "
    "For more than a century its keepers climbed the hundred and twelve steps each evening to light the "
    "lamp, wind the clockwork that turned the lens, and record the weather in a leather logbook. The "
    "logbooks survive: they describe storms that tore slates from the roof, winters when the supply boat "
    "could not land for six weeks, and summers so calm that the keepers fished from the rocks below the "
    "tower. In 1952 the lamp was electrified, and in 1989 the last keeper left when the light became "
    "automatic. Today the keepers' cottage is a small museum. Visitors can read the logbooks, climb the "
    "tower on clear afternoons, and look out over the same grey water that the keepers watched for "
    "ships in trouble. The granite walls are still cold to the touch even in August, and the wind "
    "still finds every gap in the old window frames.",
    "Our team reviewed the quarterly report and found three issues that need attention before the board "
    "meeting. First, the revenue table counts the March orders twice, which inflates the total by about "
    "four percent. Second, the section on hiring refers to a plan that was cancelled in January and "
    "should be replaced with the current plan, which adds two engineers and one designer in the second "
    "half of the year. Third, the chart of support tickets uses a different scale from last quarter's "
    "chart, so the two cannot be compared at a glance. None of these issues changes the conclusions of "
    "the report, but each of them would raise questions that take time away from the discussion of the "
    "budget. We suggest fixing the table and the hiring section this week and redrawing the chart with "
    "the old scale. After that, the report can be sent to the board together with the budget proposal "
    "and the summary of customer interviews.",
]
# Edits of each passage: request i edits passage i % 2 with its (i // 2)-th edit, so no two are the same.
EDITS = [
    [
        "Replace the word 'granite' with 'stone'",
        "Replace the word 'lighthouse' with 'beacon'",
        "Replace the word 'keepers' with 'wardens'",
        "Replace the word 'logbooks' with 'journals'",
    ],
    [
        "Replace the word 'board' with 'committee'",
        "Replace the word 'report' with 'review'",
        "Replace the word 'chart' with 'graph'",
        "Replace the word 'budget' with 'spending plan'",
    ],
]
CHAT = [
    "Give me three tips for learning to play the guitar as an adult.",
    "Why is the sky blue? Explain it simply.",
    "Write a short poem about a cat watching the rain.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "How do I keep basil alive on a windowsill?",
    "Explain what a mortgage is to a teenager.",
    "Suggest a name for a small bakery by the sea, and say why.",
    "What are the rules of chess for how a knight moves?",
]
HOW_TO = [
    "Describe, step by step, how to bake a loaf of bread at home.",
    "List the steps to change a flat tyre on a bicycle, with a sentence on each.",
    "Explain how to plan a vegetable garden for a small backyard.",
    "How do I write a good cover letter? Go through it part by part.",
    "Walk me through setting up a freshwater aquarium for beginners.",
    "Tell me how to prepare for a job interview, from the week before to the day itself.",
    "Outline how to paint a room, from choosing the paint to cleaning the brushes.",
    "Explain how compound interest works, with a worked example.",
]
REPETITION_PENALTY = 1.1
PEOPLE = [
    ("Maria Lopez", "Valencia", "nurse", "Saint Anne Hospital"),
    ("Tomasz Nowak", "Gdansk", "welder", "Baltic Shipyards"),
    ("Aiko Tanaka", "Sapporo", "data analyst", "Northern Rail Company"),
    ("Samuel Okafor", "Lagos", "architect", "Okafor and Partners"),
    ("Ingrid Berg", "Tromso", "marine biologist", "Arctic Research Institute"),
    ("Rahul Mehta", "Pune", "software engineer", "Lotus Systems"),
    ("Chloe Martin", "Lyon", "baker", "Boulangerie du Parc"),
    ("Diego Alvarez", "Cordoba", "history teacher", "San Martin High School"),
]
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "string", "maxLength": 60} for key in ("name", "city", "job", "employer")},
    "required": ["name", "city", "job", "employer"],
    "additionalProperties": False,
}
WARM_UP = [{"role": "user", "content": "Say hello in three languages."}]
# distinct requests per workload
MAX_REQUESTS = min(len(PASSAGES) * len(EDITS[0]), len(CHAT), len(PEOPLE), len(HOW_TO))


@dataclass(frozen=True)
class Row:
    workload: str
    num_requests: int
    output_tokens: int
    identical: bool
    tpot_off_ms: float
    tpot_on_ms: float
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    acceptance_per_position: tuple[float, ...]
    cached_tokens_off: int  # prompt tokens each engine served from its prefix cache
    cached_tokens_on: int
    cache_hits_unexpected: bool  # beyond the chat template's prefix that every prompt shares

    @property
    def speedup(self) -> float:
        return self.tpot_off_ms / self.tpot_on_ms

    @property
    def acceptance(self) -> float:
        return self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1)


def grounded(i: int) -> list[dict[str, str]]:
    passage, edit = PASSAGES[i % len(PASSAGES)], EDITS[i % len(PASSAGES)][i // len(PASSAGES)]
    return [
        {
            "role": "user",
            "content": f"{edit} in the passage below and write out the whole passage, changing nothing "
            f"else.\n\nPassage:\n{passage}",
        }
    ]


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": CHAT[i % len(CHAT)]}]


def extraction(i: int) -> list[dict[str, str]]:
    name, city, job, employer = PEOPLE[i % len(PEOPLE)]
    text = (
        f"{name} works as a {job} at {employer} in {city}. Before joining {employer}, {name} studied in "
        f"{city} and still lives near the city centre."
    )
    ask = "Extract the person's name, city, job and employer from the text above as JSON."
    return [{"role": "user", "content": f"{text}\n\n{ask}"}]


def how_to(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": HOW_TO[i % len(HOW_TO)]}]


def measure(
    name: str, conversations: list, off: LLM, on: LLM, params: SamplingParams, warm_up: Completion
) -> Row:
    """`warm_up`: the engines' warm-up, whose prompt shares the chat template's prefix with every one."""
    before = on.engine.stats()
    without, with_spec = [], []
    for conversation in conversations:
        without += off.chat([conversation], params)
        with_spec += on.chat([conversation], params)
    after = on.engine.stats()
    # What the prompts share, among themselves or with the warm-up (one request shares the template's).
    prompts = [c.prompt_token_ids for c in without]
    shared = max(common_prefix_len(prompts), common_prefix_len([warm_up.prompt_token_ids, *prompts]))
    hits_off, hits_on = CacheHits.of(without, shared), CacheHits.of(with_spec, shared)
    return Row(
        workload=name,
        num_requests=len(conversations),
        output_tokens=sum(len(c.token_ids) for c in with_spec),
        identical=[c.token_ids for c in without] == [c.token_ids for c in with_spec],
        tpot_off_ms=tpot_ms(without),
        tpot_on_ms=tpot_ms(with_spec),
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_draft_tokens=after.num_accepted_draft_tokens - before.num_accepted_draft_tokens,
        acceptance_per_position=_acceptance_per_position(before, after),
        cached_tokens_off=hits_off.cached_tokens,
        cached_tokens_on=hits_on.cached_tokens,
        cache_hits_unexpected=hits_off.unexpected or hits_on.unexpected,
    )


def _acceptance_per_position(before: EngineStats, after: EngineStats) -> tuple[float, ...]:
    rates = []
    for j, (drafts, accepted) in enumerate(
        zip(after.draft_tokens_per_position, after.accepted_draft_tokens_per_position, strict=True)
    ):
        drafts -= before.draft_tokens_per_position[j] if j < len(before.draft_tokens_per_position) else 0
        accepted -= (
            before.accepted_draft_tokens_per_position[j]
            if j < len(before.accepted_draft_tokens_per_position)
            else 0
        )
        rates.append(accepted / drafts if drafts else 0.0)
    return tuple(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.speculative", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=4, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per engine (CPU)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--requests: must be in [1, {MAX_REQUESTS}] (a repeated request is a prefix-cache hit)")
    spec = SpeculativeConfig(
        "ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
    )
    off = LLM(args.model, kv_cache_memory_bytes=args.kv_cache_memory)
    on = LLM(args.model, kv_cache_memory_bytes=args.kv_cache_memory, speculative=spec)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    (warm_up,) = off.chat([WARM_UP], warm)
    on.chat([WARM_UP], warm)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    schema = Constraint(json_schema=json.dumps(EXTRACTION_SCHEMA))
    workloads = [
        ("grounded", grounded, greedy),
        ("chat", chat, greedy),
        ("extraction", extraction, replace(greedy, constraint=schema)),
        ("penalised", how_to, replace(greedy, repetition_penalty=REPETITION_PENALTY)),
    ]
    rows = [
        measure(name, [conversation(i) for i in range(args.requests)], off, on, params, warm_up)
        for name, conversation, params in workloads
    ]
    print(
        f"Speculative decoding, ngram k={spec.num_speculative_tokens} n={spec.ngram_min}..{spec.ngram_max}, "
        f"{off.engine.model_info.name}, batch 1, greedy"
    )
    print(
        f"{'workload':>10} {'reqs':>4} {'tokens':>6} {'same':>4} {'off ms':>7} {'on ms':>7} "
        f"{'speedup':>7} {'accept':>6} {'cached off/on':>13}  per position"
    )
    for r in rows:
        per_position = " ".join(f"{rate:.2f}" for rate in r.acceptance_per_position)
        same = "yes" if r.identical else "NO"
        cached = f"{r.cached_tokens_off}/{r.cached_tokens_on}{'!' if r.cache_hits_unexpected else ''}"
        print(
            f"{r.workload:>10} {r.num_requests:>4} {r.output_tokens:>6} {same:>4} {r.tpot_off_ms:>7.2f} "
            f"{r.tpot_on_ms:>7.2f} {r.speedup:>7.2f} {r.acceptance:>6.2f} {cached:>13}  {per_position}"
        )
    for r in rows:
        if r.cache_hits_unexpected:
            print(f"warning: {r.workload}: prompts hit the prefix cache beyond the chat template's prefix")
    if args.json:
        result = [asdict(r) | {"speedup": r.speedup, "acceptance": r.acceptance} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"config": asdict(spec), "rows": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
