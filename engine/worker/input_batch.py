"""Turns the scheduler's plain-data decision into the model's input tensors.

Tokens of all scheduled requests are concatenated in scheduled order. For request i with block
table [7, 2, 9], block_size 4, 6 cached tokens and 3 new ones (positions 6, 7, 8):

    context position:   0  1  2  3 | 4  5  6  7 | 8
    logical block:      0          | 1          | 2
    physical block:     7          | 2          | 9
    slot = physical_block * block_size + position % block_size
    new tokens write:                      10 11 | 36      -> slot_mapping rows for request i

    query_start_loc = [0, ..., start_i, start_i + 3, ...]   seq_lens[i] = 9

A sampling slice with k draft tokens (speculative decoding) appends them after its own tokens and gets
k + 1 logits rows, in position order: its last token's, then each draft's.

Async scheduling: a slice's last token may be `PLACEHOLDER_TOKEN_ID`, the token the step before samples;
`fill_placeholders` writes it into input_ids on the device from that step's `SampledTokenIds`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.sample.device_tensor import to_device_no_wait
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    # [num_logits] int64: for each slice with sample=True, its last token's row and its drafts' rows
    logits_indices: torch.Tensor

    @property
    def samples_every_token(self) -> bool:
        """Every token's row is sampled (a decode or verify step): logits_indices is 0 .. num_tokens - 1,
        since its rows increase. Read from the shapes, on the host."""
        return self.logits_indices.shape[0] == self.input_ids.shape[0]


def build_model_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """Raises ValueError on an empty step or a block table too short for its request's context."""
    if out.is_empty:
        raise ValueError("scheduled: an empty step has no model inputs")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    seq_lens_list: list[int] = []
    for req in out.scheduled:
        table, drafts = req.block_ids, req.spec_token_ids
        seq_len = req.start_position + len(req.token_ids) + len(drafts)
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"block_ids: request {req.request_id!r} has {len(table)} blocks of {block_size}, "
                f"too few for {seq_len} tokens"
            )
        input_ids += req.token_ids
        if drafts:
            input_ids += drafts
        pos = req.start_position
        if seq_len - pos == 1:  # a decode
            positions.append(pos)
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        else:  # block by block: a block's positions have consecutive slots (a 4096-token prompt's 256 runs)
            positions += range(pos, seq_len)
            while pos < seq_len:
                block, offset = divmod(pos, block_size)
                run = min(seq_len - pos, block_size - offset)
                first = table[block] * block_size + offset
                slot_mapping += range(first, first + run)
                pos += run
        query_start_loc.append(len(input_ids))
        seq_lens_list.append(seq_len)
        if req.sample:
            logits_indices += range(len(input_ids) - len(drafts) - 1, len(input_ids))
    max_num_blocks = max(len(req.block_ids) for req in out.scheduled)
    block_tables: list[int] = []
    for req in out.scheduled:
        block_tables += req.block_ids
        if len(req.block_ids) < max_num_blocks:
            block_tables += [0] * (max_num_blocks - len(req.block_ids))
    query_lens = tuple(b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:], strict=True))
    seq_lens = tuple(seq_lens_list)
    # One tensor per dtype, each input a view of it: a torch.tensor call costs more than a batch-1
    # step's lists, and on CUDA each is one copy to the device, not seven. Every view starts on a 16-byte
    # boundary: Triton specializes its kernels on pointer alignment, so a view at an odd offset (positions
    # after an odd number of input ids) compiled another kernel in the middle of serving.
    num_tokens, num_seqs = len(input_ids), len(out.scheduled)
    int64, (ids_at, positions_at, slots_at, logits_at) = _packed(
        (input_ids, positions, slot_mapping, logits_indices), torch.int64, device
    )
    int32, (starts_at, seq_lens_at, tables_at) = _packed(
        (query_start_loc, seq_lens_list, block_tables), torch.int32, device
    )
    metadata = AttentionMetadata(
        slot_mapping=int64[slots_at : slots_at + num_tokens],
        query_start_loc=int32[starts_at : starts_at + num_seqs + 1],
        seq_lens=int32[seq_lens_at : seq_lens_at + num_seqs],
        block_tables=int32[tables_at : tables_at + len(block_tables)].view(num_seqs, max_num_blocks),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return ModelInputs(
        input_ids=int64[ids_at : ids_at + num_tokens],
        positions=int64[positions_at : positions_at + num_tokens],
        metadata=metadata,
        logits_indices=int64[logits_at : logits_at + len(logits_indices)],
    )


ALIGN_BYTES = 16  # the alignment Triton specializes pointers on


def _packed(
    sections: tuple[list[int], ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """The sections one after another in one tensor on `device`, each padded to ALIGN_BYTES, and where
    each starts (in elements)."""
    align = ALIGN_BYTES // dtype.itemsize
    values: list[int] = []
    starts = []
    for section in sections:
        starts.append(len(values))
        values.extend(section)
        values.extend([0] * (-len(values) % align))
    return to_device(values, dtype, device), starts


@dataclass(frozen=True)
class SampledTokenIds:
    """A step's sampled token ids, still on the device: `token_ids[rows[request_id]]` is the token the
    request sampled (async scheduling feeds them to the next step's placeholders)."""

    token_ids: torch.Tensor  # [num_sampled] int64
    rows: Mapping[str, int]


def fill_placeholders(input_ids: torch.Tensor, out: SchedulerOutput, sampled: SampledTokenIds) -> None:
    """Writes into `input_ids` (built from `out`) the token of each placeholder, from `sampled`, on the
    device: nothing waits for the step that samples them. A placeholder is the last token of its slice.
    Raises ValueError for a placeholder whose request `sampled` holds no token of."""
    dst, src = [], []
    row = 0
    for req in out.scheduled:
        row += len(req.token_ids)
        if req.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            source = sampled.rows.get(req.request_id)
            if source is None:
                raise ValueError(f"sampled: no token for the placeholder of request {req.request_id!r}")
            dst.append(row - 1)
            src.append(source)
        row += len(req.spec_token_ids)
    if not dst:
        return
    if dst == src and len(dst) == len(input_ids) == len(sampled.token_ids) and dst[-1] == len(dst) - 1:
        input_ids.copy_(sampled.token_ids)  # a decode batch in the same order as the step before's
        return
    index = to_device(dst + src, torch.int64, input_ids.device)
    input_ids[index[: len(dst)]] = sampled.token_ids[index[len(dst) :]]


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ints as a tensor on `device`; on CUDA the copy does not wait for the device's queue."""
    # Built on the host through numpy (right after a forward a torch.tensor call's code is cold: 78-110 us
    # for a batch-1 step's two, against 58-66 us this way), then copied once; pinned memory lets the
    # copy overlap on CUDA.
    return to_device_no_wait(torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype])), device)
