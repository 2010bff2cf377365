"""CUDA graphs for decode steps and speculative verify steps: capture once per batch size, pad each batch
up, replay.

    capture sizes  [1, 2, 4, 8, 16, 24, ...]  up to the first size >= max_num_seqs
    decode batch of n sequences  ->  padded to padded_size(n)  ->  copy into the static buffers  ->  replay

Rows n .. padded-1 are padding: slot_mapping -1 (no K/V write), seq_len 1 reading the first block its
block-table row holds (left by an earlier batch: every entry ever written is a real block id, so every read
stays in bounds), token 0 at position 0.
Their outputs are computed and dropped. Batches larger than the largest captured size run eagerly.

Verify graphs (with speculative decoding: `verify_query_len` q = k + 1) replay batches of up to b
sequences whose queries are at most q tokens long: verify steps (1 + d drafts, d <= k, mixed), with
decodes and short prefill chunks among them. Each sequence is padded to q query rows, after its own:

    sequence i, q_i real tokens:  rows i*q .. i*q + q_i - 1 real, i*q + q_i .. i*q + q - 1 padding
    seq_len_i + (q - q_i)         so the real rows keep their positions (a query row sits at
                                  seq_len - q + j); padding rows come after them, so causality
                                  hides them from the real rows
    padding sequences n .. b-1:   q rows at positions 0 .. q-1 of their row's first block (seq_len q)

Padding rows write no K/V (slot -1), sit at rotary position 0, and their outputs are dropped: the real
rows are gathered back into the unpadded order. The attention backend then runs its prefill kernel with
`max_query_len` q and a grid that depends on b and q only.

The attention backend must skip slot_mapping < 0 (the Triton and flash-attn backends do) and read only
tensors plus `max_query_len` / `max_seq_len` from the metadata: a graph freezes everything else at capture.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.input_batch import ModelInputs, to_device
from sluice.kernels.compile_target import DEFAULT_NUM_SMS

KVCache = tuple[torch.Tensor, torch.Tensor]
# model(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size]
ModelForward = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]

_FIRST_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 8
# No larger batch is captured (vLLM's max_cudagraph_capture_size): a graph per 8 sequences up to
# --max-num-seqs 4096 would be 515 captures at start-up and their memory; larger batches run eagerly,
# where the host's launches weigh little against the step.
MAX_CAPTURE_SIZE = 512
_PADDING_SLOT = -1
_PADDING_SEQ_LEN = 1


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then steps of 8, ending at the first size that
    holds `max_num_seqs` (so every decode batch the scheduler can form has a graph), MAX_CAPTURE_SIZE at
    most."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs: must be > 0, got {max_num_seqs}")
    max_num_seqs = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [size for size in _FIRST_SIZES if size < max_num_seqs]
    if len(sizes) < len(_FIRST_SIZES):
        return [*sizes, _FIRST_SIZES[len(sizes)]]
    return [*sizes, *range(_FIRST_SIZES[-1] + _SIZE_STEP, max_num_seqs + _SIZE_STEP, _SIZE_STEP)]


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= num_seqs (sizes ascending); None when the batch is too large."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def replay_size(metadata: AttentionMetadata, sizes: Sequence[int], max_num_blocks_per_seq: int) -> int | None:
    """The captured batch size that replays this step, or None when it must run eagerly: not pure
    decode, more sequences than the largest size, or a block table wider than the graphs address
    (a context beyond max_seq_len_to_capture)."""
    if not metadata.is_pure_decode or metadata.block_tables.shape[1] > max_num_blocks_per_seq:
        return None
    return padded_size(metadata.num_seqs, sizes)


@dataclass(frozen=True)
class GraphInputBuffers:
    """Static inputs shared by every captured graph; graph for size b reads rows [:b]."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32, always 0, 1, 2, ... (one token per sequence)
    block_tables: torch.Tensor  # [max_batch, max_num_blocks_per_seq] int32

    @classmethod
    def allocate(cls, max_batch: int, max_num_blocks_per_seq: int, device: torch.device) -> GraphInputBuffers:
        """Buffers holding an all-padding batch (safe to run before any real input arrives)."""
        return cls(
            input_ids=torch.zeros(max_batch, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_batch,), _PADDING_SLOT, dtype=torch.int64, device=device),
            seq_lens=torch.full((max_batch,), _PADDING_SEQ_LEN, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_batch, max_num_blocks_per_seq, dtype=torch.int32, device=device),
        )

    @property
    def max_num_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def metadata(self, batch_size: int, block_size: int) -> AttentionMetadata:
        """Metadata viewing rows [:batch_size]. max_seq_len is the largest context a block table
        can address, so kernels size their grids for any batch this graph will see; the `*_cpu`
        tuples are only upper bounds and must not be read inside a graph."""
        max_seq_len = self.max_num_blocks_per_seq * block_size
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=(1,) * batch_size,
            seq_lens_cpu=(max_seq_len,) * batch_size,
            block_size=block_size,
        )

    def fill(self, inputs: ModelInputs, batch_size: int) -> None:
        """Copy a decode batch of n <= batch_size sequences into rows [:n]; rows [n:batch_size] become
        padding.

        Raises ValueError when the batch is not pure decode or does not fit the buffers.
        """
        md = inputs.metadata
        num_seqs, width = md.num_seqs, md.block_tables.shape[1]
        if not md.is_pure_decode or inputs.input_ids.shape[0] != num_seqs:
            raise ValueError("inputs: CUDA graphs replay decode batches only (one token per sequence)")
        if num_seqs > batch_size or batch_size > self.input_ids.shape[0]:
            raise ValueError(f"inputs: {num_seqs} sequences do not fit a graph of {batch_size}")
        if width > self.max_num_blocks_per_seq:
            raise ValueError(f"block_tables: {width} blocks per sequence > {self.max_num_blocks_per_seq}")
        self.input_ids[:num_seqs].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(md.seq_lens, non_blocking=True)
        # Columns >= width keep older block ids: real ids, never read past seq_lens.
        self.block_tables[:num_seqs, :width].copy_(md.block_tables, non_blocking=True)
        self.input_ids[num_seqs:batch_size].zero_()
        self.positions[num_seqs:batch_size].zero_()
        self.slot_mapping[num_seqs:batch_size].fill_(_PADDING_SLOT)
        self.seq_lens[num_seqs:batch_size].fill_(_PADDING_SEQ_LEN)


def verify_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, query_len: int) -> list[int]:
    """Batch sizes of the verify graphs: `capture_sizes` up to the most sequences of `query_len` tokens a
    step can hold (the token budget and max_num_seqs)."""
    if query_len < 2:
        raise ValueError(f"query_len: a verify graph has queries of 2 or more tokens, got {query_len}")
    return capture_sizes(max(1, min(max_num_seqs, max_num_batched_tokens // query_len)))


def verify_replay_size(
    metadata: AttentionMetadata, sizes: Sequence[int], query_len: int, max_num_blocks_per_seq: int
) -> int | None:
    """The verify graph's batch size that replays this step, or None: a pure decode step (the decode
    graphs'), a query longer than `query_len`, more sequences than the largest size, or a context that
    (padded to `query_len` rows) reaches beyond the blocks the graphs address."""
    if metadata.is_pure_decode or metadata.max_query_len > query_len:
        return None
    max_len = max_num_blocks_per_seq * metadata.block_size
    if metadata.block_tables.shape[1] > max_num_blocks_per_seq:
        return None
    for seq_len, num_query in zip(metadata.seq_lens_cpu, metadata.query_lens_cpu, strict=True):
        if seq_len + query_len - num_query > max_len:
            return None
    return padded_size(metadata.num_seqs, sizes)


@dataclass(frozen=True)
class VerifyInputBuffers:
    """Static inputs of the verify graphs: b sequences of `query_len` query rows each; the graph for
    batch b reads sequences [:b], rows [:b * query_len]."""

    query_len: int
    input_ids: torch.Tensor  # [max_batch * query_len] int64
    positions: torch.Tensor  # [max_batch * query_len] int64
    slot_mapping: torch.Tensor  # [max_batch * query_len] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32, always 0, q, 2q, ...
    block_tables: torch.Tensor  # [max_batch, max_num_blocks_per_seq] int32

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        query_len: int,
        max_num_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> VerifyInputBuffers:
        """Buffers holding an all-padding batch. Raises ValueError when a padding sequence's `query_len`
        positions do not fit the blocks a graph addresses."""
        if query_len > max_num_blocks_per_seq * block_size:
            raise ValueError(
                f"query_len: {query_len} positions exceed the {max_num_blocks_per_seq} blocks of "
                f"{block_size} a graph addresses"
            )
        rows = max_batch * query_len
        return cls(
            query_len=query_len,
            input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            slot_mapping=torch.full((rows,), _PADDING_SLOT, dtype=torch.int64, device=device),
            seq_lens=torch.full((max_batch,), query_len, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, rows + 1, query_len, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_batch, max_num_blocks_per_seq, dtype=torch.int32, device=device),
        )

    @property
    def max_num_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def metadata(self, batch_size: int, block_size: int) -> AttentionMetadata:
        """Metadata viewing sequences [:batch_size]; like `GraphInputBuffers.metadata`, the `*_cpu`
        tuples are upper bounds that must not be read inside a graph."""
        max_seq_len = self.max_num_blocks_per_seq * block_size
        rows = batch_size * self.query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=self.query_len,
            max_seq_len=max_seq_len,
            query_lens_cpu=(self.query_len,) * batch_size,
            seq_lens_cpu=(max_seq_len,) * batch_size,
            block_size=block_size,
        )

    def fill(self, inputs: ModelInputs, batch_size: int) -> torch.Tensor:
        """Copies a batch of n <= batch_size sequences, each padded to `query_len` rows (module doc);
        returns `rows` [num_tokens] int64 on the device: the padded row of each input token, so
        `output[rows]` is the output in the inputs' order.

        Raises ValueError when a query is longer than `query_len` or the batch does not fit."""
        md = inputs.metadata
        q, num_seqs, width = self.query_len, md.num_seqs, md.block_tables.shape[1]
        if md.max_query_len > q:
            raise ValueError(f"inputs: a query of {md.max_query_len} tokens does not fit {q} rows")
        if num_seqs > batch_size or batch_size * q > self.input_ids.shape[0]:
            raise ValueError(f"inputs: {num_seqs} sequences do not fit a verify graph of {batch_size}")
        if width > self.max_num_blocks_per_seq:
            raise ValueError(f"block_tables: {width} blocks per sequence > {self.max_num_blocks_per_seq}")
        pads = [q - n for n in md.query_lens_cpu]
        rows = [i * q + j for i, n in enumerate(md.query_lens_cpu) for j in range(n)]
        host = to_device(rows + pads, torch.int64, self.input_ids.device)
        rows_on_device, pads_on_device = host[: len(rows)], host[len(rows) :]
        num_rows = batch_size * q
        self.input_ids[:num_rows].zero_()
        self.positions[:num_rows].zero_()
        self.slot_mapping[:num_rows].fill_(_PADDING_SLOT)
        self.input_ids.index_copy_(0, rows_on_device, inputs.input_ids)
        self.positions.index_copy_(0, rows_on_device, inputs.positions)
        self.slot_mapping.index_copy_(0, rows_on_device, md.slot_mapping)
        self.seq_lens[:num_seqs].copy_(md.seq_lens + pads_on_device)
        self.seq_lens[num_seqs:batch_size].fill_(q)
        # Columns >= width keep older block ids: real ids, never read past seq_lens.
        self.block_tables[:num_seqs, :width].copy_(md.block_tables, non_blocking=True)
        return rows_on_device


def estimate_graph_memory_bytes(
    arch: ModelArchConfig,
    max_num_seqs: int,
    max_seq_len: int,
    dtype: torch.dtype,
    decode_partition_size: int | None = None,
    verify_sizes: Sequence[int] = (),
    verify_query_len: int = 0,
    num_sms: int | None = None,
) -> int:
    """Upper estimate of the device memory the captured graphs keep, to subtract before sizing the cache.

    The shared pool holds the peak activations of the largest graph (one layer's intermediates live at
    a time, plus the residual stream), the flash-decoding partials, and one output per graph; each graph
    also keeps a few hundred bytes per kernel node. A factor 2 covers allocator rounding. A decode graph
    of b sequences has the split count the decode kernel picks for it (`pick_num_splits` with
    `decode_partition_size`, default the kernel's, and `num_sms`, default an H100's): many splits at
    batch 1, one from a few dozen sequences up. Verify graphs (`verify_sizes` batches of
    `verify_query_len` tokens) share the pool; their prefill attention may split its contexts
    (`prefill_attention`'s split-KV), whose partials are bounded whatever the batch.
    """
    # Imported here: triton is not installed everywhere, and only CUDA graphs need the estimate.
    from sluice.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, pick_num_splits

    partition = decode_partition_size or DEFAULT_PARTITION_SIZE
    sms = num_sms or DEFAULT_NUM_SMS
    sizes = capture_sizes(max_num_seqs)
    item = dtype.itemsize
    per_token = item * (
        4 * arch.hidden_size + 2 * (arch.q_size + 2 * arch.kv_size) + 3 * arch.intermediate_size
    )

    def decode_graph(batch: int) -> int:
        splits = pick_num_splits(batch, arch.num_key_value_heads, max_seq_len, sms, partition)
        return batch * (per_token + 4 * arch.num_attention_heads * splits * (arch.head_dim + 2))

    verify_tokens = max(verify_sizes, default=0) * verify_query_len
    verify_partials = 0
    if verify_sizes:
        from sluice.kernels.prefill_splits import split_partials_bound_bytes

        verify_partials = split_partials_bound_bytes(arch.head_dim, sms)
    peak = max(max(decode_graph(batch) for batch in sizes), verify_tokens * per_token + verify_partials)
    outputs = item * arch.hidden_size * (sum(sizes) + sum(verify_sizes) * verify_query_len)
    nodes = (len(sizes) + len(verify_sizes)) * arch.num_hidden_layers * 16 * 512
    return 2 * (peak + outputs + nodes)


class CudaGraphRunner:
    """Captures `model` for every decode batch size (and, given `verify_query_len`, every verify batch
    size) and replays the graph that fits each batch.

        runner = CudaGraphRunner(model, kv_caches, max_num_seqs, max_num_blocks_per_seq, block_size, device)
        runner.capture()                       # after the KV cache is allocated; no-op when enforce_eager
        hidden = runner.run(inputs)            # graph when can_run(inputs), else eager model(...)

    `run` returns the graph's static output (a view, or rows gathered from it), valid until the next `run`.
    """

    def __init__(
        self,
        model: ModelForward,
        kv_caches: list[KVCache],
        max_num_seqs: int,
        max_num_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        enforce_eager: bool = False,
        verify_query_len: int = 0,
        max_num_batched_tokens: int = 0,
    ) -> None:
        """verify_query_len: k + 1 with speculative decoding (k drafts per step), else 0: no verify graphs;
        their batches hold at most max_num_batched_tokens tokens."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.enforce_eager = enforce_eager or device.type != "cuda"
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = GraphInputBuffers.allocate(self.sizes[-1], max_num_blocks_per_seq, device)
        self.verify_sizes: list[int] = []
        self.verify_buffers: VerifyInputBuffers | None = None
        # Verify graphs (picked off CUDA too, run eagerly there) only where a padding sequence's k + 1
        # positions fit the blocks a graph addresses: past a short --max-seq-len-to-capture or context,
        # verify steps run eagerly, as steps past the graphs do (such settings were refused, CPU included).
        fits = verify_query_len <= max_num_blocks_per_seq * block_size
        if verify_query_len > 1 and fits:
            budget = max(max_num_batched_tokens, verify_query_len)
            self.verify_sizes = verify_capture_sizes(max_num_seqs, budget, verify_query_len)
            self.verify_buffers = VerifyInputBuffers.allocate(
                self.verify_sizes[-1], verify_query_len, max_num_blocks_per_seq, block_size, device
            )
        # ("decode" | "verify", batch size) -> graph, and its static output
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.memory_bytes = 0  # measured by capture()

    def capture(self) -> None:
        """Capture one graph per size, verify graphs then decode graphs, each largest first, all in one
        memory pool (smaller graphs reuse the largest one's blocks). Each size runs once eagerly first so
        kernels compile outside capture."""
        if self.enforce_eager or self._graphs:
            return
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = None
        with torch.inference_mode():
            for key, args in self._capture_plan():
                self.model(*args)  # warm-up: Triton compiles here, not inside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[key] = self.model(*args)
                pool = graph.pool() if pool is None else pool
                self._graphs[key] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before

    def graph_for(self, inputs: ModelInputs) -> tuple[str, int] | None:
        """The graph that replays this step, ("decode" | "verify", batch size), or None: run eagerly.
        Decided from the inputs alone (graphs need not be captured)."""
        size = replay_size(inputs.metadata, self.sizes, self.buffers.max_num_blocks_per_seq)
        if size is not None:
            return ("decode", size)
        verify = self.verify_buffers
        if verify is None:
            return None
        size = verify_replay_size(
            inputs.metadata, self.verify_sizes, verify.query_len, verify.max_num_blocks_per_seq
        )
        return None if size is None else ("verify", size)

    def can_run(self, inputs: ModelInputs) -> bool:
        """True when graphs were captured and one replays this step (see `graph_for`)."""
        return bool(self._graphs) and self.graph_for(inputs) is not None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] for `inputs`, by graph replay when possible."""
        if not self.can_run(inputs):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        key = self.graph_for(inputs)
        kind, size = key
        if kind == "decode":
            self.buffers.fill(inputs, size)
            self._graphs[key].replay()
            return self._outputs[key][: inputs.metadata.num_seqs]
        rows = self.verify_buffers.fill(inputs, size)
        self._graphs[key].replay()
        return self._outputs[key][rows]

    def _capture_plan(self) -> list[tuple[tuple[str, int], tuple]]:
        """(graph key, model arguments over the static buffers), in capture order."""
        plan = []
        verify = self.verify_buffers
        for size in reversed(self.verify_sizes):
            rows = size * verify.query_len
            metadata = verify.metadata(size, self.block_size)
            plan.append(
                (
                    ("verify", size),
                    (verify.input_ids[:rows], verify.positions[:rows], self.kv_caches, metadata),
                )
            )
        for size in reversed(self.sizes):
            metadata = self.buffers.metadata(size, self.block_size)
            args = (self.buffers.input_ids[:size], self.buffers.positions[:size], self.kv_caches, metadata)
            plan.append((("decode", size), args))
        return plan
