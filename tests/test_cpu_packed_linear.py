"""The C++ packed-panel linear kernel against `F.linear` (and its PyTorch reference), on random inputs with
the output poisoned first; and the linear layers that use it after loading.

Shapes cover every micro-kernel row count (1-6 rows and their remainders), a last panel that is full,
partial or one column wide, and steps from one decode row to a prefill chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import MergedLinear, ReplicatedLinear
from sluice.engine.worker.layers.linear_method import CpuPackedLinearMethod, UnquantizedLinearMethod
from sluice.engine.worker.layers.quantization import linear_method_for
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_packed_linear import (
    EXTENSION,
    pack_weight,
    packed_linear,
    packed_linear_reference,
    panel_width,
    unpack_weight,
)

ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 64, 131]
SHAPES = [(64, 1), (64, 63), (576, 64), (96, 65), (40, 200), (1536, 576)]  # (input_size, output_size)


def _extension():
    module = cpu_extension.load_cpu_extension(EXTENSION)
    assert module is not None, cpu_extension.cpu_extension_unavailable_reason(EXTENSION)
    return module


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("input_size", "output_size"), SHAPES)
def test_kernel_equals_f_linear_and_writes_every_output(rows, input_size, output_size):
    torch.manual_seed(rows * 1000 + output_size)
    x = torch.randn(rows, input_size)
    weight, bias = torch.randn(output_size, input_size), torch.randn(output_size)
    packed = pack_weight(weight)
    for b in (None, bias):
        y = torch.full((rows, output_size), float("nan"))
        _extension().packed_linear(y, x, packed, b)
        expected = F.linear(x, weight, b)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            packed_linear_reference(x, packed, output_size, b), expected, atol=1e-4, rtol=1e-4
        )


def test_launcher_keeps_leading_dims_and_reads_strided_rows():
    torch.manual_seed(0)
    weight = torch.randn(100, 48)
    x = torch.randn(3, 5, 96)[..., ::2]  # last dim strided: the launcher copies it to rows
    y = packed_linear(x, pack_weight(weight), 100)
    assert y.shape == (3, 5, 100)
    torch.testing.assert_close(y, F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_pack_lays_out_panels_and_unpacks_exactly():
    panel = panel_width()
    rows = 2 * panel + 2
    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    packed = pack_weight(weight)
    assert packed.shape == (3, 3, panel) and packed.is_contiguous()
    assert packed[1, 2, 5] == weight[panel + 5, 2]
    assert torch.equal(packed[2, :, 2:], torch.zeros(3, panel - 2))  # rows past the last: zeros
    assert torch.equal(unpack_weight(packed, rows), weight)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda panel: {"x": torch.randn(2, 8, dtype=torch.float64)}, r"^x: dtype torch.float64"),
        (lambda panel: {"packed": torch.randn(1, 8, 2 * panel)[..., ::2]}, r"^packed: last dim must be"),
        (lambda panel: {"output_size": 2 * panel + 1}, r"^packed: expected shape \(3, 8, {panel}\)"),
        (lambda panel: {"bias": torch.randn(11)}, r"^bias: expected shape \(10,\)"),
    ],
)
def test_launcher_names_the_bad_argument(change, message):
    panel = panel_width()
    args = {
        "x": torch.randn(2, 8),
        "packed": pack_weight(torch.randn(10, 8)),
        "output_size": 10,
        "bias": None,
    }
    with pytest.raises(ValueError, match=message.format(panel=panel)):
        packed_linear(**{**args, **change(panel)})


def test_loaded_layers_pack_their_weight_in_place():
    torch.manual_seed(1)
    layer = MergedLinear(40, (30, 50), bias=True)
    layer.set_method(CpuPackedLinearMethod(), torch.float32)
    weight, bias = torch.randn(80, 40), torch.randn(80)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    layer.process_weights_after_loading()
    panel = panel_width()
    assert layer.weight.shape == (-(-80 // panel), 40, panel)
    assert layer.packed.data_ptr() == layer.weight.data_ptr()  # one copy of the weight
    x = torch.randn(9, 40)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_a_tied_layer_keeps_the_embedding_rows_and_packs_a_copy():
    torch.manual_seed(2)
    embedding = torch.nn.Embedding(70, 16)
    lm_head = ReplicatedLinear(16, 70)
    lm_head.set_method(CpuPackedLinearMethod(), torch.float32)
    lm_head.tie_weight(embedding.weight)
    lm_head.process_weights_after_loading()
    assert lm_head.weight is embedding.weight
    assert embedding.weight.shape == (70, 16) and embedding.weight.is_contiguous()
    panel = panel_width()
    assert lm_head.packed.shape == (-(-70 // panel), 16, panel)
    x = torch.randn(4, 16)
    torch.testing.assert_close(lm_head(x), x @ embedding.weight.t(), atol=1e-4, rtol=1e-4)


def test_other_dtypes_keep_the_column_major_layout():
    layer = ReplicatedLinear(32, 48)
    method = linear_method_for("lm_head", layer, KernelConfig(torch.device("cpu"), torch.bfloat16))
    assert type(method) is UnquantizedLinearMethod and method.column_major
    layer.set_method(method, torch.bfloat16)
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    layer.weight.data.copy_(weight)
    layer.process_weights_after_loading()
    assert layer.weight.t().is_contiguous()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight))


def test_without_a_compiler_layers_fall_back_to_column_major_f_linear(monkeypatch):
    monkeypatch.setenv("CXX", "sluice-no-such-compiler")
    cpu_extension._build.cache_clear()
    try:
        kernels = KernelConfig.for_model(torch.device("cpu"), torch.float32, None)
        assert kernels.cpu_kernels == frozenset()
        layer = ReplicatedLinear(32, 48)
        method = linear_method_for("lm_head", layer, kernels)
        assert type(method) is UnquantizedLinearMethod and method.column_major
        layer.set_method(method, torch.float32)
        weight = torch.randn(48, 32)
        layer.weight.data.copy_(weight)
        layer.process_weights_after_loading()
        assert layer.weight.t().is_contiguous()
        x = torch.randn(3, 32)
        torch.testing.assert_close(layer(x), F.linear(x, weight))
    finally:
        monkeypatch.undo()
        cpu_extension._build.cache_clear()
