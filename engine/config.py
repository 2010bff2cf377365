"""Engine configuration: frozen dataclasses validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash-attn")
QUANTIZATIONS = ("int4", "int8")


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """Where the weights come from and how they are held.

    `model` is a Hugging Face directory or a `.gguf` file; None means the embedded default model.
    With `load_format="dummy"`, `preset` names a shape from `sluice.engine.loading.presets` (or `model` points
    at a directory whose config.json gives the shape) and the weights are random.
    """

    model: str | None = None
    load_format: str = "auto"
    preset: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Weight-only quantization of the linear layers on CPU: None, "int4" or "int8".
    quantization: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.quantization in (None, *QUANTIZATIONS), "quantization", f"must be one of {QUANTIZATIONS}"
        )
        _require(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        _require(
            self.load_format != "dummy" or self.preset is not None or self.model is not None,
            "preset",
            "load_format='dummy' needs a preset name or a model directory with a config.json",
        )
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be > 0")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    On CPU the cache gets `kv_cache_memory_bytes`; on CUDA it gets `gpu_memory_utilization` of the
    device's memory minus what the weights and a profiling forward pass used. `num_blocks` overrides both.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size % 8 == 0, "block_size", "must be a multiple of 8")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks", "must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            "must be >= max_num_seqs so every running request can decode in one step",
        )


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per request and step,
    the target model verifies them in one forward pass.

    `ngram` (prompt lookup) matches the last `ngram_max` .. `ngram_min` tokens of the prompt + output
    against earlier tokens and proposes what followed; `draft` runs `draft_model` (same tokenizer).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "speculative", f"must be one of {SPECULATIVE_METHODS}")
        _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "must be in 1..16")
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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Decode batches whose longest context exceeds this run eagerly: a graph's attention grid and
    # partial buffers are sized for the longest context it may see, frozen at capture.
    max_seq_len_to_capture: int = 8192
    # torch intra-op threads of the engine core; None: one per physical core this process may run on.
    num_threads: int | None = None
    # None: no speculative decoding.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
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
