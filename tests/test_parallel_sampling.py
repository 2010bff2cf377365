"""The frontend's fan-out of n > 1 (`ParallelSampling` inside `OutputProcessor`), without a model: what
goes to the core and when, and how each way sample 0 can end without a token ends the others."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.sampling_params import SamplingParams

PROMPT = [5, 6, 7]
PARAMS = SamplingParams(temperature=1.0, seed=40, max_tokens=4, n=3, prompt_logprobs=1)


def _token(request_id: str, token_id: int, finish_reason: str | None = None) -> CoreOutput:
    return CoreOutput(request_id, [token_id], [], 0, 0, 1.0, 2.0, finish_reason=finish_reason)


def _started(params: SamplingParams = PARAMS) -> tuple[OutputProcessor, AddRequest]:
    processor = OutputProcessor(None)
    first = processor.add_request(AddRequest("a", PROMPT, params, 1.0, priority=2, cache_salt="s"))
    return processor, first


def test_sample_zero_goes_first_and_the_others_follow_its_first_output():
    processor, first = _started()
    assert (first.request_id, first.params) == ("a#0", PARAMS.for_sample(0))
    assert (first.params.n, first.params.seed, first.params.prompt_logprobs) == (1, 40, 1)
    processed = processor.process([_token("a#0", 9)])
    assert [(o.request_id, o.index, o.token_ids) for o in processed.outputs] == [("a", 0, (9,))]
    assert [(a.request_id, a.params) for a in processed.to_add] == [
        ("a#1", PARAMS.for_sample(1)),
        ("a#2", PARAMS.for_sample(2)),
    ]
    assert [(a.params.seed, a.params.prompt_logprobs) for a in processed.to_add] == [(41, None), (42, None)]
    assert all(
        (a.prompt_token_ids, a.arrival_time, a.priority, a.cache_salt) == (PROMPT, 1.0, 2, "s")
        for a in processed.to_add
    )
    assert processor.process([_token("a#0", 3)]).to_add == []  # sent once


def test_a_request_with_n_1_goes_to_the_core_as_it_is():
    processor = OutputProcessor(None)
    add = AddRequest("b", PROMPT, SamplingParams(seed=40), 1.0)
    assert processor.add_request(add) is add
    assert processor.process([_token("b", 9, "length")]).to_add == []


@pytest.mark.parametrize("n", [1, 3])
def test_stop_strings_stay_in_the_frontend(n: int):
    """The detokenizers match stop strings; the core never reads them, so they do not cross the pipe once
    per sample (32 of 1 MB with n = 16 were 512 MB there)."""
    params = SamplingParams(seed=40, n=n, stop=("x" * 1000, "y"), include_stop_str_in_output=True)
    processor = OutputProcessor(None)
    first = processor.add_request(AddRequest("c", PROMPT, params, 1.0))
    to_add = processor.process([_token(first.request_id, 9)]).to_add
    sent = [first, *to_add]
    assert [a.request_id for a in sent] == (["c"] if n == 1 else ["c#0", "c#1", "c#2"])
    expected = [replace(params.for_sample(i) if n > 1 else params, stop=()) for i in range(n)]
    assert [a.params for a in sent] == expected


def test_aborting_before_sample_zeros_first_output_ends_the_unsent_samples_here():
    processor, _ = _started()
    processed = processor.abort(["a"])
    assert processed.to_abort == ["a#0"]
    assert [(o.index, o.finish_reason) for o in processed.outputs] == [(1, "abort"), (2, "abort")]
    late = processor.process([_token("a#0", 9)])  # a token sampled before the core saw the abort
    assert late.to_add == []
    final = processor.process([CoreOutput.aborted("a#0")])
    assert [(o.index, o.finish_reason) for o in final.outputs] == [(0, "abort")]
    assert processor.abort(["a"]).to_abort == []  # nothing left of it


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("regex", "does not compile: oops"),
        ContextLengthError("max_tokens", "needs 9 KV blocks but the cache has 8"),
    ],
)
def test_a_refused_sample_zero_ends_every_sample_with_its_error_and_field(error: InvalidRequestError):
    processor, _ = _started()
    processed = processor.process([CoreOutput.refused("a#0", error)])
    assert processed.to_add == []
    assert [(o.index, o.finish_reason, o.error, o.invalid_field) for o in processed.outputs] == [
        (i, "error", str(error), error.field) for i in range(3)
    ]
    # each sample raises what the core raised: a too-long request stays a ContextLengthError
    assert {(type(o.refusal()), str(o.refusal())) for o in processed.outputs} == {(type(error), str(error))}
    assert processor.owner("a#1") is None and processor.owner("a#2") is None


def test_sample_zero_aborted_before_its_first_token_aborts_the_others():
    processor, _ = _started()
    processed = processor.process([CoreOutput.aborted("a#0")])
    assert processed.to_add == []
    assert [(o.index, o.finish_reason) for o in processed.outputs] == [(i, "abort") for i in range(3)]


def test_sample_zero_that_ran_and_failed_ends_alone_and_the_others_are_sent():
    processor, _ = _started()
    failed = CoreOutput("a#0", [], [], 0, 0, 1.0, None, finish_reason="error", error="sampling failed: boom")
    processed = processor.process([failed])
    assert [(o.index, o.finish_reason) for o in processed.outputs] == [(0, "error")]
    assert [a.request_id for a in processed.to_add] == ["a#1", "a#2"]


def test_an_id_colliding_with_a_live_sample_is_refused():
    processor, _ = _started()
    with pytest.raises(InvalidRequestError, match=r"^request_id: 'a#1' is already in use by 'a'$"):
        processor.add_request(AddRequest("a#1", PROMPT, SamplingParams(), 1.0))


def test_aborting_an_ended_request_leaves_another_whose_core_id_is_its_id_alone():
    """`x@5` ended; `x` (core id `x@5`, as AsyncEngine numbers them) waits to send samples 1 and 2.
    Aborting `x@5` took `x`'s core id for its own and ended those samples here: `x` never finished."""
    processor = OutputProcessor(None)
    short = processor.add_request(AddRequest("x@5", PROMPT, SamplingParams(), 1.0), core_request_id="x@5@4")
    assert processor.process([_token(short.request_id, 9, "length")]).outputs[-1].finished
    processor.add_request(AddRequest("x", PROMPT, PARAMS, 1.0), core_request_id="x@5")
    processed = processor.abort(["x@5"])
    assert (processed.outputs, processed.to_abort) == ([], [])
    assert [a.request_id for a in processor.process([_token("x@5#0", 9)]).to_add] == ["x@5#1", "x@5#2"]
