"""A fast, read-only view of a GGUF file: metadata as Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` builds a numpy view per array item, which takes ~10 s for the 98k strings of a 49k-token
vocabulary. This reads the same layout (GGUF v2/v3, little-endian) with `struct` in well under a second:

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: str, value_type: u32, value)          str = u64 length + UTF-8 bytes
    tensor_count x (name: str, n_dims: u32, dims: u64 x n_dims (innermost first), type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (each at data_start + offset)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first): the file's dims reversed
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes as gguf.quants.dequantize expects: [rows, bytes per row] uint8


class GGUFFile:
    """`metadata`: key -> int / float / bool / str / list; `tensors`: in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._buffer = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buffer)
        if bytes(self._view[:4]) != b"GGUF":
            raise ValueError(f"model: {self.path!r} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"model: {self.path!r} is GGUF version {version}; supported: 2, 3")
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._read_str()
            self.metadata[key] = self._read_value(GGUFValueType(self._read("<I")))
        infos = [self._read_tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        length = self._read("<Q")
        text = str(self._view[self._pos : self._pos + length], "utf-8")
        self._pos += length
        return text

    def _read_value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._read_str()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self._read("<I")), self._read("<Q")
            if item_type in _SCALARS:  # read a numeric array in one unpack
                fmt = _SCALARS[item_type]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self._view, self._pos)
                self._pos += count * struct.calcsize(fmt)
                return list(values)
            return [self._read_value(item_type) for _ in range(count)]
        return self._read(_SCALARS[value_type])

    def _read_tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._read_str()
        n_dims = self._read("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", self._view, self._pos)
        self._pos += 8 * n_dims
        return name, dims, self._read("<I"), self._read("<Q")

    def _tensor(
        self, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int
    ) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r}: unknown GGML type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        row_bytes = dims[0] // block_size * type_size
        num_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        end = start + num_rows * row_bytes
        if end > len(self._buffer):  # a download cut short: numpy's reshape would name no file or tensor
            raise ValueError(
                f"model: {self.path!r} is truncated: tensor {name!r} ends at byte {end}, "
                f"the file has {len(self._buffer)}"
            )
        data = self._buffer[start:end].reshape(num_rows, row_bytes)
        return GGUFTensor(name, tuple(int(d) for d in reversed(dims)), tensor_type, data)
