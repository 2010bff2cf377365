"""Split-KV prefill attention: a few q tiles after a long context split that context over programs and
merge the slices (`merge_attention_partials`).

The outputs are compared with the plain PyTorch reference (output poisoned with NaN first, and the
partial buffers poisoned too, so that every partial the merge reads must have been written); the launch
is spied on to check when the launcher splits and that a CUDA graph's frozen grid and buffers depend on
max_seq_len only; the merge kernel is compared with its reference on partials with empty slices; and the
real runner, splitting a prompt's chunk after a long prefix, is compared with transformers.
"""

from __future__ import annotations

import math

import pytest
import torch
from checkpoints import VOCAB_SIZE
from paged_batch import DEVICE, KERNEL_DTYPES, make_paged_batch, nan_like, tolerance
from test_kernels_attention import (
    LAYOUTS,
    SCALE,
    SMALL_PREFILL,
    GridRecorder,
    _batch,
    _prefill,
    _prefill_reference,
)
from transformers import AutoModelForCausalLM

import sluice.kernels.prefill_attention as prefill_module
import sluice.kernels.prefill_splits as prefill_splits
from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.model_runner import ModelRunner
from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.merge_attention_partials import (
    merge_attention_partials,
    merge_attention_partials_reference,
)
from sluice.kernels.paged_decode_attention import (
    MAX_SPLITS,
    pick_num_splits,
)
from sluice.kernels.store_kv import store_kv_reference

# (query_len, seq_len): short queries after long contexts (a 3-token verify after 127 cached positions, a
# decode row over 97), a 20-token chunk after 130, a fresh prompt, a chunk ending mid-block, a first token.
SHORT_AFTER_LONG = [(3, 130), (1, 97), (20, 150), (7, 7), (40, 75), (1, 1)]
SMS = device_sm_count(DEVICE)  # what the launcher sizes its splits by (132 off a GPU)
PER_SM = prefill_splits.PREFILL_PROGRAMS_PER_SM


def _single_split(recorder: GridRecorder) -> list[bool]:
    """Whether each recorded prefill launch wrote its output in one split (SINGLE_SPLIT)."""
    return [constexprs["SINGLE_SPLIT"] for constexprs in recorder.constexprs]


@pytest.fixture
def partials(monkeypatch) -> list[tuple[torch.Size, torch.Size]]:
    """The launcher's partial buffers start as NaN (a partial the merge reads but no program wrote fails);
    returns the (part_out, part_lse) shapes allocated."""
    allocate, shapes = prefill_module._split_partials, []

    def poisoned(shape, q):
        part_out, part_lse = allocate(shape, q)
        shapes.append((part_out.shape, part_lse.shape))
        return part_out.fill_(float("nan")), part_lse.fill_(float("nan"))

    monkeypatch.setattr(prefill_module, "_split_partials", poisoned)
    return shapes


@pytest.mark.parametrize(
    ("num_splits", "layout", "sliding_window"),
    [(n, layout, None) for n in (2, 3, 9) for layout in (LAYOUTS[0], LAYOUTS[1], LAYOUTS[3])]
    + [(3, layout, 24) for layout in LAYOUTS[1:]]
    + [(9, LAYOUTS[2], 24), (MAX_SPLITS, LAYOUTS[0], None)],
)
def test_split_prefill_matches_reference_for_every_split_count(num_splits, layout, sliding_window, partials):
    """Each tile cuts its own context into at most num_splits slices of >= 16 positions: short contexts
    use fewer slices than the grid has (the rest mark their rows empty), long ones all of them; in a
    slice some rows see nothing (past their causal limit, before their window)."""
    batch = _batch(SHORT_AFTER_LONG, *layout, seed=num_splits)
    out = _prefill(
        batch, config=SMALL_PREFILL, num_splits=num_splits, partition_size=16, sliding_window=sliding_window
    )
    torch.testing.assert_close(out, _prefill_reference(batch, sliding_window), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_split_prefill_with_the_default_tiles_in_each_dtype(dtype, partials):
    batch = _batch(SHORT_AFTER_LONG, 8, 2, 16, dtype)
    out = _prefill(batch, num_splits=4, partition_size=64)
    torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(dtype))


def test_the_launcher_splits_only_few_tiles_over_long_contexts(monkeypatch):
    """Given max_seq_len, the split count is `pick_num_splits` over the q tiles that can hold rows x KV
    heads, to fill every SM PREFILL_PROGRAMS_PER_SM times; without it, with those units enough for
    NO_SPLIT_WAVE_SHARE of the SMs, or contexts within one partition, one launch writes the output."""
    launches = GridRecorder(prefill_module._prefill_attention_kernel)
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", launches)
    batch = _batch(SHORT_AFTER_LONG, 8, 2, 16)
    md = batch.metadata
    for max_seq_len in (None, md.max_seq_len):
        out = _prefill(batch, config=SMALL_PREFILL, partition_size=16, max_seq_len=max_seq_len)
        torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(torch.float32))
    block_q = SMALL_PREFILL.block_m // 4  # 4 query heads a KV head
    num_q_tiles = batch.q.shape[0] // block_q + md.num_seqs  # the grid's, fewer than 6 x cdiv(40, 4)
    picked = pick_num_splits(num_q_tiles, 2, md.max_seq_len, SMS, 16, programs_per_sm=PER_SM)
    assert picked > 1
    assert launches.grids == [(num_q_tiles * 2, 1), (num_q_tiles * 2, picked)]
    assert _single_split(launches) == [True, False]
    # A 4-token verify at batch 1: the grid has two tiles a KV head, one of them with rows; it counts one.
    verify = prefill_splits.pick_prefill_splits(4, 1, 4, 8, 4, 64, 32768, None, 512, DEVICE)
    assert verify == pick_num_splits(1, 8, 32768, SMS, 512, programs_per_sm=PER_SM) > 1
    # Within one partition (150 <= 512) or with a tile for every SM: no split.
    assert prefill_splits.pick_prefill_splits(72, 6, 40, 2, block_q, 16, 150, None, 512, DEVICE) == 1
    rows = PER_SM * SMS * block_q  # one sequence of as many tiles as the SMs hold
    assert prefill_splits.pick_prefill_splits(rows, 1, rows, 1, block_q, 16, 8192, None, 16, DEVICE) == 1
    # FlashAttention-2's bar: a launch of 0.8 of a wave's units is not split; one unit fewer is.
    wave = math.ceil(prefill_splits.NO_SPLIT_WAVE_SHARE * SMS)
    under = pick_num_splits(wave - 1, 1, 8192, SMS, 16, programs_per_sm=PER_SM)
    for tiles, splits in ((wave, 1), (wave - 1, under)):
        rows = tiles * block_q
        picked = prefill_splits.pick_prefill_splits(rows, 1, rows, 1, block_q, 16, 8192, None, 16, DEVICE)
        assert picked == splits
    assert under > 1
    # A window bounds what a tile reads: W + its rows + a tile, however long the sequence.
    windowed = prefill_splits.pick_prefill_splits(16, 1, 16, 1, 16, 16, 1 << 20, 96, 16, DEVICE)
    assert windowed == pick_num_splits(1, 1, 96 + 16 + 16, SMS, 16, programs_per_sm=PER_SM) == 8


def test_split_grid_and_partials_depend_on_max_seq_len_not_on_the_contexts(monkeypatch, partials):
    """What a CUDA graph freezes (grid, partial buffers) is the same for any seq_lens under one
    max_seq_len: verify graphs, captured with the largest context, replay shorter ones."""
    launches = GridRecorder(prefill_module._prefill_attention_kernel)
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", launches)
    for seed, seq_lens in enumerate(([120, 60, 4], [9, 70, 100])):
        batch = make_paged_batch(
            [4, 4, 4], seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=seed
        )
        store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
        out = _prefill(batch, config=SMALL_PREFILL, partition_size=16, max_seq_len=128)
        torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(torch.float32))
    assert launches.grids[0] == launches.grids[1] and _single_split(launches) == [False, False]
    num_splits = launches.grids[0][1]
    assert 1 < num_splits <= 128 // 16
    assert partials[0] == partials[1] == ((12, 4, num_splits, 16), (12, 4, num_splits))


def test_split_partials_stay_within_the_graph_memory_bound():
    """`split_partials_bound_bytes` (what cuda_graph_runner reserves for verify graphs) holds for every
    batch shape a picked split can take."""
    for head_dim in (64, 128, 256):
        bound = prefill_splits.split_partials_bound_bytes(head_dim, SMS)
        for num_kv_heads, queries_per_kv in ((1, 1), (2, 7), (8, 4), (32, 1)):
            block_m = prefill_module.prefill_config(head_dim, torch.bfloat16, queries_per_kv, 4).block_m
            block_q = block_m // queries_per_kv
            for num_seqs in (1, 2, 5, 16, 64):
                for query_len in (2, 4, 8):
                    num_tokens = num_seqs * query_len
                    splits = prefill_splits.pick_prefill_splits(
                        num_tokens, num_seqs, query_len, num_kv_heads, block_q, 64, 131072, None, 512, DEVICE
                    )
                    heads = num_kv_heads * queries_per_kv
                    allocated = 4 * num_tokens * heads * splits * (head_dim + 1) if splits > 1 else 0
                    assert allocated <= bound


def test_triton_backend_splits_a_short_query_after_a_long_prefix_like_the_torch_backend(monkeypatch):
    """A prefix-cache hit: 5 new tokens after 600 cached positions (more than a 512-position partition),
    beside a decode row; the backend passes max_seq_len, so the launch splits."""
    launches = GridRecorder(prefill_module._prefill_attention_kernel)
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", launches)
    batch = make_paged_batch([5, 1], [605, 300], num_heads=4, num_kv_heads=1, head_dim=16, block_size=16)
    outs = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        outs.append(backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.metadata, SCALE))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert _single_split(launches) == [False] and launches.grids[0][1] > 1


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5, 16, 17, 40])
def test_merge_matches_reference_and_ignores_empty_slices(num_splits, dtype):
    """Slices with lse -inf weigh nothing whatever their output holds (NaN here); every (token, head)
    keeps one finite slice; more slices than one chunk of SPLIT_CHUNK are walked in chunks."""
    gen = torch.Generator().manual_seed(num_splits)
    num_tokens, num_heads, head_dim = 6, 3, 24
    part_out = torch.randn(num_tokens, num_heads, num_splits, head_dim, generator=gen).to(DEVICE)
    part_lse = (torch.randn(num_tokens, num_heads, num_splits, generator=gen) * 4).to(DEVICE)
    empty = torch.rand(num_tokens, num_heads, num_splits, generator=gen).to(DEVICE) < 0.4
    empty[..., num_splits // 2] = False
    part_lse[empty] = float("-inf")
    part_out[empty] = float("nan")
    out = nan_like(torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE))
    merge_attention_partials(part_out, part_lse, out)
    expected = merge_attention_partials_reference(part_out, part_lse)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected.to(dtype), **tolerance(dtype))


def test_the_runner_splits_a_chunk_after_a_long_prefix_and_matches_transformers(llama_long_dir, monkeypatch):
    """The real runner with the Triton backend (kernels interpreted off a GPU): a 600-token prompt in two
    chunks, the second 16 tokens after 584 cached positions (more than a 512-position partition, few q
    tiles: its launches split), then decode steps. The logits at the prompt's end match transformers'
    forward and the greedy tokens its generate."""
    launches = GridRecorder(prefill_module._prefill_attention_kernel)
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", launches)
    config = EngineConfig(
        model=ModelConfig(model=llama_long_dir, dtype="float32", device=DEVICE.type),
        cache=CacheConfig(block_size=16, num_blocks=40),
        attention_backend="triton",
    )
    runner = ModelRunner(config, load_model_source(config.model))
    prompt = torch.randint(4, VOCAB_SIZE, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = tuple(range(40))
    steps = [ScheduledRequest("0", tuple(prompt[:584]), 0, blocks, False)]
    steps.append(ScheduledRequest("0", tuple(prompt[584:]), 584, blocks, True))
    tokens, prompt_logits = list(prompt), None
    while len(tokens) < len(prompt) + 3:
        request = (
            steps.pop(0) if steps else ScheduledRequest("0", (tokens[-1],), len(tokens) - 1, blocks, True)
        )
        launches.constexprs.clear()
        logits = runner.execute_model(SchedulerOutput((request,), request.num_tokens))
        if request.start_position == 584:
            assert _single_split(launches) and not any(_single_split(launches))  # every layer's launch split
            prompt_logits = logits[0].cpu()
        if request.sample:
            tokens.append(int(logits[0].argmax()))
    model = AutoModelForCausalLM.from_pretrained(llama_long_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare a fixed number of greedy tokens
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = model(ids).logits[0, -1]
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    torch.testing.assert_close(prompt_logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens[len(prompt) :] == generated[0, len(prompt) :].tolist()
