"""Speculative decoding settings: validated config, `sluice serve` flags, and the n-gram lookup."""

from __future__ import annotations

import random
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file
from scheduler_driver import make_request

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.ngram_proposer import NgramProposer, propose_ngram
from sluice.service.cli import build_parser, load_commands
from sluice.service.serve_command import engine_config


def _serve(*flags: str):
    return engine_config(build_parser(load_commands()).parse_args(["serve", "--preset", "tiny", *flags]))


def test_serve_flags_build_the_speculative_config() -> None:
    assert _serve().speculative is None
    config = _serve(
        "--speculative", "ngram", "--num-speculative-tokens", "5", "--ngram-min", "2", "--ngram-max", "3"
    )
    assert config.speculative == SpeculativeConfig(
        "ngram", num_speculative_tokens=5, ngram_min=2, ngram_max=3
    )
    config = _serve("--speculative", "draft", "--draft-model", "/models/small")
    assert (config.speculative.method, config.speculative.draft_model) == ("draft", "/models/small")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(method="medusa"), "speculative: must be one of ('ngram', 'draft')"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens: must be in 1..16"),
        (dict(ngram_min=0), "ngram_min: must be >= 1"),
        (dict(ngram_min=3, ngram_max=2), "ngram_max: must be >= ngram_min"),
        (dict(method="draft"), "draft_model: speculative method 'draft' needs a draft model"),
        (dict(draft_model="/m"), "draft_model: is only used with speculative method 'draft'"),
        # They were taken and did nothing.
        (
            dict(method="draft", draft_model="/m", ngram_max=6),
            "ngram_max: is only used with speculative method",
        ),
        (
            dict(method="draft", draft_model="/m", ngram_min=2),
            "ngram_min: is only used with speculative method",
        ),
    ],
)
def test_invalid_settings_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig(**kwargs)


def test_the_batch_size_that_pauses_speculation_is_a_flag_checked_like_the_others() -> None:
    config = _serve("--speculative", "ngram", "--speculative-disable-by-batch-size", "16")
    assert config.speculative.disable_by_batch_size == 16
    with pytest.raises(ValueError, match=r"^speculative-disable-by-batch-size: needs --speculative$"):
        _serve("--speculative-disable-by-batch-size", "16")
    with pytest.raises(ValueError, match=r"^disable_by_batch_size: must be >= 2"):
        _serve("--speculative", "ngram", "--speculative-disable-by-batch-size", "1")


def test_draft_model_without_draft_speculation_is_refused() -> None:
    with pytest.raises(ValueError, match="draft-model: needs --speculative"):
        _serve("--draft-model", "/models/small")


@pytest.mark.parametrize("flags", [("--num-speculative-tokens", "3"), ("--ngram-max", "4")])
def test_a_speculative_flag_at_its_default_without_speculative_is_refused_too(flags) -> None:
    """A value other than the default was refused, the default itself accepted and ignored."""
    with pytest.raises(ValueError, match=rf"^{flags[0][2:]}: needs --speculative$"):
        _serve(*flags)


def test_ngram_lookup_prefers_the_longest_suffix_and_the_latest_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [9, 8]  # "1 2 3" at 0 beats the later "2 3" at 5
    assert propose_ngram(tokens, 1, 2, 2) == [7, 6]  # n <= 2: the latest "2 3" is at 5
    assert propose_ngram(tokens, 1, 2, 10) == [7, 6, 1, 2, 3]  # runs up to the end of the sequence
    assert propose_ngram([4, 5, 6], 1, 3, 2) == []  # no earlier match
    assert propose_ngram([5, 5], 1, 3, 3) == [5]
    assert propose_ngram([5], 1, 3, 3) == []


def _lookup_by_hand(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The lookup's definition, one candidate at a time."""
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_lookup_equals_its_definition_on_random_sequences() -> None:
    """Small alphabets, so that suffixes recur, overlap and run into the end."""
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randrange(40))]
        ngram_min = rng.randrange(1, 4)
        ngram_max, k = rng.randrange(ngram_min, 6), rng.randrange(1, 6)
        expected = _lookup_by_hand(tokens, ngram_min, ngram_max, k)
        assert propose_ngram(tokens, ngram_min, ngram_max, k) == expected, (tokens, ngram_min, ngram_max, k)


def test_the_ngram_proposer_follows_a_growing_request_and_forgets_it() -> None:
    """Its copy of the request's tokens is extended, not rebuilt, as outputs arrive (a few at a time under
    speculation); each proposal equals the lookup over the request's whole sequence."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    proposer = NgramProposer(config)
    rng = random.Random(1)
    request = make_request("r", [rng.randrange(4) for _ in range(20)], max_tokens=100)
    for _ in range(30):
        request.output_token_ids.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
        expected = propose_ngram(request.all_token_ids, 1, 3, 3)
        proposals = proposer.propose([request])
        assert (proposals["r"].token_ids if "r" in proposals else ()) == tuple(expected)
    proposer.free(["r"])
    assert proposer.propose([make_request("r", [1, 2, 1], max_tokens=4)])["r"].token_ids == (2, 1)


def test_a_draft_model_that_does_not_load_is_refused_naming_draft_model(llama_dir, tmp_path) -> None:
    """Its loader's message named `model`, the target's flag."""
    missing = str(tmp_path / "missing")
    spec = SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=missing)
    with pytest.raises(ValueError, match=rf"^draft_model: '{missing}' does not exist: give a local "):
        LLM(llama_dir, speculative=spec)


def test_a_draft_whose_weights_do_not_fit_is_refused_naming_draft_model(llama_dir, tmp_path) -> None:
    """A tensor missing from the draft was reported in the target's words, as if the target were broken."""
    draft = tmp_path / "draft"
    shutil.copytree(llama_dir, draft)
    tensors = load_file(draft / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    spec = SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=str(draft))
    missing = re.escape("draft_model: weights: missing ['model.layers.1.mlp.down_proj.weight']")
    with pytest.raises(ValueError, match=rf"^{missing}$"):
        LLM(llama_dir, speculative=spec)


def test_more_drafts_than_a_graph_addresses_run_eagerly(llama_dir) -> None:
    """k + 1 = 17 positions past the one 16-token block a graph of an 8-token context addresses: the engine
    refused to start ("query_len: 17 positions exceed ..."), on a CPU, which captures no graph, too."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = [[5, 6, 5]]
    plain = LLM(llama_dir, max_model_len=8).generate(prompt, params)
    assert LLM(llama_dir, max_model_len=8, speculative=spec).generate(prompt, params)[0].token_ids == (
        plain[0].token_ids
    )
