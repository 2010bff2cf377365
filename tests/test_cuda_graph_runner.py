"""CUDA graph runner: capture sizes, padding, static buffers, and the padded batch's model output.

Capture and replay need a GPU (scripts/gpu_check.py); here the pure parts run on CPU, and padded decode
and verify batches run through the real model with the Triton backend (interpreted) exactly as a graph
would replay them, compared with the unpadded eager run.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE

from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import PRESETS
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.cuda_graph_runner import (
    CudaGraphRunner,
    GraphInputBuffers,
    VerifyInputBuffers,
    capture_sizes,
    estimate_graph_memory_bytes,
    padded_size,
    replay_size,
    verify_capture_sizes,
    verify_replay_size,
)
from sluice.engine.worker.input_batch import build_model_inputs
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.models.llama import LlamaForCausalLM
from sluice.kernels.compile_target import DEFAULT_NUM_SMS
from sluice.kernels.paged_decode_attention import pick_num_splits
from sluice.kernels.prefill_splits import split_partials_bound_bytes

BLOCK_SIZE = 16


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 24]),
        (128, [1, 2, 4, 8, *range(16, 129, 8)]),
        (4096, [1, 2, 4, 8, *range(16, 513, 8)]),  # 512 at most (vLLM's cap): larger batches run eagerly
    ],
)
def test_capture_sizes(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_rejects_zero():
    with pytest.raises(ValueError, match="^max_num_seqs: must be > 0, got 0$"):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("num_seqs", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24)]
)
def test_padded_size_is_the_smallest_captured_size_that_fits(num_seqs, expected):
    assert padded_size(num_seqs, capture_sizes(24)) == expected


def test_padded_size_is_none_above_the_largest_size():
    assert padded_size(25, capture_sizes(24)) is None


def _decode_inputs(seq_lens_and_blocks, token_base=100, device=DEVICE):
    """A pure-decode step built by the real input builder: each request decodes its last token."""
    scheduled = tuple(
        ScheduledRequest(f"r{i}", (token_base + i,), seq_len - 1, tuple(blocks), sample=True)
        for i, (seq_len, blocks) in enumerate(seq_lens_and_blocks)
    )
    return build_model_inputs(SchedulerOutput(scheduled, len(scheduled)), BLOCK_SIZE, device)


def test_replay_size_pads_decode_batches_and_refuses_what_graphs_cannot_replay():
    sizes = capture_sizes(8)  # [1, 2, 4, 8]
    three = _decode_inputs([(17, [3, 5]), (1, [2]), (40, [7, 1, 4])])  # widest table: 3 blocks
    assert replay_size(three.metadata, sizes, max_num_blocks_per_seq=3) == 4
    # A context beyond max_seq_len_to_capture (a wider block table) runs eagerly.
    assert replay_size(three.metadata, sizes, max_num_blocks_per_seq=2) is None
    nine = _decode_inputs([(5, [i]) for i in range(9)])
    assert replay_size(nine.metadata, sizes, max_num_blocks_per_seq=3) is None  # above the largest size
    prefill = build_model_inputs(
        SchedulerOutput((ScheduledRequest("p", (1, 2, 3), 0, (0,), sample=True),), 3), BLOCK_SIZE, DEVICE
    )
    assert replay_size(prefill.metadata, sizes, max_num_blocks_per_seq=3) is None


def test_fill_copies_the_batch_and_pads_the_rest():
    buffers = GraphInputBuffers.allocate(8, 4, DEVICE)
    buffers.block_tables.fill_(6)  # stale ids from an earlier, wider batch
    inputs = _decode_inputs([(17, [3, 5]), (1, [2]), (40, [7, 1, 4])])
    buffers.fill(inputs, 4)
    assert buffers.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buffers.positions[:4].tolist() == [16, 0, 39, 0]
    assert buffers.slot_mapping[:4].tolist() == [5 * 16 + 0, 2 * 16 + 0, 4 * 16 + 7, -1]
    assert buffers.seq_lens[:4].tolist() == [17, 1, 40, 1]
    assert buffers.block_tables[:3, :3].tolist() == [[3, 5, 0], [2, 0, 0], [7, 1, 4]]
    assert buffers.block_tables[:, 3].tolist() == [6] * 8  # beyond the batch width: untouched

    md = buffers.metadata(4, BLOCK_SIZE)
    assert md.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    assert md.block_tables.shape == (4, 4) and md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (md.max_query_len, md.max_seq_len, md.is_pure_decode) == (1, 64, True)

    buffers.fill(_decode_inputs([(5, [9])]), 2)  # a smaller batch turns row 1 into padding
    assert buffers.slot_mapping[:2].tolist() == [9 * 16 + 4, -1]
    assert buffers.seq_lens[:2].tolist() == [5, 1]


def test_fill_rejects_batches_a_graph_cannot_replay():
    buffers = GraphInputBuffers.allocate(4, 2, DEVICE)
    prefill = build_model_inputs(
        SchedulerOutput((ScheduledRequest("p", (1, 2, 3), 0, (0,), sample=True),), 3), BLOCK_SIZE, DEVICE
    )
    with pytest.raises(ValueError, match="^inputs: CUDA graphs replay decode batches only"):
        buffers.fill(prefill, 4)
    with pytest.raises(ValueError, match="^block_tables: 3 blocks per sequence > 2$"):
        buffers.fill(_decode_inputs([(40, [1, 2, 3])]), 1)
    with pytest.raises(ValueError, match="^inputs: 2 sequences do not fit a graph of 1$"):
        buffers.fill(_decode_inputs([(3, [1]), (4, [2])]), 1)


def _tiny_model(backend, device=DEVICE):
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch, KernelConfig(device, torch.float32, backend))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def _caches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers' random K/V caches of 12 blocks, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    shape = (12, BLOCK_SIZE, 1, 16)
    return [tuple(torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2)) for _ in range(2)]


def _assert_only_real_slots_written(initial, eager_caches, graph_caches, slot_mapping: torch.Tensor) -> None:
    """The padded run wrote the real slots as the eager run did, and left every other slot as it was."""
    real_slots = slot_mapping.cpu()
    untouched = torch.ones(12 * BLOCK_SIZE, dtype=torch.bool)
    untouched[real_slots] = False
    initial_parts = [part.cpu() for layer in initial for part in layer]
    eager_parts = [part.cpu() for layer in eager_caches for part in layer]
    graph_parts = [part.cpu() for layer in graph_caches for part in layer]
    for before, eager_part, graph_part in zip(initial_parts, eager_parts, graph_parts, strict=True):
        eager_flat, graph_flat = eager_part.view(-1, 16), graph_part.view(-1, 16)
        assert torch.equal(graph_flat[untouched], before.view(-1, 16)[untouched])
        torch.testing.assert_close(graph_flat[real_slots], eager_flat[real_slots], atol=1e-5, rtol=1e-5)


def test_padded_replay_inputs_give_the_eager_rows_and_write_no_padding_kv():
    model = _tiny_model(TritonAttentionBackend(decode_partition_size=32, prefill_partition_size=32))
    seed = 1

    inputs = _decode_inputs([(17, [3, 5]), (9, [2]), (33, [7, 1, 4])])
    eager_caches, graph_caches = _caches(seed), _caches(seed)
    with torch.no_grad():
        eager = model(inputs.input_ids, inputs.positions, eager_caches, inputs.metadata)
        buffers = GraphInputBuffers.allocate(8, 6, DEVICE)
        buffers.fill(inputs, 8)  # 3 real rows + 5 padding rows, as a graph of size 8 replays them
        padded = model(
            buffers.input_ids[:8], buffers.positions[:8], graph_caches, buffers.metadata(8, BLOCK_SIZE)
        )
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()
    # Only the 3 real slots were written (matmuls over 8 rows round slightly differently from 3 rows).
    _assert_only_real_slots_written(_caches(seed), eager_caches, graph_caches, inputs.metadata.slot_mapping)


def test_runner_off_cuda_runs_eagerly():
    cpu = torch.device("cpu")
    model = _tiny_model(TorchAttentionBackend(), cpu)
    kv_caches = [(torch.randn(8, BLOCK_SIZE, 1, 16), torch.randn(8, BLOCK_SIZE, 1, 16)) for _ in range(2)]
    runner = CudaGraphRunner(
        model, kv_caches, max_num_seqs=5, max_num_blocks_per_seq=4, block_size=16, device=cpu
    )
    runner.capture()
    inputs = _decode_inputs([(5, [1]), (20, [2, 3])], device=cpu)
    assert runner.enforce_eager and runner.sizes == [1, 2, 4, 8] and not runner.can_run(inputs)
    with torch.no_grad():
        expected = model(inputs.input_ids, inputs.positions, [(k.clone(), v.clone()) for k, v in kv_caches],
                         inputs.metadata)  # fmt: skip
        torch.testing.assert_close(runner.run(inputs), expected, atol=0, rtol=0)


def test_graph_memory_estimate_grows_with_the_batch_and_covers_the_outputs():
    arch = ModelArchConfig.from_hf_config(PRESETS["llama-3.2-1b"])
    small = estimate_graph_memory_bytes(arch, 8, 4096, torch.bfloat16)
    large = estimate_graph_memory_bytes(arch, 128, 4096, torch.bfloat16)
    assert 0 < small < large
    # At least the graph outputs (hidden states of every captured size) and the largest batch's residual.
    sizes = capture_sizes(128)
    assert large > 2 * arch.hidden_size * (sum(sizes) + 128)


def test_graph_memory_estimate_holds_the_splits_the_decode_kernel_picks_for_each_graph():
    """Shorter decode partitions give a batch-1 graph more splits (partials) to hold; from a few dozen
    sequences up a graph has one split whatever the partition, so the largest graph's bound is the same."""
    arch = ModelArchConfig.from_hf_config(PRESETS["llama-3.2-1b"])
    one = [estimate_graph_memory_bytes(arch, 1, 4096, torch.bfloat16, partition) for partition in (16, 4096)]
    many = [
        estimate_graph_memory_bytes(arch, 128, 4096, torch.bfloat16, partition) for partition in (16, 4096)
    ]
    splits = pick_num_splits(1, arch.num_key_value_heads, 4096, DEFAULT_NUM_SMS, 16)
    assert one[0] - one[1] == 2 * 4 * arch.num_attention_heads * (splits - 1) * (arch.head_dim + 2)
    assert pick_num_splits(128, arch.num_key_value_heads, 4096, DEFAULT_NUM_SMS, 16) == 1
    assert many[0] == many[1]


# ---- verify graphs (speculative decoding: queries of up to k + 1 tokens) -----------------------------


def _verify_inputs(slices, device=DEVICE):
    """A step built by the real input builder. slices: (seq_len, num_drafts, blocks) of a verify or decode
    slice (its last token, then its drafts), or (seq_len, "chunk", num_tokens, blocks) of a prefill chunk."""
    scheduled = []
    for i, (seq_len, drafts, *rest) in enumerate(slices):
        if drafts == "chunk":
            num_tokens, blocks = rest
            tokens = tuple(range(50 + i, 50 + i + num_tokens))
            scheduled.append(
                ScheduledRequest(f"c{i}", tokens, seq_len - num_tokens, tuple(blocks), sample=False)
            )
            continue
        (blocks,) = rest
        spec = tuple(200 + 10 * i + j for j in range(drafts))
        start = seq_len - 1 - drafts
        scheduled.append(
            ScheduledRequest(f"v{i}", (100 + i,), start, tuple(blocks), sample=True, spec_token_ids=spec)
        )
    num_tokens = sum(s.num_tokens for s in scheduled)
    return build_model_inputs(SchedulerOutput(tuple(scheduled), num_tokens), BLOCK_SIZE, device)


@pytest.mark.parametrize(
    ("max_num_seqs", "budget", "query_len", "expected"),
    [
        (128, 2048, 4, capture_sizes(128)),
        (128, 64, 4, [1, 2, 4, 8, 16]),
        (8, 2, 4, [1]),
        (3, 100, 2, [1, 2, 4]),
    ],
)
def test_verify_capture_sizes_hold_what_one_step_can(max_num_seqs, budget, query_len, expected):
    assert verify_capture_sizes(max_num_seqs, budget, query_len) == expected


def test_verify_capture_sizes_need_queries_of_two_tokens():
    with pytest.raises(
        ValueError, match="^query_len: a verify graph has queries of 2 or more tokens, got 1$"
    ):
        verify_capture_sizes(8, 64, 1)


def test_verify_replay_size_pads_short_query_batches_and_refuses_the_rest():
    sizes = verify_capture_sizes(8, 64, 4)  # [1, 2, 4, 8]
    mixed = _verify_inputs([(20, 3, [3, 5]), (9, 1, [2]), (33, 0, [7, 1, 4]), (24, "chunk", 2, [6, 8])])
    assert verify_replay_size(mixed.metadata, sizes, query_len=4, max_num_blocks_per_seq=4) == 4
    uniform = _verify_inputs([(20, 3, [3, 5]), (9, 3, [2])])
    assert verify_replay_size(uniform.metadata, sizes, query_len=4, max_num_blocks_per_seq=4) == 2
    # Pure decode steps belong to the decode graphs.
    decode = _verify_inputs([(20, 0, [3, 5]), (9, 0, [2])])
    assert verify_replay_size(decode.metadata, sizes, query_len=4, max_num_blocks_per_seq=4) is None
    # A longer query (a prefill chunk of 5, or 4 drafts) runs eagerly.
    long_chunk = _verify_inputs([(20, 3, [3, 5]), (20, "chunk", 5, [6, 8])])
    assert verify_replay_size(long_chunk.metadata, sizes, query_len=4, max_num_blocks_per_seq=4) is None
    assert verify_replay_size(uniform.metadata, sizes, query_len=3, max_num_blocks_per_seq=4) is None
    nine = _verify_inputs([(5, 1, [i]) for i in range(9)])
    assert verify_replay_size(nine.metadata, sizes, query_len=4, max_num_blocks_per_seq=4) is None
    # A context beyond the graphs' blocks runs eagerly: the table itself, or once padded to 4 rows
    # (a context of 31 after 1 draft, its query of 2 padded to 4: 33 positions > 2 blocks of 16).
    assert verify_replay_size(mixed.metadata, sizes, query_len=4, max_num_blocks_per_seq=2) is None
    edge = _verify_inputs([(32, 3, [3, 5]), (31, 1, [2, 4])])
    assert verify_replay_size(edge.metadata, sizes, query_len=4, max_num_blocks_per_seq=2) is None
    fits = _verify_inputs([(32, 3, [3, 5]), (30, 3, [2, 4])])
    assert verify_replay_size(fits.metadata, sizes, query_len=4, max_num_blocks_per_seq=2) == 2


def test_verify_fill_pads_each_sequence_after_its_own_rows():
    buffers = VerifyInputBuffers.allocate(4, 3, 4, BLOCK_SIZE, DEVICE)
    buffers.block_tables.fill_(6)  # stale ids from an earlier, wider batch
    inputs = _verify_inputs([(20, 2, [3, 5]), (9, 0, [2]), (18, "chunk", 2, [7, 1])])
    rows = buffers.fill(inputs, 4)
    assert rows.tolist() == [0, 1, 2, 3, 6, 7]
    assert buffers.input_ids[:12].tolist() == [100, 200, 201, 101, 0, 0, 52, 53, 0, 0, 0, 0]
    assert buffers.positions[:12].tolist() == [17, 18, 19, 8, 0, 0, 16, 17, 0, 0, 0, 0]
    assert buffers.slot_mapping[:12].tolist() == [5 * 16 + 1, 5 * 16 + 2, 5 * 16 + 3, 2 * 16 + 8, -1, -1,
                                                  1 * 16 + 0, 1 * 16 + 1, -1, -1, -1, -1]  # fmt: skip
    # Padded to 3 rows each: seq_len + (3 - query_len); the padding sequence reads positions 0..2.
    assert buffers.seq_lens.tolist() == [20, 11, 19, 3]
    assert buffers.block_tables[:3, :2].tolist() == [[3, 5], [2, 0], [7, 1]]
    assert buffers.block_tables[:, 2:].tolist() == [[6, 6]] * 4  # beyond the batch width: untouched
    md = buffers.metadata(4, BLOCK_SIZE)
    assert md.query_start_loc.tolist() == [0, 3, 6, 9, 12] and md.slot_mapping.shape == (12,)
    assert (md.max_query_len, md.max_seq_len, md.is_pure_decode) == (3, 64, False)
    with pytest.raises(ValueError, match="^inputs: a query of 4 tokens does not fit 3 rows$"):
        buffers.fill(_verify_inputs([(20, 3, [3, 5])]), 1)
    with pytest.raises(ValueError, match="^inputs: 2 sequences do not fit a verify graph of 1$"):
        buffers.fill(_verify_inputs([(20, 1, [3, 5]), (9, 1, [2])]), 1)
    with pytest.raises(
        ValueError, match="^query_len: 40 positions exceed the 2 blocks of 16 a graph addresses"
    ):
        VerifyInputBuffers.allocate(4, 40, 2, BLOCK_SIZE, DEVICE)


def test_padded_verify_inputs_give_the_eager_rows_and_write_no_padding_kv():
    model = _tiny_model(TritonAttentionBackend(decode_partition_size=32, prefill_partition_size=32))
    seed = 2

    # Drafts 3, 1 and 0 (a decode) and a 2-token prefill chunk, padded to 4 rows each and 8 sequences.
    inputs = _verify_inputs([(20, 3, [3, 5]), (9, 1, [2]), (33, 0, [7, 1, 4]), (24, "chunk", 2, [6, 8])])
    eager_caches, graph_caches = _caches(seed), _caches(seed)
    with torch.no_grad():
        eager = model(inputs.input_ids, inputs.positions, eager_caches, inputs.metadata)
        buffers = VerifyInputBuffers.allocate(8, 4, 6, BLOCK_SIZE, DEVICE)
        rows = buffers.fill(inputs, 8)
        padded = model(
            buffers.input_ids[:32], buffers.positions[:32], graph_caches, buffers.metadata(8, BLOCK_SIZE)
        )
    assert padded.shape[0] == 32
    torch.testing.assert_close(padded[rows], eager, atol=1e-5, rtol=1e-5)
    _assert_only_real_slots_written(_caches(seed), eager_caches, graph_caches, inputs.metadata.slot_mapping)


def test_runner_picks_verify_graphs_but_off_cuda_runs_eagerly():
    cpu = torch.device("cpu")
    model = _tiny_model(TorchAttentionBackend(), cpu)
    kv_caches = [(torch.randn(12, BLOCK_SIZE, 1, 16), torch.randn(12, BLOCK_SIZE, 1, 16)) for _ in range(2)]
    runner = CudaGraphRunner(
        model, kv_caches, max_num_seqs=5, max_num_blocks_per_seq=4, block_size=16, device=cpu,
        verify_query_len=4, max_num_batched_tokens=16,
    )  # fmt: skip
    runner.capture()
    verify = _verify_inputs([(20, 3, [3, 5]), (9, 1, [2])], device=cpu)
    decode = _verify_inputs([(20, 0, [3, 5]), (9, 0, [2])], device=cpu)
    assert runner.verify_sizes == [1, 2, 4] and runner.verify_buffers.query_len == 4
    assert (runner.graph_for(verify), runner.graph_for(decode)) == (("verify", 2), ("decode", 2))
    assert runner.enforce_eager and not runner.can_run(verify)
    with torch.no_grad():
        expected = model(verify.input_ids, verify.positions, [(k.clone(), v.clone()) for k, v in kv_caches],
                         verify.metadata)  # fmt: skip
        torch.testing.assert_close(runner.run(verify), expected, atol=0, rtol=0)
    without = CudaGraphRunner(model, kv_caches, 5, 4, 16, cpu)
    assert without.verify_buffers is None and without.graph_for(verify) is None
    # k + 1 = 65 positions past the 4 blocks of 16 a graph addresses: no verify graphs, every verify step
    # eager (the engine refused to start, on a CPU too).
    too_long = CudaGraphRunner(
        model, kv_caches, 5, 4, 16, cpu, verify_query_len=65, max_num_batched_tokens=16
    )
    assert too_long.verify_buffers is None and too_long.graph_for(verify) is None


def test_graph_memory_estimate_covers_the_verify_graphs():
    arch = ModelArchConfig.from_hf_config(PRESETS["llama-3.2-1b"])
    decode_only = estimate_graph_memory_bytes(arch, 128, 4096, torch.bfloat16)
    sizes = verify_capture_sizes(128, 2048, 4)
    both = estimate_graph_memory_bytes(
        arch, 128, 4096, torch.bfloat16, verify_sizes=sizes, verify_query_len=4
    )
    # At least the verify graphs' outputs (hidden states of every verify batch) on top.
    assert both - decode_only >= 2 * 2 * arch.hidden_size * sum(sizes) * 4


def test_graph_memory_estimate_reserves_the_split_prefill_partials_of_verify_graphs():
    """A verify graph's prefill attention may split its contexts (split-KV): beside a batch-1 verify graph's
    few activations the estimate holds the partials' bound, whatever the batch."""
    arch = ModelArchConfig.from_hf_config(PRESETS["llama-3.2-1b"])
    decode_only = estimate_graph_memory_bytes(arch, 1, 4096, torch.bfloat16)
    one = estimate_graph_memory_bytes(arch, 1, 4096, torch.bfloat16, verify_sizes=[1], verify_query_len=4)
    bound = split_partials_bound_bytes(arch.head_dim)
    assert decode_only < bound and one >= 2 * bound


def test_the_runner_replays_decode_and_verify_batches_as_the_eager_model_runs_them():
    # On CUDA (the GPU check's kernel tests) the runner captures its decode and verify graphs here and
    # replays them; elsewhere it runs the same batches eagerly. Either way: the eager rows and K/V.
    model = _tiny_model(TritonAttentionBackend(decode_partition_size=32, prefill_partition_size=32))
    gen = torch.Generator().manual_seed(3)
    shape = (12, BLOCK_SIZE, 1, 16)
    kv_caches = [tuple(torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2)) for _ in range(2)]
    runner = CudaGraphRunner(
        model, kv_caches, max_num_seqs=4, max_num_blocks_per_seq=6, block_size=BLOCK_SIZE, device=DEVICE,
        verify_query_len=4, max_num_batched_tokens=16,
    )  # fmt: skip
    runner.capture()
    on_cuda = DEVICE.type == "cuda"
    mixed = [(20, 3, [3, 5]), (9, 1, [2]), (33, 0, [7, 1, 4]), (24, "chunk", 2, [6, 8])]
    batches = [
        (("decode", 4), _decode_inputs([(17, [3, 5]), (9, [2]), (33, [7, 1, 4])])),
        (("verify", 4), _verify_inputs(mixed)),
        (("verify", 1), _verify_inputs([(40, 2, [9, 10, 11])])),
    ]
    for key, inputs in batches:
        assert runner.graph_for(inputs) == key
        assert runner.can_run(inputs) == on_cuda
        eager_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        with torch.inference_mode():
            expected = model(inputs.input_ids, inputs.positions, eager_caches, inputs.metadata)
            got = runner.run(inputs).clone()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for (k, v), (eager_k, eager_v) in zip(kv_caches, eager_caches, strict=True):
            torch.testing.assert_close(k, eager_k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, eager_v, atol=1e-4, rtol=1e-4)
