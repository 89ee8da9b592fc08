"""One reader for GGUF files: the header, the metadata, and the tensors as views of the
memory-mapped file. The loader, the tokenizer and the tools all read GGUFs through it.

Nothing is copied: a tensor's ``data`` is a uint8 view of the file, rows first. Metadata arrays
are decoded when first asked for (a vocabulary is 50k-250k strings; the gguf package's reader
builds an array per entry, 3.4 s and ~150 MB for the embedded model's 49,152 tokens), and
:meth:`GGUFFile.release_header` hands the header's pages back once it has been read.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian, version 2 and 3).
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property, lru_cache
from typing import Any

import numpy as np


class ValueType(IntEnum):
    """GGUF metadata value types (gguf.md: gguf_metadata_value_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct's format of each fixed-size type (numpy reads arrays of them in the same notation)
_FORMAT = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
           ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
           ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}

# GGML tensor types (ggml.h): id -> name, weights per block, bytes per block. The reader needs
# each type's size to find a tensor's bytes; the kernels' formats are the ones quant.py names.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its GGML type's name, shape (rows first: [N, K] for a matrix)
    and bytes."""

    name: str
    type: str  # "Q4_K", "F32", ...: gguf.GGMLQuantizationType's names
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view of the memory-mapped file: [rows, bytes per row] for a matrix

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Field:
    """Where one metadata value sits in the file (decoded on demand by ``GGUFFile.get``)."""

    type: ValueType
    item_type: ValueType | None  # arrays: their items' type
    count: int  # arrays: their length
    offset: int  # of the value (arrays: of the first item)


class GGUFFile:
    """A GGUF file, memory-mapped; raises ValueError for a file that is not one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.data)  # type: ignore[arg-type]
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if self.version < 2:
            raise ValueError(f"{path}: GGUF version {self.version} is not supported")
        self._pos = 24
        self.fields: dict[str, Field] = {}
        self._values: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = struct.unpack_from("<I", self._buf, self._pos)
            self._pos += 4
            self.fields[key] = self._field(ValueType(kind))
        alignment = self.get("general.alignment", 32)
        self._infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = struct.unpack_from("<I", self._buf, self._pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos + 4)
            kind, offset = struct.unpack_from("<IQ", self._buf, self._pos + 4 + 8 * n_dims)
            self._pos += 4 + 8 * n_dims + 12
            self._infos.append((name, kind, tuple(int(d) for d in reversed(dims)), offset))
        self.data_start = (self._pos + alignment - 1) // alignment * alignment

    # -- metadata

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (numbers, bool, str; arrays as lists, numeric ones as numpy arrays), or ``default``."""
        if key not in self.fields:
            return default
        if key not in self._values:
            self._values[key] = self._decode(self.fields[key])
        return self._values[key]

    def keys(self) -> list[str]:
        return list(self.fields)

    def typed(self, key: str) -> tuple[Any, ValueType, ValueType | None]:
        """``key``'s value (arrays as lists) with its GGUF type and item type: what writing it
        to another file as it is takes."""
        field, value = self.fields[key], self.get(key)
        return (value.tolist() if isinstance(value, np.ndarray) else value), field.type, field.item_type

    @property
    def architecture(self) -> str | None:
        return self.get("general.architecture")

    # -- tensors

    @cached_property
    def tensors(self) -> list[GGUFTensor]:
        out = []
        for name, type_id, shape, offset in self._infos:
            if type_id not in GGML_TYPES:
                raise ValueError(f"{self.path}: tensor {name} has GGML type {type_id}, which this reader does not know")
            kind, block, size = GGML_TYPES[type_id]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * shape[-1] // block * size
            start = self.data_start + offset
            view = np.asarray(self.data[start : start + nbytes])
            out.append(GGUFTensor(name, kind, shape, view.reshape(rows, -1) if len(shape) > 1 else view))
        return out

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    def release_header(self) -> None:
        """Hand back the header's pages (the vocabulary's strings: ~2 MB of the embedded model's):
        read once, they need not stay resident. Metadata not yet decoded is still readable."""
        drop_pages(self.data.ctypes.data, self.data.ctypes.data + self.data_start)

    # -- parsing

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._pos)
        self._pos += 8 + length
        return bytes(self._buf[self._pos - length : self._pos]).decode("utf-8", errors="replace")

    def _field(self, kind: ValueType) -> Field:
        """The field at the read position, which moves past it."""
        start = self._pos
        if kind == ValueType.ARRAY:
            item, count = struct.unpack_from("<IQ", self._buf, self._pos)
            self._pos += 12
            items = ValueType(item)
            if items == ValueType.STRING:
                for _ in range(count):
                    (length,) = struct.unpack_from("<Q", self._buf, self._pos)
                    self._pos += 8 + length
            elif items == ValueType.ARRAY:
                raise ValueError(f"{self.path}: arrays of arrays are not supported")
            else:
                self._pos += struct.calcsize(_FORMAT[items]) * count
            return Field(kind, items, count, start + 12)
        if kind == ValueType.STRING:
            self._string()
        else:
            self._pos += struct.calcsize(_FORMAT[kind])
        return Field(kind, None, 1, start)

    def _decode(self, field: Field) -> Any:
        if field.type == ValueType.ARRAY:
            assert field.item_type is not None
            if field.item_type == ValueType.STRING:
                pos, out = field.offset, []
                for _ in range(field.count):
                    (length,) = struct.unpack_from("<Q", self._buf, pos)
                    out.append(bytes(self._buf[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"))
                    pos += 8 + length
                return out
            return np.frombuffer(self._buf, dtype=_FORMAT[field.item_type], count=field.count, offset=field.offset).copy()
        if field.type == ValueType.STRING:
            (length,) = struct.unpack_from("<Q", self._buf, field.offset)
            return bytes(self._buf[field.offset + 8 : field.offset + 8 + length]).decode("utf-8", errors="replace")
        return struct.unpack_from(_FORMAT[field.type], self._buf, field.offset)[0]


def drop_pages(start: int, end: int) -> None:
    """Hand back the pages of a read-only file mapping wholly inside [start, end) (madvise
    MADV_DONTNEED): they leave the process's resident memory and are read from the file again if
    touched. Pages shared with bytes outside the range stay."""
    if not hasattr(os, "sysconf"):
        return
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED


@lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
