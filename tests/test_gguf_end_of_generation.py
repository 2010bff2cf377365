"""Where generation ends and whether BOS is added for a GGUF file, as llama.cpp decides both when it loads the
vocabulary (src/llama-vocab.cpp, `llama_vocab::impl::load`):

- end of generation: the file's eos, eot and eom ids, and every token named like an end of turn
  (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, ...) even where the file names no eot id. Gemma 3's files
  (the packaged 270M one among them) name only <eos>; instruction-tuned Gemma ends its turns with
  <end_of_turn>, which must end generation for a file loaded by its path too.
- BOS: `tokenizer.ggml.add_bos_token` where present; else added for a SentencePiece vocabulary and for the
  Llama 3 pre-tokenizer ("llama-bpe", "llama3", "llama-v3").
- The Llama 3 pre-tokenizer also sets `ignore_merges` (as Llama 3's own tokenizer.json): a piece that is in
  the vocabulary is that token, whatever the merges would make of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checkpoints import EOS_ID, IM_END_ID
from gguf import GGUFWriter, TokenType
from gguf_export import export_gguf

from sluice.engine.config import ModelConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.loading.packaged_models import packaged_model_path
from sluice.engine.sampling_params import SamplingParams

END_OF_TURN = "<end_of_turn>"


@pytest.fixture(scope="module")
def end_of_turn_gguf(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama as a GGUF whose token 3 is <end_of_turn> (<|im_end|> renamed) and whose eos is
    <|end_of_text|> (1): no eot id in the file, as Gemma 3's files."""
    root = tmp_path_factory.mktemp("end_of_turn")
    hf_dir = root / "hf"
    shutil.copytree(llama_dir, hf_dir)
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    im_end = tokenizer["model"]["vocab"].pop("<|im_end|>")
    tokenizer["model"]["vocab"][END_OF_TURN] = im_end
    for added in tokenizer["added_tokens"]:
        if added["content"] == "<|im_end|>":
            added["content"] = END_OF_TURN
    (hf_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    path = export_gguf(str(hf_dir), str(root / "tiny.gguf"))
    assert "tokenizer.ggml.eot_token_id" not in GGUFFile(path).metadata
    return path


def test_end_of_turn_token_ends_generation(end_of_turn_gguf: str) -> None:
    source = load_model_source(ModelConfig(model=end_of_turn_gguf))
    assert source.tokenizer.id_to_token(IM_END_ID) == END_OF_TURN
    assert source.arch.eos_token_ids == (EOS_ID, IM_END_ID)
    assert source.tokenizer.eos_token_ids == (EOS_ID, IM_END_ID)
    llm = LLM(end_of_turn_gguf, block_size=16)
    forced = {IM_END_ID: 100.0}  # the random model's first token is <end_of_turn>
    ended = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, logit_bias=forced))[0]
    assert (ended.token_ids, ended.finish_reason, ended.stop_reason) == ([IM_END_ID], "stop", IM_END_ID)
    params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=forced, ignore_eos=True)
    ignored = llm.generate([5, 6, 7], params)[0]
    assert (ignored.token_ids, ignored.finish_reason) == ([IM_END_ID] * 4, "length")


def test_packaged_gemma3_file_ends_on_end_of_turn() -> None:
    # The file names eos 1 (<eos>) only; its token 106 is <end_of_turn>, 212 is "</s>" (an HTML tag there).
    tokenizer = gguf_tokenizer(GGUFFile(packaged_model_path("gemma3-270m")))
    assert tokenizer.id_to_token(106) == END_OF_TURN and tokenizer.id_to_token(212) == "</s>"
    assert tokenizer.eos_token_ids == (1, 106)


def _vocabulary_gguf(path: Path, pre: str, add_bos_token: bool | None = None) -> str:
    """A GGUF with only a byte-level BPE vocabulary: the 256 byte symbols, <|begin_of_text|> (256),
    <|eot_id|> (257) and "hello" (258), which no merge makes."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["<|begin_of_text|>", "<|eot_id|>", "hello"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges([])
    writer.add_token_types([TokenType.NORMAL] * 256 + [TokenType.CONTROL] * 2 + [TokenType.NORMAL])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(
    ("pre", "add_bos_token", "adds_bos"),
    [
        ("llama-bpe", None, True),  # llama.cpp's default for the Llama 3 pre-tokenizer
        ("llama3", None, True),
        ("llama-bpe", False, False),  # the file's key decides
        ("gpt-2", None, False),
        ("gpt-2", True, True),
    ],
)
def test_bos_as_llama_cpp_adds_it(
    tmp_path: Path, pre: str, add_bos_token: bool | None, adds_bos: bool
) -> None:
    tokenizer = gguf_tokenizer(GGUFFile(_vocabulary_gguf(tmp_path / "vocab.gguf", pre, add_bos_token)))
    plain = tokenizer.encode("hi", add_special_tokens=False)
    assert plain == [tokenizer.token_to_id("h"), tokenizer.token_to_id("i")]
    assert tokenizer.encode("hi") == ([256] if adds_bos else []) + plain


@pytest.mark.parametrize(("pre", "whole"), [("llama-bpe", True), ("llama3", True), ("gpt-2", False)])
def test_llama3_pre_tokenizer_takes_whole_pieces_from_the_vocabulary(
    tmp_path: Path, pre: str, whole: bool
) -> None:
    tokenizer = gguf_tokenizer(GGUFFile(_vocabulary_gguf(tmp_path / "vocab.gguf", pre)))
    by_bytes = [tokenizer.token_to_id(c) for c in "hello"]
    assert tokenizer.encode("hello", add_special_tokens=False) == ([258] if whole else by_bytes)
    assert tokenizer.eos_token_ids == (257,)
