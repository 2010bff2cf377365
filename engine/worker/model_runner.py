"""Owns the model and its paged KV cache; runs one scheduled step to logits."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence

import torch

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.distributed.partition import partition_heads
from sluice.engine.loading.fp8_config import resolve_fp8_config
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import DummyWeights, ModelSource
from sluice.engine.model_registry import get_model_class
from sluice.engine.outputs import PromptLogprobs
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice, ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.attention.selector import get_attention_backend
from sluice.engine.worker.cpu_memory import available_memory_bytes
from sluice.engine.worker.cuda_graph_runner import (
    CudaGraphRunner,
    KVCache,
    estimate_graph_memory_bytes,
    verify_capture_sizes,
)
from sluice.engine.worker.draft_model import load_draft_runner
from sluice.engine.worker.input_batch import SampledTokenIds, build_model_inputs, fill_placeholders
from sluice.engine.worker.jit_watch import JitCompileWatch
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.models.llama_cpu_stack import LlamaCpuStack, build_cpu_stack
from sluice.engine.worker.prompt_logprobs import compute_prompt_logprobs
from sluice.kernels.compile_target import device_sm_count

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Builds the model on `device` in `dtype`, loads `source.weights`, allocates the KV cache.

    The kernels are chosen once, here: the attention backend, then a `KernelConfig` the model's layers choose
    from as they are built; after loading, the whole-stack C++ path (`cpu_stack`) where every layer runs
    the C++ kernels. `config` is the one given with what it leaves to the device set (`with_step_budget`:
    the scheduler's step budget), and the engine core builds its scheduler from it.

    kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] (laid out
    heads first where the attention backend asks for it: `AttentionBackend.kv_cache_heads_first`), in
    `kv_cache_dtype`: the model dtype, or float8_e4m3fn (`--kv-cache-dtype fp8`, a byte per value).

    Under tensor parallelism (`tensor_parallel` of more than one rank, on the group's device) it runs one
    rank: the model holds this rank's part of the weights, the cache this rank's KV heads, and every rank's
    runner must be driven through the same calls in the same order (`sluice.engine.executor`), since the
    layers' collectives pair up across ranks. `num_blocks` is the smallest any rank's memory allows.

    With `--speculative draft`, rank 0 also loads the draft model (`draft_runner`, a `ModelRunner` built
    with kv_cache=False) before its cache is sized: the draft's weights are then resident when the memory
    left is measured, its forward runs in the CUDA memory profile, and the blocks are sized from both models'
    bytes per block (`kv_block_bytes_with_draft`), since the draft gets as many blocks as the target.
    """

    failed = False  # as `MultiprocExecutor.failed` (a worker is gone): never, in one process

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        tensor_parallel: TensorParallelGroup | None = None,
        *,
        kv_cache: bool = True,
    ) -> None:
        """kv_cache False (a draft model): no KV cache nor graphs until `initialize_kv_cache`."""
        self.arch = source.arch
        self.tensor_parallel = tensor_parallel or TensorParallelGroup.single()
        tp = self.tensor_parallel
        self.device = tp.device if tp.size > 1 else pick_device(config.model.device)
        self.max_model_len = pick_max_model_len(config.model, self.arch)
        self.config = config = with_step_budget(config, self.device, self.max_model_len)
        self.dtype = pick_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        # Graphs address whole blocks: contexts up to max_seq_len_to_capture, rounded up to a block.
        self.graph_max_blocks_per_seq = -(
            -min(self.max_model_len, config.max_seq_len_to_capture) // self.block_size
        )
        # Verify graphs (speculative decoding): steps of queries up to k + 1 tokens.
        spec = config.speculative
        self.verify_query_len = 0 if spec is None else spec.num_speculative_tokens + 1
        fp8_cache = config.cache.kv_cache_dtype == "fp8"
        self.kv_cache_dtype = torch.float8_e4m3fn if fp8_cache else self.dtype
        self.attention_backend = get_attention_backend(
            config.attention_backend,
            self.device,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype if fp8_cache else None,
        )
        heads = partition_heads(
            self.arch.num_attention_heads, self.arch.num_key_value_heads, tp.rank, tp.size
        )
        self.num_kv_heads = heads.num_kv_heads  # this rank's
        model_class = get_model_class(self.arch.architecture)
        self.kernels = self._kernel_config(model_class.packed_modules, fp8_cache)
        self.model = model_class(self.arch, self.kernels, max_positions=self.max_model_len)
        weights = source.weights
        if isinstance(weights, DummyWeights):  # random weights are drawn where they will live
            weights = weights.on(self.device)
        self.model.load_weights(weights)
        self.model.eval()
        self.cpu_stack: LlamaCpuStack | None = build_cpu_stack(self.model)
        # Graphs replay decode steps; the torch backend cannot skip padded rows, so it stays eager.
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and self.attention_backend.name != "torch"
        )
        # The draft model runs whole on rank 0, the core's process: loaded before the cache is sized.
        self.draft_runner = load_draft_runner(config, source, self.max_model_len) if tp.rank == 0 else None
        if kv_cache:
            self.initialize_kv_cache(tp.min(self._num_kv_blocks()))

    def initialize_kv_cache(self, num_blocks: int, *, log: bool = True) -> None:
        """Allocates `num_blocks` KV blocks (and as many for the draft model), then captures the CUDA graphs
        and warms the prefill kernels up. Raises ValueError naming the setting when a CPU cache would not
        fit in the memory left. `log`: the line giving the cache's size (the target's gives the draft's
        too, so the draft's runner logs none)."""
        config = self.config
        self._check_host_memory(num_blocks)
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        draft = self.draft_runner
        if log:
            draft_mib = (
                ""
                if draft is None
                else f"; the draft model's as many, {draft.kv_cache_mib(num_blocks):.1f} MiB"
            )
            logger.info(
                "KV cache: %d blocks of %d tokens (%d tokens), %s, %.1f MiB%s",
                num_blocks,
                self.block_size,
                num_blocks * self.block_size,
                self.kv_cache_dtype,
                self.kv_cache_mib(num_blocks),
                draft_mib,
            )
        if draft is not None:
            draft.initialize_kv_cache(num_blocks, log=False)
        # The graph runner calls `forward` through a weak reference: the bound method would make a cycle
        # (runner -> graph runner -> runner), and the weights, the KV cache (and a tensor-parallel group's
        # sockets) would outlive the engine's last reference until Python's cycle collector ran.
        forward = weakref.WeakMethod(self.forward)
        self.graph_runner = CudaGraphRunner(
            lambda *args: forward()(*args),
            self.kv_caches,
            config.scheduler.max_num_seqs,
            self.graph_max_blocks_per_seq,
            self.block_size,
            self.device,
            enforce_eager=not self.use_cuda_graphs,
            verify_query_len=self.verify_query_len,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        )
        self.graph_runner.capture()
        if self.device.type == "cuda":
            self._warm_up_prefill_tiles()
            JitCompileWatch().install()  # from here on, a Triton compile stalls a step: logged

    def _kernel_config(self, packed_modules: dict[str, tuple[str, int]], fp8_cache: bool) -> KernelConfig:
        """The layers' kernels: the checkpoint's FP8 quantization_config or `quantization`, and the cache's
        dtype. Raises ValueError naming the field for CPU-only int4/int8 off CPU or a bad FP8 config."""
        model = self.config.model
        if model.quantization in ("int4", "int8") and self.device.type != "cpu":
            raise ValueError(f"quantization: {model.quantization} runs on cpu, not {self.device.type}")
        fp8 = resolve_fp8_config(
            model.quantization,
            self.arch.extra,
            packed_modules,
            tied_lm_head=self.arch.tie_word_embeddings,
            random_weights=model.load_format == "dummy",
            weight_block=model.fp8_weight_block,
        )
        if fp8 is not None and fp8.kv_cache_scales and not fp8_cache:
            logger.info(
                "the checkpoint's KV-cache scales are not used: the cache is %s (--kv-cache-dtype)",
                self.dtype,
            )
        return KernelConfig.for_model(
            self.device,
            self.dtype,
            self.attention_backend,
            "fp8" if fp8 is not None else model.quantization,
            fp8=fp8,
            kv_cache_dtype=self.kv_cache_dtype if fp8_cache else None,
            tensor_parallel=self.tensor_parallel,
            skinny_linears=self.config.skinny_linears,
            fuse_norm_fp8=self.config.fuse_norm_fp8,
            fuse_silu_fp8=self.config.fuse_silu_fp8,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, hidden_size]: the decoder stack as one C++ call where it runs, else the model's
        layers."""
        if self.cpu_stack is not None:
            return self.cpu_stack(input_ids, positions, kv_caches, metadata)
        return self.model(input_ids, positions, kv_caches, metadata)

    @torch.inference_mode()
    def execute_model(
        self, out: SchedulerOutput, sampled_before: SampledTokenIds | None = None
    ) -> torch.Tensor:
        """Runs the step; returns logits [num_logits, vocab] float32: per slice with sample=True, in
        scheduled order, one row for its last token then one per draft token (`spec_token_ids`).
        `sampled_before` (async scheduling): the previous step's token ids on the device, which fill the
        step's placeholder tokens there; nothing here waits for the device."""
        return self._execute(out, (), sampled_before)[0]

    @torch.inference_mode()
    def execute_model_with_prompt_logprobs(
        self,
        out: SchedulerOutput,
        slices: Sequence[PromptLogprobsSlice],
        sampled_before: SampledTokenIds | None = None,
    ) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """`execute_model`, plus the prompt logprobs of `slices` (request id -> those of its slice)."""
        return self._execute(out, slices, sampled_before)

    def _execute(
        self,
        out: SchedulerOutput,
        slices: Sequence[PromptLogprobsSlice],
        sampled_before: SampledTokenIds | None,
    ) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        inputs = build_model_inputs(out, self.block_size, self.device)
        if sampled_before is not None:
            # Under tensor parallelism rank 0 sampled them: the other ranks' sampled_before has room for
            # them (`sluice.engine.executor`), filled here on the device, before any layer's collective
            # (contiguous already there, so received in place; on rank 0 a copy, if any, is only sent).
            # Every rank skips it alike when the step before sampled nothing (prompt chunks only).
            if len(sampled_before.token_ids):
                self.tensor_parallel.broadcast(sampled_before.token_ids.contiguous())
            fill_placeholders(inputs.input_ids, out, sampled_before)
        hidden = self.graph_runner.run(inputs)
        logits = self.model.compute_logits(
            hidden if inputs.samples_every_token else hidden[inputs.logits_indices]
        )
        if not slices:
            return logits, {}
        query_lens = inputs.metadata.query_lens_cpu
        return logits, compute_prompt_logprobs(hidden, query_lens, slices, self.model.compute_logits)

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process (`MultiprocExecutor` checks its workers)."""

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the model's parameters in this process (a tensor-parallel rank's part), as laid out."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (this rank's KV heads)."""
        arch = self.arch
        per_layer = self.block_size * self.num_kv_heads * arch.head_dim * self.kv_cache_dtype.itemsize
        return 2 * arch.num_hidden_layers * per_layer

    def kv_cache_mib(self, num_blocks: int) -> float:
        return num_blocks * self.kv_block_bytes / 2**20

    @property
    def kv_block_bytes_with_draft(self) -> int:
        """Bytes a block number takes in this rank's memory: this model's block and the draft model's."""
        return self.kv_block_bytes + (0 if self.draft_runner is None else self.draft_runner.kv_block_bytes)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            available = self._profile_available_cuda_bytes()
        else:
            available = cache.kv_cache_memory_bytes
        num_blocks = int(available // self.kv_block_bytes_with_draft)
        if num_blocks < 1:
            field = "gpu_memory_utilization" if self.device.type == "cuda" else "kv_cache_memory_bytes"
            raise ValueError(
                f"{field}: {available / 2**20:.1f} MiB left for the KV cache holds no block of "
                f"{self.kv_block_bytes_with_draft / 2**20:.2f} MiB{self._draft_share()}; raise it "
                "(or give num_blocks)"
            )
        return num_blocks

    def _check_host_memory(self, num_blocks: int) -> None:
        """A CPU cache larger than the memory left would be zeroed page by page until the OOM killer
        ended the process: refused at once instead, naming the setting. Tensor-parallel ranks on a CPU
        share one host: their caches together (each rank checked only its own, so two ranks of 2 GiB
        each started where 2.8 GiB were left). Every rank checks before any allocates."""
        if self.device.type != "cpu":
            return
        tp = self.tensor_parallel
        needed = tp.sum(num_blocks * self.kv_block_bytes_with_draft)
        # The least any rank saw (-1: one could not tell), so every rank judges alike.
        available = tp.min(-1 if (left := available_memory_bytes()) is None else left)
        if available < 0 or needed <= available:
            return
        field = "num_blocks" if self.config.cache.num_blocks is not None else "kv_cache_memory_bytes"
        ranks = f" over {tp.size} ranks" if tp.size > 1 else ""
        raise ValueError(
            f"{field}: a KV cache of {needed / 2**30:.1f} GiB{self._draft_share()}{ranks} is more than the "
            f"{available / 2**30:.1f} GiB of memory available"
        )

    def _draft_share(self) -> str:
        draft = self.draft_runner
        if draft is None:
            return ""
        return f" (target {self.kv_block_bytes} + draft model {draft.kv_block_bytes} bytes a block)"

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Zeroed, not empty: padded context rows are masked, but 0 * NaN garbage would still poison them.
        heads, head_dim = self.num_kv_heads, self.arch.head_dim
        heads_first = self.attention_backend.kv_cache_heads_first

        def new_cache() -> torch.Tensor:
            if heads_first:  # the same [blocks, block_size, heads, head_dim] shape, a head's rows together
                laid_out = (num_blocks, heads, self.block_size, head_dim)
                return torch.zeros(laid_out, dtype=self.kv_cache_dtype, device=self.device).transpose(1, 2)
            shape = (num_blocks, self.block_size, heads, head_dim)
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

        return [(new_cache(), new_cache()) for _ in range(self.arch.num_hidden_layers)]

    def _profile_available_cuda_bytes(self) -> float:
        """gpu_memory_utilization * total, minus the weights (the draft model's too), other processes, a
        worst-case step's peak (the target's or the draft's) and the memory the CUDA graphs will keep."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        graphs = 0
        if self.use_cuda_graphs:
            scheduler = self.config.scheduler
            verify_sizes = []
            if self.verify_query_len:
                verify_sizes = verify_capture_sizes(
                    scheduler.max_num_seqs, scheduler.max_num_batched_tokens, self.verify_query_len
                )
            graphs = estimate_graph_memory_bytes(
                self.arch,
                scheduler.max_num_seqs,
                self.graph_max_blocks_per_seq * self.block_size,
                self.dtype,
                verify_sizes=verify_sizes,
                verify_query_len=self.verify_query_len,
                num_sms=device_sm_count(self.device),
            )
        return self.config.cache.gpu_memory_utilization * total - peak - non_torch - graphs

    def _profile_run(self) -> None:
        """One forward pass of max_num_batched_tokens prompt tokens through a throwaway cache."""
        scheduler = self.config.scheduler
        tokens, seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
        self._throwaway_step(_profile_step(tokens, seqs, self.max_model_len, self.block_size))
        if self.draft_runner is not None:  # its forwards (of at most as many tokens) run between the target's
            self.draft_runner._profile_run()

    def _warm_up_prefill_tiles(self) -> None:
        """Compile, before the first request, every prefill tile a step can pick: the Triton prefill
        kernel's tile height follows the step's longest query (`prefill_config`), so the first step with
        short queries (speculative verifies, small chunks) would otherwise stall on a JIT compile. One
        prompt per length, and the same query after a context of two prefill partitions, which the kernel
        splits over programs (its split-KV variant and the partials' merge), through throwaway caches."""
        from sluice.kernels.prefill_splits import PREFILL_PARTITION_SIZE  # CUDA only: needs triton

        budget = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        for length in (n for n in WARM_UP_QUERY_LENS if n <= budget):
            self._throwaway_step(_profile_step(length, 1, length, self.block_size))
            num_cached = min(2 * PREFILL_PARTITION_SIZE, self.max_model_len - length)
            if num_cached + length > PREFILL_PARTITION_SIZE:  # a shorter model is never split
                self._throwaway_step(_cached_prefix_step(length, num_cached, self.block_size))

    @torch.inference_mode()
    def _throwaway_step(self, out: SchedulerOutput) -> None:
        """The forward and logits of the step `out` through a cache of its own blocks (numbered from 0):
        the serving cache is never touched."""
        caches = self._allocate_kv_cache(sum(len(req.block_ids) for req in out.scheduled))
        inputs = build_model_inputs(out, self.block_size, self.device)
        hidden = self.forward(inputs.input_ids, inputs.positions, caches, inputs.metadata)
        self.model.compute_logits(hidden[inputs.logits_indices])


WARM_UP_QUERY_LENS = (2, 4, 8, 16, 32, 64, 128)  # every prefill tile height, for any GQA group size


def _profile_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> SchedulerOutput:
    """Prompts of at most max_model_len tokens adding up to num_tokens, on consecutive blocks from 0."""
    scheduled = []
    next_block = 0
    remaining = num_tokens
    while remaining > 0 and len(scheduled) < max_num_seqs:
        length = min(remaining, max_model_len)
        num_blocks = -(-length // block_size)
        block_ids = tuple(range(next_block, next_block + num_blocks))
        scheduled.append(ScheduledRequest(f"profile-{len(scheduled)}", (0,) * length, 0, block_ids, True))
        next_block += num_blocks
        remaining -= length
    return SchedulerOutput(scheduled=tuple(scheduled), num_batched_tokens=num_tokens - remaining)


def _cached_prefix_step(query_len: int, num_cached: int, block_size: int) -> SchedulerOutput:
    """One request computing query_len tokens after num_cached positions (zeros in a fresh cache)."""
    num_blocks = -(-(num_cached + query_len) // block_size)
    request = ScheduledRequest("warm-up", (0,) * query_len, num_cached, tuple(range(num_blocks)), True)
    return SchedulerOutput(scheduled=(request,), num_batched_tokens=query_len)


def pick_device(name: str) -> torch.device:
    """Device `name`; "auto" means cuda when available, else cpu. ValueError naming `device` when it is a
    CUDA device torch does not see (rather than torch's AssertionError at the first allocation)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if (device.index or 0) >= visible:
            build = "" if torch.version.cuda else " (a CPU-only build of torch)"
            raise ValueError(f"device: {name}, but torch sees {visible} CUDA devices{build}")
    return device


def with_step_budget(config: EngineConfig, device: torch.device, max_model_len: int) -> EngineConfig:
    """`config` with the step budget its scheduler section leaves to the device set for `device`
    (`SchedulerConfig.with_step_budget`: 8192 tokens on GPUs of 70 GiB or more but the A100, else 2048;
    with chunked prefill off, at least `max_model_len`)."""
    if config.scheduler.max_num_batched_tokens is not None:
        return config
    total_memory, name = 0, ""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        total_memory, name = properties.total_memory, properties.name
    scheduler = config.scheduler.with_step_budget(device.type, total_memory, name, max_model_len)
    logger.info("step budget: %d tokens (%s)", scheduler.max_num_batched_tokens, name or device.type)
    return dataclasses.replace(config, scheduler=scheduler)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """Dtype `name`; "auto" means bfloat16 on cuda, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def pick_max_model_len(model_config: ModelConfig, arch: ModelArchConfig) -> int:
    """ModelConfig.max_model_len, else the model's limit, max_position_embeddings (sliding-window layers
    attend within their window at any length)."""
    limit = arch.max_position_embeddings
    requested = model_config.max_model_len
    if requested is not None and requested > limit:
        raise ValueError(
            f"max_model_len: {requested} exceeds the model's limit of {limit} (max_position_embeddings)"
        )
    return requested or limit
