"""Engine-level behaviour: greedy parity with transformers under chunking and batching, batch
invariance, preemption, stop strings, aborts, and no leaked blocks."""

from __future__ import annotations

import gc
import os
import random
import signal
import weakref
from dataclasses import replace

import pytest
import torch
from checkpoints import EOS_ID, VOCAB_SIZE

from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.kv_cache.block_pool import BlockPool
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 12


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_greedy(directory: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.mark.parametrize("checkpoint", ["llama_dir", "mistral_dir", "qwen2_dir"])
def test_greedy_tokens_equal_transformers_when_chunked_and_batched(checkpoint, request):
    directory = request.getfixturevalue(checkpoint)
    prompts = _prompts(10, seed=1)
    # A 24-token budget splits most prompts into several chunks that share steps with decodes.
    llm = LLM(directory, max_num_batched_tokens=24, max_num_seqs=8, block_size=16)
    completions = llm.generate(prompts, GREEDY)
    expected = _hf_greedy(directory, prompts, NUM_NEW)
    for completion, want in zip(completions, expected, strict=True):
        assert completion.token_ids == want
        assert completion.finish_reason == "length"
    assert llm.engine.stats().num_kv_blocks_used == 0


@pytest.fixture(scope="module")
def alone(llama_dir) -> dict[int, list[int]]:
    """Greedy output of each prompt run by itself on a roomy engine."""
    llm = LLM(llama_dir, block_size=16)
    prompts = _prompts(32, seed=7, lo=5, hi=120)
    return {i: llm.generate(p, GREEDY)[0].token_ids for i, p in enumerate(prompts)}


def test_batch_of_32_mixed_lengths_gives_the_same_greedy_outputs(llama_dir, alone):
    prompts = _prompts(32, seed=7, lo=5, hi=120)
    llm = LLM(llama_dir, block_size=16, max_num_batched_tokens=64, max_num_seqs=32)
    completions = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in completions] == [alone[i] for i in range(32)]


def test_preemption_under_a_small_kv_budget_keeps_outputs(llama_dir, alone):
    prompts = _prompts(32, seed=7, lo=5, hi=120)
    # 24 blocks of 16 tokens cannot hold 32 running requests: the newest ones get preempted.
    llm = LLM(llama_dir, block_size=16, num_blocks=24, max_num_batched_tokens=64, max_num_seqs=32)
    completions = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert any(c.num_preemptions > 0 for c in completions)
    assert [c.token_ids for c in completions] == [alone[i] for i in range(32)]
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_seeded_sampling_reproduces_whatever_the_batch(llama_dir):
    llm = LLM(llama_dir)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    prompt = _prompts(1, seed=3)[0]
    first = llm.generate(prompt, params)[0].token_ids
    crowd = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    batched = llm.generate([prompt] + _prompts(5, seed=4), [params, *crowd])
    assert batched[0].token_ids == first
    other_seed = llm.generate(prompt, SamplingParams(temperature=0.9, top_p=0.9, seed=43, max_tokens=10))
    assert other_seed[0].token_ids != first


def test_eos_stops_unless_ignored(llama_dir):
    llm = LLM(llama_dir)
    prompt = _prompts(1, seed=5)[0]
    banned_eos = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[]))[0]
    assert banned_eos.token_ids  # generation happened
    first = banned_eos.token_ids[0]
    others = [t for t in range(VOCAB_SIZE) if t != first] * 3
    stop_ids = [*others[:1023], first]  # MAX_STOP_TOKEN_IDS, the last one hit
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=stop_ids)
    eos_first = llm.generate(prompt, params)[0]
    assert eos_first.token_ids == banned_eos.token_ids[:1]
    assert eos_first.finish_reason == "stop"
    assert eos_first.stop_reason == banned_eos.token_ids[0]
    assert EOS_ID in llm.engine.eos_token_ids


def test_stop_string_found_across_tokens_is_not_emitted(llama_dir):
    # Seeded sampling from the random model yields mostly ASCII text (greedy repeats stray bytes).
    llm = LLM(llama_dir)
    prompt = "the quick brown fox"
    params = dict(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    free = llm.generate(prompt, SamplingParams(**params))[0]
    stop = next(free.text[i : i + 4] for i in range(3, len(free.text)) if free.text[i : i + 4].isalpha())
    cut = free.text.index(stop)
    stopped = llm.generate(prompt, SamplingParams(**params, stop=[stop]))[0]
    assert stopped.text == free.text[:cut]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert len(stopped.token_ids) < len(free.token_ids)
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_chat_messages_use_the_checkpoint_template(llama_dir):
    llm = LLM(llama_dir)
    messages = [{"role": "user", "content": "Hello world!"}]
    completion = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    expected = llm.tokenizer.encode(
        "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert completion.prompt_token_ids == expected
    assert len(completion.token_ids) == 4
    (alone,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # one
    assert (alone.prompt_token_ids, alone.token_ids) == (completion.prompt_token_ids, completion.token_ids)


def test_abort_in_every_state_returns_every_block(llama_dir):
    llm = LLM(llama_dir, block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(_prompts(12, seed=9, lo=20, hi=100)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(6):
        engine.step()
    stats = engine.stats()
    assert stats.num_running > 0 and stats.num_waiting > 0 and stats.num_kv_blocks_used > 0
    outputs = engine.abort([f"r{i}" for i in range(12)])
    assert {o.finish_reason for o in outputs} == {"abort"}
    assert len(outputs) == 12
    assert engine.stats().num_kv_blocks_used == 0
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_a_rejected_prompt_leaves_no_request_behind(llama_dir):
    llm = LLM(llama_dir)
    with pytest.raises(InvalidRequestError, match="token_ids: token id 1000000 is outside the vocabulary"):
        llm.generate([[5, 6, 7], [1_000_000]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    completions = llm.generate([5, 6, 7], GREEDY)
    assert [c.request_id for c in completions] == ["llm-2"]


def test_bad_priorities_and_lengths_are_refused_naming_the_argument_and_leave_the_llm_usable(llama_dir):
    """A priority that is no integer once left its request in the scheduler, whose queue could then order
    no request again: every later call failed."""
    llm = LLM(llama_dir)
    expected = llm.generate([5, 6, 7], GREEDY)[0].token_ids
    with pytest.raises(InvalidRequestError, match=r"^priority: must be an integer, got None$"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, priority=[0, None])
    with pytest.raises(ValueError, match=r"^priority: 1 entries for 2 prompts$"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, priority=[0])
    with pytest.raises(ValueError, match=r"^sampling_params: 1 entries for 2 prompts$"):
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([5, 6, 7], GREEDY, priority=[3])[0].token_ids == expected


def test_a_ctrl_c_inside_a_step_is_raised_between_steps_and_leaves_the_llm_whole(llama_dir, monkeypatch):
    """SIGINT landing inside the block pool's free (a request finishing) raised KeyboardInterrupt there:
    the blocks stayed out of the free queue and in no table, and later calls leaked or failed (KeyError).
    It is raised once the step is over; the aborts find every block."""
    llm = LLM(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [c.token_ids for c in llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)]
    free, signalled = BlockPool.free, []

    def free_under_sigint(pool, blocks):
        if not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode of this thread
        free(pool, blocks)

    monkeypatch.setattr(BlockPool, "free", free_under_sigint)
    # Python's own handler, as in a REPL (a test before may have left SIGINT ignored in this process).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]], SamplingParams(max_tokens=30))
        assert signalled and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert llm.engine.stats().num_kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()
    assert [c.token_ids for c in llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)] == expected


def test_a_request_that_fails_alone_says_why(llama_dir, monkeypatch):
    monkeypatch.setenv("SLUICE_INJECT_FAULT", "sample:llm-1")  # sampling raises for that request only
    good, bad = LLM(llama_dir).generate([[5, 6, 7], [8, 9]], GREEDY)
    assert (good.finish_reason, good.error, len(good.token_ids)) == ("length", None, NUM_NEW)
    assert (bad.finish_reason, bad.token_ids) == ("error", [])
    assert "injected sample fault for request 'llm-1'" in bad.error


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_dropping_the_llm_frees_its_model_at_once(llama_dir, tensor_parallel_size):
    """Its last reference gone, an `LLM`'s model runner, every layer, the weights and the KV cache (and with
    tensor parallelism, rank 0's gloo group, its workers stopped) go at once, not at the cycle collector's
    next run: on a GPU that is the memory the next `LLM` in the process needs."""
    llm = LLM(llama_dir, tensor_parallel_size=tensor_parallel_size, num_blocks=64)
    assert len(llm.generate([5, 6, 7], GREEDY)[0].token_ids) == GREEDY.max_tokens
    executor = llm.engine.model_runner
    runner = executor.runner if tensor_parallel_size > 1 else executor
    kv_cache, weight = runner.kv_caches[0][0], next(runner.model.parameters())
    held = [weakref.ref(obj) for obj in (runner, runner.kernels.tensor_parallel, kv_cache, weight)]
    held += [weakref.ref(module) for module in runner.model.modules()]
    gc.disable()
    try:
        del llm, executor, runner, kv_cache, weight
        assert [type(ref()).__name__ for ref in held if ref() is not None] == []
    finally:
        gc.enable()


def test_a_cuda_device_torch_does_not_see_is_refused_naming_device(llama_dir):
    """Before, torch's AssertionError ("Torch not compiled with CUDA enabled") or an invalid device
    ordinal at the first allocation. (More ranks than devices: test_tensor_parallel.)"""
    visible = torch.cuda.device_count()
    for device in [f"cuda:{visible}"] + ([] if visible else ["cuda"]):
        with pytest.raises(ValueError, match=rf"^device: {device}, but torch sees {visible} CUDA devices"):
            LLM(llama_dir, device=device, num_blocks=8)


def test_a_kv_cache_too_small_for_one_block_is_refused_naming_its_size(llama_dir):
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes: 0\.0 MiB left for the KV cache holds no"):
        LLM(llama_dir, kv_cache_memory_bytes=1)


@pytest.fixture(scope="module")
def typed_llm(llama_dir: str) -> LLM:
    return LLM(llama_dir)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda llm: llm.generate([[1.7, 2.2]], GREEDY),
            InvalidRequestError,
            r"^token_ids: must be integers, got 1\.7$",
        ),
        (
            lambda llm: llm.generate([[True, 5]], GREEDY),
            InvalidRequestError,
            r"^token_ids: must be integers, got True$",
        ),
        (
            lambda llm: llm.generate(b"hi", GREEDY),
            ValueError,
            r"^prompts: bytes are neither text nor token ids",
        ),
        (
            lambda llm: llm.generate(["a", "b"], "x"),
            ValueError,
            r"^sampling_params: must be a SamplingParams or a list",
        ),
        (
            lambda llm: llm.chat(["hi"], GREEDY),
            ValueError,
            r"^messages\[0\]: must be a list of messages",
        ),
        (
            lambda llm: SamplingParams(constraint={"regex": "a"}),
            ValueError,
            r"^constraint: must be a Constraint",
        ),
        (
            lambda llm: SamplingParams(logit_bias=[1, 2]),
            ValueError,
            r"^logit_bias: must map token ids to biases",
        ),
    ],
    ids=[
        "float ids",
        "bool ids",
        "bytes",
        "params string",
        "chat of strings",
        "constraint dict",
        "bias list",
    ],
)
def test_wrong_types_are_refused_naming_the_argument(typed_llm, call, error, message):
    """Float and bool token ids were truncated silently (1.7 -> 1), bytes read as token ids, a string
    for params or a conversation blamed on its length or its first character, a dict constraint failed
    deep in the engine (AttributeError), a list logit_bias with a bare TypeError."""
    with pytest.raises(error, match=message):
        call(typed_llm)
    assert not typed_llm.engine.has_unfinished_requests()


def test_generators_of_prompts_params_and_conversations_are_taken_as_lists(typed_llm):
    """vLLM's LLM.generate takes lists only; a generator gave a bare TypeError ('generator' object is not
    subscriptable / has no len())."""
    prompts, params = ["the quick brown fox", [5, 6, 7]], [GREEDY, replace(GREEDY, max_tokens=3)]
    expected = [c.token_ids for c in typed_llm.generate(prompts, params, priority=[0, 1])]
    got = typed_llm.generate((p for p in prompts), (p for p in params), priority=iter([0, 1]))
    assert [c.token_ids for c in got] == expected
    conversation = [{"role": "user", "content": "hi"}]
    chat = typed_llm.chat((c for c in [conversation, conversation]), GREEDY)
    assert [c.token_ids for c in chat] == [c.token_ids for c in typed_llm.chat([conversation] * 2, GREEDY)]
    assert not typed_llm.engine.has_unfinished_requests()


def test_the_engine_reports_the_most_tokens_a_request_can_hold(llama_dir):
    """SMG's unset max_tokens comes from it: with chunked prefill off and a 32-token budget, every such
    request asked for the rest of the 64-token context and was refused for the budget."""
    llm = LLM(
        llama_dir, max_model_len=64, enable_chunked_prefill=False, max_num_batched_tokens=32, max_num_seqs=8
    )
    assert llm.engine.model_info.max_request_tokens == 32
    assert LLM(llama_dir, max_model_len=64).engine.model_info.max_request_tokens == 64
