"""Engine configuration: frozen dataclasses validated on construction.

Each field that a user sets is declared with `option(default, help, ...)`: its help text and command-line
spelling live here, once, and `sluice serve` builds its engine flags from these fields
(`sluice.service.engine_args`), as `LLM(**kwargs)` builds the config from the same field names.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash-attn")
QUANTIZATIONS = ("int4", "int8", "fp8")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # sluice.engine.text.reasoning's
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8_e4m3: vLLM's other name for fp8, stored as "fp8"


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


# GetModelInfo (and SMG's GetServerInfo / GetLoads) report the context, the block size, the number of blocks
# and the scheduler's limits as int32s: a larger value would fail every one of those calls.
INT32_MAX = 2**31 - 1


def _require_positive_int32(value: int | None, name: str) -> None:
    """`value` (None: unset) is in 1..INT32_MAX."""
    _require(value is None or value > 0, name, "must be > 0")
    _require(value is None or value <= INT32_MAX, name, f"must be at most {INT32_MAX}, got {value}")


def _check_fields(config: object) -> None:
    """Each field of `config` holds its declared type, as vLLM's pydantic configs check (`LLM(**kwargs)`
    took block_size=16.0 and failed in the engine; enforce_eager="false" read as true), and as they take
    numbers (pydantic's lax mode): an integer field any integral number (numpy's, a whole float) made an
    int, a float field any real number made a float, a bool neither; and every integer fits an int64: the
    config crosses to the engine core in a message (msgpack), which takes no more, and no size or count
    needs more."""
    hints = get_type_hints(type(config))
    for f in fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        members = get_args(hint) if get_origin(hint) is UnionType else (hint,)
        if value is None and type(None) in members:
            continue
        kind = next((member for member in members if _is_a(value, member)), None)
        if kind is None:
            kinds = " or ".join(_kind(member) for member in members if member is not type(None))
            raise ValueError(f"{f.name}: must be {kinds}, got {value!r}")
        if kind in (int, float) and type(value) is not kind:
            value = kind(value)  # frozen: as the dataclass's own __post_init__ normalizes a field
            object.__setattr__(config, f.name, value)
        if kind is int:
            _require(-(2**63) <= value < 2**63, f.name, f"{value} is out of range (an int64)")


def _is_a(value: object, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is int:
        if isinstance(value, numbers.Integral):
            return True
        return isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def _default(config: type, name: str) -> Any:
    return next(f.default for f in fields(config) if f.name == name)


def _kind(kind: type) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, f"a {kind.__name__}")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    unit: str | None = None,
    exclusive: str | None = None,
) -> Any:
    """A config field with what its command-line flag needs: `help`; `flag`, the flag's name when it is not
    the field's (a True-by-default bool is switched off by a `no-...` flag); `choices`; `unit` ("bytes": the
    flag reads sizes such as 4GiB); `exclusive`, a group of flags of which at most one may be given."""
    metadata = {"help": help, "flag": flag, "choices": choices, "unit": unit, "exclusive": exclusive}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    """Where the weights come from and how they are held.

    `model` is a Hugging Face directory or a GGUF file (or a directory holding one); None means the embedded
    default model.
    With `load_format="dummy"`, `preset` names a shape from `sluice.engine.loading.presets` (or `model` points
    at a directory whose config.json gives the shape) and the weights are random.
    """

    model: str | None = option(
        None,
        "Hugging Face directory, GGUF file (or a directory holding one) or packaged model name such as "
        "gemma3-270m (default: the embedded SmolLM2)",
        exclusive="source",
    )
    load_format: str = option(
        "auto", "dummy: random weights shaped by --preset or by --model's config.json", choices=LOAD_FORMATS
    )
    preset: str | None = option(
        None, "random weights in a named shape (sluice.engine.loading.presets)", exclusive="source"
    )
    served_model_name: str | None = option(
        None,
        "the model's name in the API (GetModelInfo, SMG, which routes by it, traces); default: the name "
        "of --model's directory or file (less .gguf); with random weights dummy- and the preset's or "
        "directory's name",
    )
    dtype: str = option(
        "auto", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)", choices=DTYPES
    )
    device: str = option("auto", "cuda, cuda:N, cpu or auto (CUDA when available)")
    seed: int = option(0, "seed of random (preset) weights")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)")
    quantization: str | None = option(
        None,
        "quantization of the linear layers: int4 / int8 weight-only on CPU; fp8 (e4m3 weights, per-token "
        "activations) quantizes a float checkpoint at load (default: off; an FP8 checkpoint is FP8 anyway)",
        choices=QUANTIZATIONS,
    )
    fp8_weight_block: int | None = option(
        None,
        "with --quantization fp8: quantize at load in N x N weight blocks, activations in dynamic groups "
        "of N columns (the layout of DeepSeek-V3 / Qwen3-FP8 checkpoints; N a power of two >= 16) instead "
        "of per channel and token",
    )
    reasoning_parser: str | None = option(
        None,
        "split a chat's output into reasoning (<think>...</think>) and content, as vLLM's parser of that "
        "name; streamed apart (reasoning_text beside text), tool calls parsed from the content (default: "
        "off, the text whole)",
        choices=REASONING_PARSERS,
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.preset is not None and self.load_format == "auto":
            object.__setattr__(self, "load_format", "dummy")  # a preset's weights are random
        _require(
            self.quantization in (None, *QUANTIZATIONS), "quantization", f"must be one of {QUANTIZATIONS}"
        )
        _require(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}")
        _require(
            self.reasoning_parser in (None, *REASONING_PARSERS),
            "reasoning_parser",
            f"must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}",
        )
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        _require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        _require(
            self.preset is None or self.load_format == "dummy",
            "preset",
            f"gives random weights; it does not go with load_format={self.load_format!r}",
        )
        _require(
            self.load_format != "dummy" or self.preset is not None or self.model is not None,
            "preset",
            "load_format='dummy' needs a preset name or a model directory with a config.json",
        )
        _require_positive_int32(self.max_model_len, "max_model_len")
        # torch's CPU generator keeps a seed's low 32 bits: 0 and 2**32 (or -1 and 2**63 - 1) drew the same.
        limit = f"must be in [0, {2**32 - 1}] (torch's CPU generator takes 32 bits)"
        _require(0 <= self.seed < 2**32, "seed", limit)
        name = self.served_model_name
        _require(
            name is None or (name.strip() == name != "" and name.isprintable()),
            "served_model_name",
            f"must be printable, without surrounding spaces, and not empty; got {name!r}",
        )
        block = self.fp8_weight_block
        _require(
            block is None or self.quantization == "fp8", "fp8_weight_block", "goes with quantization fp8"
        )
        _require(
            block is None or (block >= 16 and block & (block - 1) == 0),
            "fp8_weight_block",
            f"must be a power of two >= 16, got {block}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    On CPU the cache gets `kv_cache_memory_bytes`; on CUDA it gets `gpu_memory_utilization` of the
    device's memory minus what the weights and a profiling forward pass used. `num_blocks` overrides both.
    """

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory_bytes: int = option(
        1 << 30, "KV cache size on CPU, e.g. 2GiB", flag="kv-cache-memory", unit="bytes"
    )
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory Sluice may use")
    num_blocks: int | None = option(None, "KV cache blocks (overrides both sizes above)")
    enable_prefix_caching: bool = option(True, "no automatic prefix caching", flag="no-prefix-caching")
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model dtype) or fp8 (e4m3, a byte per value: twice the tokens of bf16; "
        "scaled by the checkpoint's k_scale / v_scale, else 1.0; fp8_e4m3 is the same)",
        choices=KV_CACHE_DTYPES,
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}"
        )
        if self.kv_cache_dtype == "fp8_e4m3":
            object.__setattr__(self, "kv_cache_dtype", "fp8")
        _require(self.block_size > 0 and self.block_size % 8 == 0, "block_size", "must be a multiple of 8")
        _require_positive_int32(self.block_size, "block_size")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _require_positive_int32(self.num_blocks, "num_blocks")


# The step budget when none is given (`SchedulerConfig.max_num_batched_tokens`), as vLLM's server picks it:
# 8192 tokens on GPUs of 70 GiB or more other than the A100 (H100, H200, MI300X: a 4096-token prompt in one
# step; vLLM found large budgets slower on the A100), 2048 elsewhere, CPUs included.
DEFAULT_STEP_BUDGET = 2048
LARGE_GPU_STEP_BUDGET = 8192
LARGE_GPU_BYTES = 70 * 2**30


def default_step_budget(device_type: str, total_memory: int = 0, device_name: str = "") -> int:
    """The step budget for a device of `device_type` ("cuda", "cpu", ...), with `total_memory` bytes named
    `device_name` (a GPU's; unused elsewhere)."""
    large = total_memory >= LARGE_GPU_BYTES and "a100" not in device_name.lower()
    return LARGE_GPU_STEP_BUDGET if device_type == "cuda" and large else DEFAULT_STEP_BUDGET


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and prefill chunks.

    `max_num_batched_tokens` None: the model runner sets it for its device (`with_step_budget`), before the
    scheduler is built."""

    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one step (decodes + prefill chunks; default: 8192 on a GPU of 70 GiB or more "
        "other than an A100, 2048 elsewhere, and at least --max-num-seqs)",
    )
    max_num_seqs: int = option(128, "requests running at once")
    enable_chunked_prefill: bool = option(
        True,
        "prefill a prompt in one step (the default step budget becomes at least the model's context; a "
        "prompt and its max_tokens must fit the budget)",
        flag="no-chunked-prefill",
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        budget = self.max_num_batched_tokens
        _require_positive_int32(budget, "max_num_batched_tokens")
        _require_positive_int32(self.max_num_seqs, "max_num_seqs")
        _require(
            budget is None or budget >= self.max_num_seqs,
            "max_num_batched_tokens",
            "must be >= max_num_seqs so every running request can decode in one step",
        )

    def with_step_budget(
        self, device_type: str, total_memory: int = 0, device_name: str = "", max_model_len: int = 0
    ) -> SchedulerConfig:
        """This config with `max_num_batched_tokens` set: as given, else the device's default
        (`default_step_budget`), raised to max_num_seqs so that every running request can decode and,
        with chunked prefill off, to `max_model_len` so that any prompt the model takes fits one step (as
        vLLM raises it: else every request was held to the default, 2048 tokens on a CPU)."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = max(default_step_budget(device_type, total_memory, device_name), self.max_num_seqs)
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return replace(self, max_num_batched_tokens=budget)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: each layer's weights split over `tensor_parallel_size` ranks, one process per
    device (NCCL between GPUs, gloo between CPU processes); docs/PARALLELISM.md."""

    tensor_parallel_size: int = option(
        1, "ranks (processes, one per device) that each hold 1/N of every layer's weights"
    )
    distributed_timeout_seconds: float = option(
        300.0, "seconds a collective waits for a silent rank before the engine fails"
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        # Finite and at most a day: inf failed the load with OverflowError (torch takes a timedelta).
        _require(
            0 < self.distributed_timeout_seconds <= 86400,
            "distributed_timeout_seconds",
            "must be in (0, 86400] seconds",
        )


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per request and step,
    the target model verifies them in one forward pass.

    `ngram` (prompt lookup) matches the last `ngram_max` .. `ngram_min` tokens of the prompt + output
    against earlier tokens and proposes what followed; `draft` runs `draft_model` (same tokenizer).
    With `disable_by_batch_size` N, no drafts are proposed while N or more requests are running: at large
    batches a verify step's k + 1 rows a request cost more than its accepted drafts save.
    """

    method: str = option(
        "ngram",
        "speculative decoding: ngram (prompt lookup) or draft (a smaller model, --draft-model)",
        flag="speculative",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(3, "draft tokens verified per step")
    ngram_min: int = option(1, "shortest suffix n-gram looked up")
    ngram_max: int = option(4, "longest suffix n-gram looked up")
    draft_model: str | None = option(None, "draft model directory (--speculative draft)")
    disable_by_batch_size: int | None = option(
        None,
        "no drafts while this many requests or more are running: steps decode plainly (and overlap, with "
        "async scheduling) until the batch is smaller again (vLLM's speculative_disable_by_batch_size)",
        flag="speculative-disable-by-batch-size",
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.method in SPECULATIVE_METHODS, "speculative", f"must be one of {SPECULATIVE_METHODS}")
        _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "must be in 1..16")
        _require(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 2,
            "disable_by_batch_size",
            "must be >= 2 (at 1 no request would ever speculate)",
        )
        _require(self.ngram_min >= 1, "ngram_min", "must be >= 1")
        _require(self.ngram_max >= self.ngram_min, "ngram_max", "must be >= ngram_min")
        _require(
            self.method != "draft" or self.draft_model is not None,
            "draft_model",
            "speculative method 'draft' needs a draft model",
        )
        _require(
            self.method == "draft" or self.draft_model is None,
            "draft_model",
            "is only used with speculative method 'draft'",
        )
        for name in ("ngram_min", "ngram_max"):  # as draft_model with ngram: a setting that would do nothing
            _require(
                self.method == "ngram" or getattr(self, name) == _default(type(self), name),
                name,
                "is only used with speculative method 'ngram'",
            )


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine: its sections, and the settings of the model runner.

    `EngineConfig.from_kwargs(model, **kwargs)` builds one from flat field names, as `LLM(...)` takes them.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str = option("auto", "attention kernels", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "no CUDA graphs")
    # Decode batches whose longest context exceeds this run eagerly: a graph's attention grid and
    # partial buffers are sized for the longest context it may see, frozen at capture.
    max_seq_len_to_capture: int = option(8192, "decode batches with a longer context run without CUDA graphs")
    num_threads: int | None = option(
        None,
        "torch threads of the engine core process, of each rank under tensor parallelism "
        "(default: its physical cores, divided among the ranks)",
    )
    # None: on where it was measured to pay (a CUDA device, one rank: on an H100 the 1b preset's TPOT over
    # gRPC fell to 0.84x at concurrency 1 and 0.73x at 64, greedy outputs equal), off on CPU, where the
    # forward uses every core and there is little to overlap (`schedules_async`).
    async_scheduling: bool | None = option(
        None,
        "schedule step N+1 while step N runs on the device (its sampled tokens feed N+1 there); steps with "
        "speculation stay synchronous (default: on with one CUDA device, off on CPU and with tensor "
        "parallelism)",
    )
    # Off until a GPU run times it (docs/GPU.md, the GPU check's `pdl` section): cuBLAS reads the 1b
    # preset's bf16 weights at ~68% of the copy rate in a batch-1 step (run 15, H200).
    skinny_linears: bool = option(
        False,
        "float linears of steps of up to 64 rows on Sluice's Triton split-K launch "
        "(sluice.kernels.skinny_mm) instead of cuBLAS; needs the Triton kernels (a CUDA device); untimed",
    )
    # Off until a GPU run times it (docs/GPU.md, the GPU check's `pdl` and `fp8_large` sections): run 15's
    # llama-3-8b FP8 one-row step spent 255 us of 3.62 ms in 65 RMSNorm launches (H200).
    fuse_norm_fp8: bool = option(
        False,
        "FP8 linears: a one-row step's RMSNorm (and residual add) runs inside qkv_proj's and gate_up_proj's "
        "launch, which normalizes and quantizes the row as it loads it; needs the Triton kernels (a CUDA "
        "device); untimed",
    )
    # Off until a GPU run times it (docs/GPU.md, the same sections): run 15's llama-3-8b FP8 one-row step
    # spent 203 us of 3.62 ms in 32 SiLU-and-mul launches, each one program on one SM (H200).
    fuse_silu_fp8: bool = option(
        False,
        "FP8 linears: a one-row step's SiLU-and-mul runs inside down_proj's launch, which activates and "
        "quantizes the [gate | up] row as it loads it; needs the Triton kernels (a CUDA device); untimed",
    )
    # None: no speculative decoding (on the command line: no --speculative).
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _check_fields(self)  # its sections checked themselves
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}",
        )
        _require(
            self.max_seq_len_to_capture > 0,
            "max_seq_len_to_capture",
            f"must be > 0, got {self.max_seq_len_to_capture}",
        )
        _require(self.num_threads is None or self.num_threads > 0, "num_threads", "must be > 0")

    def schedules_async(self, device_type: str | None) -> bool:
        """Whether the engine core on a `device_type` ("cuda", "cpu"; None for tensor-parallel ranks) device
        overlaps its steps: the `async_scheduling` given, else on for CUDA with one rank, off otherwise
        (under tensor parallelism it works, tested with gloo on CPU, but no multi-GPU run has timed it)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda" and self.parallel.tensor_parallel_size == 1

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (fields of any section, e.g. `block_size=16`, `max_num_seqs=8`,
        `dtype="bfloat16"`, or of `EngineConfig` itself, or a whole section such as
        `speculative=SpeculativeConfig(...)`) -> a config. An optional section (`speculative`) is built only
        when one of its fields is given. An argument nothing owns raises TypeError."""
        sections = config_sections(cls)
        given: dict[str, dict[str, Any]] = {name: {} for name in sections}
        given["model"]["model"] = model
        top = {}
        for key, value in kwargs.items():
            owner = next((name for name, s in sections.items() if key in s.cls.__dataclass_fields__), None)
            if owner is not None:
                given[owner][key] = value
            elif key in cls.__dataclass_fields__:
                top[key] = (
                    value  # a setting of EngineConfig's own, or a whole section (SpeculativeConfig(...))
                )
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        built = {
            name: s.cls(**given[name])
            for name, s in sections.items()
            if name not in top and (given[name] or not s.optional)
        }
        return cls(**built, **top)


@dataclass(frozen=True)
class ConfigSection:
    """A field of a config that is a config dataclass itself; `optional`: it may be None (then absent)."""

    cls: type
    optional: bool


def config_sections(config: type = EngineConfig) -> dict[str, ConfigSection]:
    """field name -> its `ConfigSection`, for the fields of `config` typed as config dataclasses."""
    hints = get_type_hints(config)
    sections = {}
    for f in fields(config):
        hint = hints[f.name]
        members = (
            [m for m in get_args(hint) if m is not type(None)] if get_origin(hint) is UnionType else [hint]
        )
        if len(members) == 1 and is_dataclass(members[0]):
            sections[f.name] = ConfigSection(members[0], optional=members[0] is not hint)
    return sections
