"""build_model_inputs on a mixed batch: every tensor checked against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import build_model_inputs

BLOCK_SIZE = 16
CPU = torch.device("cpu")

# A decode at position 20 (block table [3, 5]); a 10-token chunk at positions 16..25 after 16 cached
# tokens (table [8, 1, 6]); a fresh 19-token prefill ending mid-block (table [2, 9]).
DECODE = ScheduledRequest("decode", (7,), 20, (3, 5), sample=True)
CHUNK = ScheduledRequest("chunk", tuple(range(100, 110)), 16, (8, 1, 6), sample=False)
PREFILL = ScheduledRequest("prefill", tuple(range(200, 219)), 0, (2, 9), sample=True)
MIXED = SchedulerOutput((DECODE, CHUNK, PREFILL), num_batched_tokens=30)


def test_tokens_and_positions_are_concatenated_in_scheduled_order() -> None:
    inputs = build_model_inputs(MIXED, BLOCK_SIZE, CPU)
    assert inputs.input_ids.tolist() == [7, *range(100, 110), *range(200, 219)]
    assert inputs.positions.tolist() == [20, *range(16, 26), *range(0, 19)]
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.int64


def test_slot_mapping_goes_through_each_block_table() -> None:
    slots = build_model_inputs(MIXED, BLOCK_SIZE, CPU).metadata.slot_mapping.tolist()
    decode = [5 * 16 + 4]  # position 20 -> logical block 1 -> physical 5, offset 4
    chunk = [1 * 16 + i for i in range(10)]  # positions 16..25 -> logical block 1 -> physical 1
    prefill = [2 * 16 + i for i in range(16)] + [9 * 16 + i for i in range(3)]
    assert slots == decode + chunk + prefill


def test_attention_metadata_fields() -> None:
    metadata = build_model_inputs(MIXED, BLOCK_SIZE, CPU).metadata
    assert metadata.query_start_loc.tolist() == [0, 1, 11, 30]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.tolist() == [21, 26, 19]
    assert metadata.seq_lens.dtype == torch.int32
    assert metadata.block_tables.tolist() == [[3, 5, 0], [8, 1, 6], [2, 9, 0]]
    assert metadata.block_tables.dtype == torch.int32
    assert metadata.slot_mapping.dtype == torch.int64
    assert (metadata.max_query_len, metadata.max_seq_len) == (19, 26)
    assert metadata.query_lens_cpu == (1, 10, 19)
    assert metadata.seq_lens_cpu == (21, 26, 19)
    assert metadata.block_size == BLOCK_SIZE
    assert metadata.num_seqs == 3
    assert not metadata.is_pure_decode


def test_logits_indices_are_last_rows_of_sampled_slices() -> None:
    inputs = build_model_inputs(MIXED, BLOCK_SIZE, CPU)
    assert inputs.logits_indices.tolist() == [0, 29]  # the chunk (rows 1..10) does not sample
    assert not inputs.samples_every_token


def test_pure_decode_batch() -> None:
    out = SchedulerOutput(
        (ScheduledRequest("a", (1,), 15, (4,), True), ScheduledRequest("b", (2,), 16, (0, 7), True)), 2
    )
    inputs = build_model_inputs(out, BLOCK_SIZE, CPU)
    assert inputs.metadata.is_pure_decode
    assert inputs.metadata.slot_mapping.tolist() == [4 * 16 + 15, 7 * 16]
    assert inputs.logits_indices.tolist() == [0, 1]
    assert inputs.samples_every_token  # the runner then takes the hidden states as they are


@pytest.mark.parametrize("start", [0, 5, 15, 16, 31])
@pytest.mark.parametrize("length", [2, 11, 16, 17, 40, 100])
def test_a_prompt_chunk_takes_each_slot_from_the_block_of_its_position(start: int, length: int) -> None:
    """A prompt chunk starting anywhere in a block and crossing any number of them: every position's
    slot is its block's physical number times the block size plus its offset (the builder works block by
    block; a scrambled table shows a run carried into the wrong block)."""
    table = (13, 2, 29, 7, 0, 21, 5, 18, 11)[: -(-(start + length) // BLOCK_SIZE)]
    chunk = ScheduledRequest("chunk", tuple(range(length)), start, table, sample=True)
    out = SchedulerOutput((DECODE, chunk, DECODE), num_batched_tokens=length + 2)
    inputs = build_model_inputs(out, BLOCK_SIZE, CPU)
    positions = range(start, start + length)
    assert inputs.positions.tolist() == [20, *positions, 20]
    expected = [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in positions]
    assert inputs.metadata.slot_mapping.tolist() == [5 * 16 + 4, *expected, 5 * 16 + 4]


def test_block_table_too_short_is_rejected() -> None:
    out = SchedulerOutput((ScheduledRequest("short", (1, 2), 15, (4,), True),), 2)
    message = "block_ids: request 'short' has 1 blocks of 16, too few for 17 tokens"
    with pytest.raises(ValueError, match=message):
        build_model_inputs(out, BLOCK_SIZE, CPU)


def test_empty_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheduled: an empty step"):
        build_model_inputs(SchedulerOutput((), 0), BLOCK_SIZE, CPU)


def test_draft_tokens_follow_their_slice_and_get_a_logits_row_each() -> None:
    # A decode at position 30 (table [4, 7]) verifying drafts 8, 9, 10 at positions 31, 32, 33: position
    # 32 starts logical block 2 (physical 11). Then the mixed prefill from above.
    verify = ScheduledRequest("verify", (7,), 30, (4, 7, 11), sample=True, spec_token_ids=(8, 9, 10))
    out = SchedulerOutput((verify, PREFILL), num_batched_tokens=4 + 19)
    inputs = build_model_inputs(out, BLOCK_SIZE, CPU)
    assert inputs.input_ids.tolist() == [7, 8, 9, 10, *range(200, 219)]
    assert inputs.positions.tolist() == [30, 31, 32, 33, *range(0, 19)]
    assert inputs.metadata.slot_mapping.tolist()[:4] == [7 * 16 + 14, 7 * 16 + 15, 11 * 16, 11 * 16 + 1]
    assert inputs.metadata.seq_lens.tolist() == [34, 19]
    assert inputs.metadata.query_lens_cpu == (4, 19)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 22]
    assert not inputs.samples_every_token
    alone = build_model_inputs(SchedulerOutput((verify,), num_batched_tokens=4), BLOCK_SIZE, CPU)
    assert alone.logits_indices.tolist() == [0, 1, 2, 3] and alone.samples_every_token


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5])
def test_every_input_starts_on_a_16_byte_boundary(num_seqs: int) -> None:
    """Triton specializes kernels on pointer alignment: an input view at an odd offset (positions after
    an odd number of input ids) would compile another kernel variant while serving."""
    scheduled = tuple(
        ScheduledRequest(f"r{i}", tuple(range(2 * i + 1)), 0, (i,), sample=True) for i in range(num_seqs)
    )
    out = SchedulerOutput(scheduled, num_batched_tokens=num_seqs * num_seqs)
    inputs = build_model_inputs(out, BLOCK_SIZE, CPU)
    meta = inputs.metadata
    views = (inputs.input_ids, inputs.positions, inputs.logits_indices, meta.slot_mapping)
    views += (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    assert [view.storage_offset() * view.element_size() % 16 for view in views] == [0] * len(views)
    assert inputs.positions.tolist() == [pos for i in range(num_seqs) for pos in range(2 * i + 1)]
    assert meta.seq_lens.tolist() == [2 * i + 1 for i in range(num_seqs)]
    assert meta.block_tables.tolist() == [[i] for i in range(num_seqs)]
    assert meta.query_start_loc.tolist() == [i * i for i in range(num_seqs + 1)]
