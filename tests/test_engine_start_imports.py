"""What an engine imports to start and serve plain requests: not xgrammar (and the transformers it
imports), nor torch's dynamo or sympy. Each cost every engine core ~0.5-2 s to start (every server
and engine the suite starts paid them); xgrammar now comes with a request's first constraint, in the
grammar compiler's thread.
Checked in a fresh interpreter, where nothing else imported them first."""

from __future__ import annotations

import subprocess
import sys

from service_harness import PATIENCE_S

HEAVY = ("xgrammar", "transformers", "sympy", "torch._dynamo")

_START_AND_SERVE = """
import sys
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

def loaded():
    return [name for name in sys.argv[2:] if name in sys.modules]

checkpoint = LLM(sys.argv[1], block_size=16, num_blocks=64)
engines = [checkpoint, LLM(load_format="dummy", preset="tiny", num_blocks=64)]
plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
tokens = [len(engine.generate([[1, 2, 3, 4, 5]], plain)[0].token_ids) for engine in engines]
print(tokens, loaded())
constrained = SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint(regex="(yes|no)"))
print(checkpoint.generate(["hello"], constrained)[0].text in ("yes", "no"), loaded())
"""


def test_an_engine_serving_plain_requests_imports_no_grammar_library_dynamo_or_sympy(llama_dir):
    result = subprocess.run(
        [sys.executable, "-c", _START_AND_SERVE, llama_dir, *HEAVY],
        capture_output=True, text=True, timeout=PATIENCE_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plain, constrained = result.stdout.splitlines()[-2:]
    assert plain == "[4, 4] []"  # a checkpoint and a preset (random weights shaped on the meta device)
    assert constrained == "True ['xgrammar', 'transformers']"  # the first constraint brings xgrammar
