"""`sluice serve`'s engine flags come from the config dataclasses: every option field has its flag, with the
field's default, and the flags build the config the fields describe; `LLM(**kwargs)` takes the same names."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields

import numpy as np
import pytest

from sluice.engine.config import EngineConfig, SpeculativeConfig, config_sections, option
from sluice.service.cli import build_parser, load_commands
from sluice.service.engine_args import add_engine_arguments, engine_config_from_args, flag_name, parse_size


def _parse(*flags: str) -> argparse.Namespace:
    return build_parser(load_commands(["serve"])).parse_args(["serve", *flags])


def _option_fields() -> list[tuple[str | None, object]]:
    found = [(None, f) for f in fields(EngineConfig) if "help" in f.metadata]
    for name, section in config_sections().items():
        found += [(name, f) for f in fields(section.cls) if "help" in f.metadata]
    return found


def test_every_option_field_has_a_flag_with_the_field_default() -> None:
    parser = build_parser(load_commands(["serve"]))
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {option: action for action in serve._actions for option in action.option_strings}
    assert len(_option_fields()) >= 25
    for section, f in _option_fields():
        action = flags[f"--{flag_name(f)}"]
        assert action.help.startswith(f.metadata["help"]), f.name
        # The optional section's flags parse to None unless given (its first one switches it on, the
        # others are refused without it: engine_config_from_args); their help says the default.
        in_optional_section = section == "speculative"
        assert action.default == (None if in_optional_section else f.default), f.name
        if in_optional_section and f.name != "method" and f.default is not None:
            assert action.help.endswith(f"(default: {f.default})"), f.name


def test_no_flags_give_the_default_config() -> None:
    assert engine_config_from_args(_parse()) == EngineConfig()


def test_flags_build_every_section() -> None:
    config = engine_config_from_args(
        _parse(
            "--preset", "tiny", "--dtype", "float32", "--max-model-len", "512",
            "--block-size", "32", "--kv-cache-memory", "64MiB", "--no-prefix-caching",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-chunked-prefill",
            "--attention-backend", "torch", "--enforce-eager", "--num-threads", "1",
            "--speculative", "ngram", "--ngram-max", "3", "--served-model-name", "llama-3-8b",
        )
    )  # fmt: skip
    assert (config.model.preset, config.model.load_format, config.model.dtype) == ("tiny", "dummy", "float32")
    assert (config.model.max_model_len, config.model.served_model_name) == (512, "llama-3-8b")
    assert (config.cache.block_size, config.cache.kv_cache_memory_bytes) == (32, 64 << 20)
    assert config.cache.enable_prefix_caching is False
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 256)
    assert config.scheduler.enable_chunked_prefill is False
    assert (config.attention_backend, config.enforce_eager, config.num_threads) == ("torch", True, 1)
    assert config.speculative == SpeculativeConfig("ngram", ngram_max=3)


def test_bad_flags_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--model", "/m", "--preset", "tiny")
    assert "argument --preset: not allowed with argument --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--kv-cache-memory", "lots")
    assert "argument --kv-cache-memory: cannot read size 'lots'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^ngram-max: needs --speculative$"):
        engine_config_from_args(_parse("--ngram-max", "3"))
    with pytest.raises(ValueError, match="^block_size: must be a multiple of 8$"):
        engine_config_from_args(_parse("--block-size", "12"))
    for device in ("meta", "", "gpu", "cuda:x"):  # torch's errors came later: AttributeError, RuntimeError
        with pytest.raises(ValueError, match=f"^device: must be auto, cpu, cuda or cuda:N, got '{device}'$"):
            engine_config_from_args(_parse("--device", device))
    assert engine_config_from_args(_parse("--device", "cuda:1")).model.device == "cuda:1"
    for name in ("", " llama", "llama\n"):
        with pytest.raises(
            ValueError, match=f"^served_model_name: must be printable, .* got {re.escape(repr(name))}$"
        ):
            engine_config_from_args(_parse("--served-model-name", name))


@dataclass(frozen=True)
class _BadSection:
    enable_thing: bool = option(True, "a thing")


@dataclass(frozen=True)
class _BadConfig:
    bad: _BadSection = field(default_factory=_BadSection)


def test_a_true_by_default_bool_needs_a_no_flag() -> None:
    with pytest.raises(TypeError, match="enable_thing: a field that defaults to True needs a flag='no-...'"):
        add_engine_arguments(argparse.ArgumentParser(), _BadConfig)


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("2G") == 2 * 1000**3 and parse_size("1000") == 1000


def test_llm_keywords_are_the_config_field_names() -> None:
    config = EngineConfig.from_kwargs(
        "/models/x", block_size=32, max_num_seqs=4, dtype="float32", enforce_eager=True, ngram_max=3
    )
    assert (config.model.model, config.model.dtype) == ("/models/x", "float32")
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.enforce_eager) == (32, 4, True)
    assert config.speculative == SpeculativeConfig(ngram_max=3)
    assert EngineConfig.from_kwargs(None).speculative is None
    whole = SpeculativeConfig("ngram", num_speculative_tokens=5)
    assert EngineConfig.from_kwargs(None, speculative=whole).speculative is whole
    with pytest.raises(TypeError, match="unknown engine argument 'bogus'"):
        EngineConfig.from_kwargs(None, bogus=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 2.5}, "max_num_seqs: must be an integer, got 2.5"),
        ({"max_model_len": True}, "max_model_len: must be an integer, got True"),
        ({"enforce_eager": "false"}, "enforce_eager: must be true or false, got 'false'"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching: must be true or false, got 'no'"),
        ({"num_blocks": "64"}, "num_blocks: must be an integer, got '64'"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization: must be a number, got '0.5'"),
        ({"dtype": 16}, "dtype: must be a string, got 16"),
        ({"async_scheduling": 1}, "async_scheduling: must be true or false, got 1"),
        ({"max_num_batched_tokens": float("inf")}, "max_num_batched_tokens: must be an integer, got inf"),
        ({"seed": 2**63}, f"seed: {2**63} is out of range (an int64)"),
    ],
)
def test_llm_keywords_of_another_type_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    """`LLM(**kwargs)` took them: "false" turned enforce_eager on, max_num_seqs=2.5 ran."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig.from_kwargs(None, **kwargs)


def test_llm_keywords_take_numbers_as_pydantic_does() -> None:
    """A whole float, numpy's integers and floats, an integer for a float: made the field's type
    (block_size=16.0 failed in the engine: a float to torch.zeros)."""
    config = EngineConfig.from_kwargs(
        None,
        block_size=16.0,
        max_model_len=np.int64(256),
        max_num_seqs=np.int32(4),
        gpu_memory_utilization=np.float32(0.5),
        distributed_timeout_seconds=60,
    )
    values = (
        config.cache.block_size,
        config.model.max_model_len,
        config.scheduler.max_num_seqs,
        config.cache.gpu_memory_utilization,
        config.parallel.distributed_timeout_seconds,
    )
    assert [(type(v), v) for v in values] == [(int, 16), (int, 256), (int, 4), (float, 0.5), (float, 60.0)]
