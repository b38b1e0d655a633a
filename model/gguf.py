"""A bounded reader for GGUF files (llama.cpp's model format): metadata and tensors.

A model file is untrusted input. Every count and size in the header is checked against the
bytes actually left in the file *before* anything is read or allocated, so a forged header
costs an error, never a huge allocation or a long loop; every failure is one line of
`GGUFError`. The file is memory-mapped; a tensor is only read (and dequantised to float32 with
`gguf.quants.dequantize`) when asked for.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata element, which is slow on a
vocabulary and merge list of tens of thousands of strings, and it trusts the header's counts.
The format's constants (value types, quantisation block sizes) and the dequantisation kernels
still come from the `gguf` package.

Shapes: GGUF lists a tensor's dimensions innermost first (ggml `ne` order); `TensorInfo.shape`
is the numpy (row-major) shape, i.e. reversed: a Linear weight [out, in].
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_STRING = 1 << 24  # no key, token or template of a real model comes near 16 MiB

# GGUF metadata value types (gguf.GGUFValueType): struct format of the scalar ones.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
STRING, ARRAY = 8, 9
INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
FLOAT_TYPES = (6, 12)


class GGUFError(ValueError):
    """A GGUF file that cannot be used: launchers print it on one line and exit 2."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: innermost (contiguous) first
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims[::-1]


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    def __init__(self, buf, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left:
            raise GGUFError(f"{self.where}: truncated or corrupt: {what} needs {n} bytes at "
                            f"offset {self.pos}, {self.left} left")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"{what} length")
        if n > MAX_STRING:
            raise GGUFError(f"{self.where}: corrupt: {what} claims {n} bytes")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.where}: corrupt: {what} is not UTF-8") from None

    def value(self, vtype: int, what: str, in_array: bool = False):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY and not in_array:
            return self.array(what)
        raise GGUFError(f"{self.where}: corrupt: {what} has unknown value type {vtype}")

    def array(self, what: str):
        etype = self.scalar("I", f"{what} element type")
        count = self.scalar("Q", f"{what} element count")
        if etype in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[etype])
            self.need(count * size, f"{what} ({count} elements)")
            dtype = np.dtype("<" + _SCALARS[etype]) if etype != 7 else np.dtype(np.bool_)
            out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += count * size
            return out
        if etype == STRING:
            # Each string needs at least its 8-byte length: bounds the loop by the file size.
            self.need(count * 8, f"{what} ({count} strings)")
            return self._strings(count, what)
        raise GGUFError(f"{self.where}: unsupported: {what} is an array of type {etype}")

    def _strings(self, count: int, what: str) -> list[str]:
        """`string()` unrolled: a vocabulary is ~50k strings, and per-call overhead dominates."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q")
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"{what}[{i}] length")
            (n,) = length.unpack_from(buf, pos)
            if n > MAX_STRING or pos + 8 + n > end:
                self.pos = pos
                raise GGUFError(f"{self.where}: truncated or corrupt: {what}[{i}] claims {n} "
                                f"bytes at offset {pos}, {end - pos - 8} left")
            try:
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
            except UnicodeDecodeError:
                raise GGUFError(f"{self.where}: corrupt: {what}[{i}] is not UTF-8") from None
            pos += 8 + n
        self.pos = pos
        return out


# Rows dequantised per call: the float32 result is written in place chunk by chunk, so the
# temporaries of `gguf.quants.dequantize` (several float32 copies of its input) stay this small
# whatever the size of the largest tensor.
DEQUANT_CHUNK_VALUES = 1 << 18


def _dequantize_rows(raw: np.ndarray, shape: tuple[int, ...], qtype, dequantize) -> np.ndarray:
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    blocks = raw.reshape(max(1, n_rows), -1)
    out = np.empty((n_rows, shape[-1]), np.float32)
    step = max(1, DEQUANT_CHUNK_VALUES // max(1, shape[-1]))
    for i in range(0, n_rows, step):
        out[i:i + step] = dequantize(blocks[i:i + step], qtype)
    return out


class GGUFFile:
    """Metadata (`metadata[key] -> (value type, value)`) and tensor table of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = repr(str(self.path))
        if not self.path.is_file():
            raise GGUFError(f"{where}: no such file")
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # an empty file cannot be mapped
            raise GGUFError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
        self.size = len(self._map)
        cur = _Cursor(self._map, where)
        cur.need(4, "magic")
        if bytes(self._map[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{where}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        cur.pos = 4
        self.version = cur.scalar("I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{where}: GGUF version {self.version} is not supported "
                            f"(readable: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = cur.scalar("Q", "tensor count")
        n_kv = cur.scalar("Q", "metadata count")
        # Smallest possible entries: a key/value is >= 8+1+4+1 bytes, a tensor info >= 8+4+8+4+8.
        cur.need(n_kv * 14, f"{n_kv} metadata entries")
        self.metadata: dict[str, tuple[int, object]] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            vtype = cur.scalar("I", f"type of {key}")
            if key in self.metadata:
                raise GGUFError(f"{where}: corrupt: metadata key {key!r} appears twice")
            value = cur.value(vtype, key)
            if vtype == ARRAY:  # remember the element type for checks
                vtype = (ARRAY, "str" if isinstance(value, list) else value.dtype.kind)
            self.metadata[key] = (vtype, value)
        cur.need(n_tensors * 32, f"{n_tensors} tensor infos")
        infos = []
        for i in range(n_tensors):
            infos.append(self._tensor_info(cur, i))
        alignment = self.metadata.get("general.alignment", (4, 32))
        if alignment[0] != 4 or alignment[1] <= 0 or alignment[1] & (alignment[1] - 1):
            raise GGUFError(f"{where}: corrupt: general.alignment {alignment[1]!r} is not a "
                            f"power of two (uint32)")
        align = alignment[1]
        self.data_offset = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, rel, n_bytes in infos:
            if name in self.tensors:
                raise GGUFError(f"{where}: corrupt: tensor {name!r} appears twice")
            if rel % align:
                raise GGUFError(f"{where}: corrupt: tensor {name!r} offset {rel} is not aligned "
                                f"to {align}")
            start = self.data_offset + rel
            if start + n_bytes > self.size:
                raise GGUFError(f"{where}: truncated or corrupt: tensor {name!r} needs bytes "
                                f"{start}..{start + n_bytes}, the file has {self.size}")
            self.tensors[name] = TensorInfo(name, dims, ggml_type, start, n_bytes)

    def _tensor_info(self, cur: _Cursor, i: int):
        name = cur.string(f"tensor {i} name")
        n_dims = cur.scalar("I", f"tensor {name!r} rank")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{cur.where}: corrupt: tensor {name!r} has rank {n_dims}")
        dims = tuple(cur.scalar("Q", f"tensor {name!r} dims") for _ in range(n_dims))
        raw_type = cur.scalar("I", f"tensor {name!r} type")
        rel = cur.scalar("Q", f"tensor {name!r} offset")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{cur.where}: corrupt: tensor {name!r} has unknown type "
                            f"{raw_type}") from None
        if dims[0] % block:
            raise GGUFError(f"{cur.where}: corrupt: tensor {name!r} row of {dims[0]} is not a "
                            f"multiple of its {qtype.name} block of {block}")
        n_bytes = int(np.prod(dims, dtype=object)) // block * type_size  # Python ints: no wrap
        return name, dims, raw_type, rel, n_bytes

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as float32 in numpy order (dequantised if it is stored quantised); of a
        2-D tensor, `rows` (start, stop) reads those rows alone (a row is whole blocks)."""
        info = self.tensors[name]
        offset, n_bytes, shape = info.offset, info.n_bytes, info.shape
        if rows is not None:
            if len(shape) != 2 or not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise GGUFError(f"{str(self.path)!r}: tensor {name!r} {list(shape)} has no rows "
                                f"{rows[0]}..{rows[1]}")
            row = n_bytes // shape[0]
            offset, n_bytes = offset + rows[0] * row, (rows[1] - rows[0]) * row
            shape = (rows[1] - rows[0], shape[1])
        raw = np.frombuffer(self._map, np.uint8, n_bytes, offset)
        qtype = GGMLQuantizationType(info.ggml_type)
        try:
            if qtype == GGMLQuantizationType.F32:
                out = raw.view("<f4").reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                out = raw.view("<f2").reshape(shape)
            else:
                out = _dequantize_rows(raw, shape, qtype, dequantize)
            # A view of the map (F32) is copied; a dequantised result is already a fresh array.
            out = (np.array(out, np.float32) if np.shares_memory(out, raw)
                   else np.asarray(out, np.float32))
        except (ValueError, NotImplementedError, TypeError) as e:
            raise GGUFError(f"{str(self.path)!r}: tensor {name!r} ({qtype.name}) cannot be read "
                            f"({type(e).__name__})") from None
        del raw
        self._release(offset, n_bytes)
        return out.reshape(shape)

    def _release(self, offset: int, n_bytes: int) -> None:
        """Drop the file pages just read from this process's resident set: reading a model one
        tensor at a time should cost one tensor of host memory, not the whole file by the end.
        (The pages stay in the OS page cache; a later read maps them back in.)"""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + n_bytes - start)
        except (OSError, ValueError):
            pass  # advice only: a platform that refuses it just keeps the pages

    # --- typed metadata access: a missing key or a value of the wrong type is one line ---------

    def _get(self, key: str, kinds, what: str):
        if key not in self.metadata:
            raise GGUFError(f"{str(self.path)!r}: metadata {key!r} is missing")
        vtype, value = self.metadata[key]
        if vtype not in kinds:
            raise GGUFError(f"{str(self.path)!r}: metadata {key!r} has type {vtype}, "
                            f"expected {what}")
        return value

    def get_int(self, key: str) -> int:
        return int(self._get(key, INT_TYPES, "an integer"))

    def get_float(self, key: str) -> float:
        return float(self._get(key, FLOAT_TYPES + INT_TYPES, "a number"))

    def get_str(self, key: str) -> str:
        return self._get(key, (STRING,), "a string")

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        if default is not None and key not in self.metadata:
            return default
        return bool(self._get(key, (7,), "a bool"))

    def get_strings(self, key: str) -> list[str]:
        return self._get(key, ((ARRAY, "str"),), "an array of strings")

    def get_floats(self, key: str) -> np.ndarray:
        return self._get(key, ((ARRAY, "f"),), "an array of floats")

    def get_ints(self, key: str) -> np.ndarray:
        return self._get(key, ((ARRAY, "i"), (ARRAY, "u")), "an array of integers")
