"""The runner's input batch, kept across steps: block tables live in one numpy array, a row per request,
updated in place with the blocks a request gained since its last step; a step's inputs are gathered from
it with a few array operations instead of a Python loop per token.

    block_table (persistent, int32):        request rows, in the order they were first seen
        row 0  "a":  7  2  9  0 ...         a decode step of "b" then "a" (block_size 4):
        row 1  "b":  4  5  0  0 ...           rows          = [1, 0]
        row 2  free                           positions     = [5, 8]          (= start_position)
                                              slot_mapping  = table[rows, positions // 4] * 4 + positions % 4
                                                            = [5 * 4 + 1, 9 * 4 + 0] = [21, 36]
                                              block_tables  = table[rows, :max_num_blocks]

A request's row is rewritten only where its table changed: the scheduler hands the same tuple while a
request's table has room (nothing to do), a longer one when it grew (the new tail is written), a
different one after its blocks were freed and allocated again (rewritten whole, stale ids past its end
zeroed). Rows are freed for the requests a step reports finished or preempted; when rows run out (a
caller that never reports them, such as the draft model's steps), the rows of requests outside the
step are dropped: they are rebuilt from their tables if they come back. The inputs always equal
`build_model_inputs`'s for the same step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.input_batch import ModelInputs, array_to_device

_INITIAL_BLOCKS_PER_ROW = 16


class PersistentInputBatch:
    """`build(out)` gives the step's `ModelInputs`; not thread-safe (one runner drives it)."""

    def __init__(self, block_size: int, max_num_seqs: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.block_table = np.zeros((max_num_seqs, _INITIAL_BLOCKS_PER_ROW), dtype=np.int32)
        self._rows: dict[str, int] = {}  # request id -> its row
        self._row_tables: list[tuple[int, ...] | None] = [None] * max_num_seqs  # what each row holds
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def num_rows_used(self) -> int:
        return len(self._rows)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Free the rows of these requests (unknown ids are skipped)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._release(row)

    def build(self, out: SchedulerOutput) -> ModelInputs:
        """Raises ValueError on an empty step or a block table too short for its request's context."""
        if out.is_empty:
            raise ValueError("scheduled: an empty step has no model inputs")
        self.remove(out.finished_request_ids)
        self.remove(out.preempted_request_ids)
        scheduled = out.scheduled
        rows, input_ids, query_lens, starts, num_blocks, num_logits = [], [], [], [], [], []
        for req in scheduled:
            rows.append(self._row(req, scheduled))
            input_ids += req.token_ids
            num_drafts = len(req.spec_token_ids)
            if num_drafts:
                input_ids += req.spec_token_ids
            query_lens.append(len(req.token_ids) + num_drafts)
            starts.append(req.start_position)
            num_blocks.append(len(req.block_ids))
            num_logits.append(num_drafts + 1 if req.sample else 0)
        return self._gather(scheduled, rows, input_ids, query_lens, starts, num_blocks, num_logits)

    def _gather(
        self,
        scheduled: tuple[ScheduledRequest, ...],
        rows: list[int],
        input_ids: list[int],
        query_lens: list[int],
        starts: list[int],
        num_blocks: list[int],
        num_logits: list[int],
    ) -> ModelInputs:
        """The step's tensors from the per-slice lists and the persistent block table."""
        block_size = self.block_size
        num_seqs, num_tokens = len(rows), len(input_ids)
        query_lens_np = np.array(query_lens, dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + query_lens_np
        too_short = np.flatnonzero(np.array(num_blocks, dtype=np.int64) * block_size < seq_lens)
        if too_short.size:
            req = scheduled[too_short[0]]
            raise ValueError(
                f"block_ids: request {req.request_id!r} has {len(req.block_ids)} blocks of {block_size}, "
                f"too few for {req.seq_len} tokens"
            )
        rows_np = np.array(rows, dtype=np.intp)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start_loc[1:])
        if num_tokens == num_seqs:  # one token per slice (decode): its position is where it starts
            positions, token_rows = seq_lens - 1, rows_np
        else:
            token_seq = np.repeat(np.arange(num_seqs), query_lens_np)
            positions = np.arange(num_tokens) - (query_start_loc[:-1] - seq_lens + query_lens_np)[token_seq]
            token_rows = rows_np[token_seq]
        blocks = self.block_table[token_rows, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
        logits_indices = _logits_indices(query_start_loc, num_logits, num_tokens)
        max_num_blocks = max(num_blocks)
        int64 = np.empty(3 * num_tokens + len(logits_indices), dtype=np.int64)
        int64[:num_tokens] = input_ids
        int64[num_tokens : 2 * num_tokens] = positions
        int64[2 * num_tokens : 3 * num_tokens] = slot_mapping
        int64[3 * num_tokens :] = logits_indices
        int32 = np.empty(2 * num_seqs + 1 + num_seqs * max_num_blocks, dtype=np.int32)
        int32[: num_seqs + 1] = query_start_loc
        int32[num_seqs + 1 : 2 * num_seqs + 1] = seq_lens
        block_tables = int32[2 * num_seqs + 1 :].reshape(num_seqs, max_num_blocks)
        block_tables[:] = self.block_table[rows_np, :max_num_blocks]
        seq_lens_cpu = tuple(seq_lens.tolist())
        int64_t, int32_t = array_to_device(int64, self.device), array_to_device(int32, self.device)
        metadata = AttentionMetadata(
            slot_mapping=int64_t[2 * num_tokens : 3 * num_tokens],
            query_start_loc=int32_t[: num_seqs + 1],
            seq_lens=int32_t[num_seqs + 1 : 2 * num_seqs + 1],
            block_tables=int32_t[2 * num_seqs + 1 :].view(num_seqs, max_num_blocks),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=seq_lens_cpu,
            block_size=block_size,
        )
        return ModelInputs(
            input_ids=int64_t[:num_tokens],
            positions=int64_t[num_tokens : 2 * num_tokens],
            metadata=metadata,
            logits_indices=int64_t[3 * num_tokens :],
        )

    def _row(self, req: ScheduledRequest, scheduled: tuple[ScheduledRequest, ...]) -> int:
        """The request's row, its block table brought up to date."""
        table = req.block_ids
        row = self._rows.get(req.request_id)
        if row is None:
            row = self._new_row(req.request_id, scheduled)
        elif self._row_tables[row] is table:
            return row
        self._write(row, table)
        return row

    def _write(self, row: int, table: tuple[int, ...]) -> None:
        old = self._row_tables[row]
        num_old, num_new = (0 if old is None else len(old)), len(table)
        if num_new > self.block_table.shape[1]:
            self._widen(num_new)
        if old is not None and num_old <= num_new and table[:num_old] == old:
            if num_new > num_old:  # it grew: write the new blocks only
                self.block_table[row, num_old:num_new] = table[num_old:]
        else:
            self.block_table[row, :num_new] = table
            if num_old > num_new:
                self.block_table[row, num_new:num_old] = 0
        self._row_tables[row] = table

    def _new_row(self, request_id: str, scheduled: tuple[ScheduledRequest, ...]) -> int:
        if not self._free_rows:  # rows of requests nobody reported finished: drop those not in this step
            in_step = {req.request_id for req in scheduled}
            self.remove([rid for rid in self._rows if rid not in in_step])
        if not self._free_rows:  # a step of more requests than rows (only a caller's own steps)
            self._add_rows(len(self._row_tables))
        row = self._free_rows.pop()
        self._rows[request_id] = row
        return row

    def _release(self, row: int) -> None:
        old = self._row_tables[row]
        if old:
            self.block_table[row, : len(old)] = 0
        self._row_tables[row] = None
        self._free_rows.append(row)

    def _widen(self, num_blocks: int) -> None:
        width = max(num_blocks, 2 * self.block_table.shape[1])
        wider = np.zeros((self.block_table.shape[0], width), dtype=np.int32)
        wider[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = wider

    def _add_rows(self, num_rows: int) -> None:
        first = self.block_table.shape[0]
        taller = np.zeros((first + num_rows, self.block_table.shape[1]), dtype=np.int32)
        taller[:first] = self.block_table
        self.block_table = taller
        self._row_tables.extend([None] * num_rows)
        self._free_rows.extend(range(first + num_rows - 1, first - 1, -1))


def _logits_indices(query_start_loc: np.ndarray, num_logits: list[int], num_tokens: int) -> np.ndarray:
    """For each slice its last `num_logits[i]` token rows (its last token's, then its drafts'), in order."""
    counts = np.array(num_logits, dtype=np.int64)
    total = int(counts.sum())
    if total == num_tokens:  # every token sampled (decode, verify): rows increase, so all of them
        return np.arange(num_tokens)
    first = np.repeat(query_start_loc[1:] - counts, counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return first + within
