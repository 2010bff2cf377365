"""load_gguf on a tiny GGUF written here with gguf.GGUFWriter, checked against gguf's own dequantization,
the original tensors, transformers' GGUF loader and a `tokenizers`-trained BPE."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sluice.engine.config import ModelConfig
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_loader import load_gguf
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import load_model_source

Q = GGMLQuantizationType
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there",
    "café naïve 東京 🙂",
] * 20


def _train_bpe() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in effect.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    tensors = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": 1 + rand(HIDDEN)}
    tensors["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        # F16 in the file: start from f16-representable values so the round trip is exact.
        tensors[p + "self_attn.k_proj.weight"] = (
            rand(KV_HEADS * HEAD_DIM, HIDDEN).astype(np.float16).astype(np.float32)
        )
        tensors[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = 1 + rand(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
    return tensors


# HF name -> (GGUF name, type written). q/k are permuted like llama.cpp's converter does.
def _gguf_layout(hf_name: str) -> tuple[str, GGMLQuantizationType]:
    if not hf_name.startswith("model.layers."):
        return {
            "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
            "model.norm.weight": ("output_norm.weight", Q.F32),
            "lm_head.weight": ("output.weight", Q.Q8_0),
        }[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    part, qtype = {
        "self_attn.q_proj.weight": ("attn_q", Q.F32),
        "self_attn.k_proj.weight": ("attn_k", Q.F16),
        "self_attn.v_proj.weight": ("attn_v", Q.Q8_0),
        "self_attn.o_proj.weight": ("attn_output", Q.F16),
        "mlp.gate_proj.weight": ("ffn_gate", Q.Q8_0),
        "mlp.up_proj.weight": ("ffn_up", Q.Q8_0),
        "mlp.down_proj.weight": ("ffn_down", Q.Q8_0),
        "input_layernorm.weight": ("attn_norm", Q.F32),
        "post_attention_layernorm.weight": ("ffn_norm", Q.F32),
    }[rest]
    return f"blk.{layer}.{part}.weight", qtype


def write_tiny_gguf(path, *, arch="llama", tokenizer_model="gpt2", tied=False, extra_tensor=None):
    """Write a tiny llama GGUF; returns (HF tensors as written before quantization, trained BPE)."""
    bpe = _train_bpe()
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tensors = _hf_tensors(len(tokens), np.random.default_rng(0))
    if tied:
        del tensors["lm_head.weight"]
    writer = GGUFWriter(str(path), arch)
    writer.add_name("Tiny Llama")
    for add, value in [
        (writer.add_block_count, LAYERS), (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, INTERMEDIATE),
        (writer.add_head_count, HEADS),
        (writer.add_head_count_kv, KV_HEADS), (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_freq_base, 50000.0), (writer.add_rope_dimension_count, HEAD_DIM),
        (writer.add_tokenizer_model, tokenizer_model), (writer.add_tokenizer_pre, "gpt-2"),
        (writer.add_token_list, tokens), (writer.add_token_merges, _merges(bpe)),
        (writer.add_token_types, [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]),
        (writer.add_bos_token_id, vocab["<|im_start|>"]), (writer.add_eos_token_id, vocab["<|im_end|>"]),
        (writer.add_add_bos_token, False), (writer.add_chat_template, CHAT_TEMPLATE),
    ]:  # fmt: skip
        add(value)
    for hf_name, value in tensors.items():
        gguf_name, qtype = _gguf_layout(hf_name)
        if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
            value = _permute(value, HEADS if ".attn_q." in gguf_name else KV_HEADS)
        writer.add_tensor(gguf_name, quantize(value, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        writer.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors, bpe


def _merges(bpe: BackendTokenizer) -> list[str]:
    import json

    return [" ".join(m) if isinstance(m, list) else m for m in json.loads(bpe.to_str())["model"]["merges"]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors, bpe = write_tiny_gguf(path)
    source = load_gguf(path)
    return path, tensors, bpe, source, dict(source.weights)


def test_a_gguf_model_is_named_by_the_file_or_directory_model_names(tiny, tmp_path):
    """As a checkpoint directory is, and as README and `--served-model-name`'s help say: the name SMG's
    OpenAI callers send, not the file's general.name ("Tiny Llama" here)."""
    directory = tmp_path / "my-model"
    directory.mkdir()
    (directory / "weights-q8_0.gguf").write_bytes(tiny[0].read_bytes())
    assert load_gguf(tiny[0]).name == "Tiny Llama"
    assert load_model_source(ModelConfig(model=str(directory))).name == "my-model"
    assert load_model_source(ModelConfig(model=f"{directory}/")).name == "my-model"
    assert load_model_source(ModelConfig(model=str(directory / "weights-q8_0.gguf"))).name == "weights-q8_0"


def test_gguf_file_reads_what_gguf_reader_reads(tiny):
    path = tiny[0]
    reference = GGUFReader(path)
    ours = GGUFFile(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [(t.name, t.tensor_type) for t in ours.tensors] == [
        (t.name, t.tensor_type) for t in reference.tensors
    ]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape)), mine.name
        assert np.array_equal(mine.data.view(np.uint8).ravel(), theirs.data.view(np.uint8).ravel()), mine.name


def test_arch_from_metadata(tiny):
    _, tensors, bpe, source, _ = tiny
    vocab = bpe.get_vocab()
    assert source.name == "Tiny Llama"
    assert source.arch == ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=len(vocab), hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
        rms_norm_eps=pytest.approx(1e-5), rope_theta=50000.0, tie_word_embeddings=False,
        bos_token_id=vocab["<|im_start|>"], eos_token_ids=(vocab["<|im_end|>"],), name="Tiny Llama",
    )  # fmt: skip


def test_weights_dequantize_and_unpermute(tiny):
    _, tensors, _, _, weights = tiny
    assert set(weights) == set(tensors)
    for name, original in tensors.items():
        got = weights[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        qtype = _gguf_layout(name)[1]
        if qtype in (Q.F32, Q.F16):
            # q_proj (F32) and k_proj (F16) were written permuted: they must read back in HF layout exactly.
            expected = original.astype(np.float16).astype(np.float32) if qtype == Q.F16 else original
            assert torch.equal(got, torch.from_numpy(expected)), name
        else:
            # Q8_0: equal to gguf's own round trip, and within one quantization step of the original.
            assert torch.equal(got, torch.from_numpy(dequantize(quantize(original, qtype), qtype))), name
            step = np.abs(original).reshape(-1, 32).max(axis=1).max() / 127
            assert np.abs(got.numpy() - original).max() <= step, name


def test_weights_equal_transformers_gguf_loader(tiny):
    from transformers import AutoModelForCausalLM

    path, _, _, _, weights = tiny
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    reference = model.state_dict()
    assert set(weights) == set(reference)
    for name, got in weights.items():
        assert torch.equal(got, reference[name]), name


def test_tied_embeddings_when_output_is_absent(tmp_path):
    write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    source = load_gguf(tmp_path / "tied.gguf")
    assert source.arch.tie_word_embeddings is True
    assert "lm_head.weight" not in dict(source.weights)


def test_tokenizer_matches_trained_bpe(tiny):
    _, _, bpe, source, _ = tiny
    tok = source.tokenizer
    vocab = bpe.get_vocab()
    for text in ["the quick brown fox", "hello world, café 東京 🙂!", "  spaced\nlines\ttabs", "xyzzy 42"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == bpe.encode(text).ids, text
        assert tok.decode(ids) == text
    chat = "<|im_start|>user\nhello<|im_end|>"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == vocab["<|im_start|>"] and ids[-1] == vocab["<|im_end|>"]
    assert ids == bpe.encode(chat).ids
    assert tok.decode(ids) == "user\nhello"
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.eos_token_ids == (vocab["<|im_end|>"],)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unsupported_tensor_type(tmp_path):
    # 256 values of IQ2_XXS take one 66-byte block.
    raw = np.zeros((4, 66), dtype=np.uint8)
    write_tiny_gguf(tmp_path / "iq.gguf", extra_tensor=("blk.0.attn_z.weight", raw, Q.IQ2_XXS))
    with pytest.raises(ValueError) as err:
        load_gguf(tmp_path / "iq.gguf")
    assert str(err.value) == (
        "tensor 'blk.0.attn_z.weight': type IQ2_XXS is not supported; "
        "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"
    )


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(ValueError) as err:
        load_gguf(tmp_path / "phi.gguf")
    assert (
        str(err.value)
        == "general.architecture: 'phi3' is not supported; supported: llama, qwen2, qwen3, gemma3"
    )


def test_unsupported_tokenizer_model(tmp_path):
    write_tiny_gguf(tmp_path / "t5.gguf", tokenizer_model="t5")
    with pytest.raises(ValueError) as err:
        load_gguf(tmp_path / "t5.gguf")
    assert str(err.value) == "tokenizer.ggml.model: 't5' is not supported; supported: gpt2, llama"


def test_sentencepiece_vocabulary_without_scores_or_merges_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    file = GGUFFile(tmp_path / "spm.gguf")
    del file.metadata["tokenizer.ggml.merges"]
    with pytest.raises(ValueError) as err:
        gguf_tokenizer(file)
    assert str(err.value) == "tokenizer.ggml.scores: missing from the GGUF metadata (needed without merges)"


def test_missing_vocabulary_is_named(tiny):
    file = GGUFFile(tiny[0])  # a fresh read: the module's other tests share `tiny`
    del file.metadata["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError) as err:
        gguf_tokenizer(file)
    assert str(err.value) == "tokenizer.ggml.tokens: missing from the GGUF metadata"


def _patch(source: Path, destination: Path, key: bytes, offset: int, value: bytes) -> Path:
    """A copy of `source` with `value` written `offset` bytes after the end of the string `key`."""
    data = bytearray(source.read_bytes())
    at = data.index(key) + len(key) + offset
    data[at : at + len(value)] = value
    destination.write_bytes(data)
    return destination


def test_a_file_that_is_no_gguf_or_of_another_version_is_refused_naming_the_model(tiny, tmp_path):
    path = Path(tiny[0])
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ValueError) as err:
        GGUFFile(bad)
    assert str(err.value) == f"model: {str(bad)!r} is not a GGUF file (bad magic)"
    old = _patch(path, tmp_path / "v1.gguf", b"GGUF", 0, struct.pack("<I", 1))
    with pytest.raises(ValueError) as err:
        load_gguf(old)
    assert str(err.value) == f"model: {str(old)!r} is GGUF version 1; supported: 2, 3"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"^model: '{cut}' is truncated: tensor '[^']+' ends at byte \d+, "):
        load_gguf(str(cut))


def test_an_unknown_tensor_type_id_or_tensor_name_is_refused_naming_the_tensor(tmp_path):
    extra = ("blk.0.attn_z.weight", np.zeros((4, 8), dtype=np.float32), Q.F32)
    write_tiny_gguf(tmp_path / "extra.gguf", extra_tensor=extra)
    with pytest.raises(ValueError) as err:
        load_gguf(tmp_path / "extra.gguf")
    assert str(err.value) == "tensor 'blk.0.attn_z.weight': no Hugging Face name is known for it"
    # After the name: its number of dimensions (uint32), its 2 dimensions (uint64 each), its type id.
    unknown = _patch(
        tmp_path / "extra.gguf", tmp_path / "type.gguf", extra[0].encode(), 4 + 16, struct.pack("<I", 99)
    )
    with pytest.raises(ValueError) as err:
        GGUFFile(unknown)
    assert str(err.value) == "tensor 'blk.0.attn_z.weight': unknown GGML type id 99"


def test_missing_shape_metadata_and_partial_rotary_embeddings_are_refused_naming_the_key(tiny, tmp_path):
    path = Path(tiny[0])
    renamed = _patch(path, tmp_path / "ffn.gguf", b"llama.feed_forward_length", -1, b"x")
    with pytest.raises(ValueError) as err:
        load_gguf(renamed)
    assert str(err.value) == "llama.feed_forward_length: missing from the GGUF metadata"
    # After the key: its value's type (uint32), then the value (uint32).
    key = b"llama.rope.dimension_count"
    assert path.read_bytes().count(key) == 1
    partial = _patch(path, tmp_path / "rope.gguf", key, 4, struct.pack("<I", HEAD_DIM // 2))
    assert GGUFFile(partial).metadata[key.decode()] == HEAD_DIM // 2
    with pytest.raises(ValueError) as err:
        load_gguf(partial)
    assert str(err.value) == "llama.rope.dimension_count: partial rotary embeddings are not supported"
