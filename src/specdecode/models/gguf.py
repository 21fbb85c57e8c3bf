"""GGUF files read without the ``gguf`` package's reader: the header, metadata and tensor table from a
memory map, and one tensor's stored bytes at a time.

It does not map names or build configs (``loader.py``), and it imports nothing of the models package but
nothing else either: the tokenizer reads GGUF metadata through it without importing the loader.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


class LoadError(RuntimeError):
    """A model source exists but cannot be loaded; the message names the source and the reason."""


class GGUFError(LoadError):
    """A file that is not a readable GGUF file (wrong magic, truncated, inconsistent)."""



_GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in a GGUF file.

    Args:
        name: llama.cpp tensor name (``blk.0.attn_q.weight``).
        shape: numpy/torch order, outermost first (GGUF stores it innermost first).
        qtype: storage type (F32, Q4_K ...).
        offset: absolute byte offset in the file.
        nbytes: stored size in bytes.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """The parsed header of a GGUF file: metadata and the tensor directory, no tensor data.

    Args:
        path: the file.
        metadata: every key/value pair (strings, numbers, lists).
        tensors: tensor directory by llama.cpp name, in file order.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    """Sequential little-endian reads over a buffer, each bounds-checked so garbage fails fast."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: not a valid GGUF file ({what} at byte {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} runs past the end of the {len(self.buf)}-byte file; truncated?")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8") from exc

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        etype = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if etype in _SCALARS:
            # Numeric arrays (token types, scores) are read in one go rather than element by element.
            fmt = _SCALARS[etype]
            size = struct.calcsize(fmt)
            self.need(count * size, what)
            values = np.frombuffer(self.buf[self.pos:self.pos + count * size], dtype=np.dtype(fmt)).tolist()
            self.pos += count * size
            return values
        self.need(count * 8, what)  # every string or nested array is at least 8 bytes
        return [self.value(etype, what) for _ in range(count)]

    def tensor_entry(self) -> tuple[str, list[int], GGMLQuantizationType, int]:
        """One entry of the tensor directory: name, dims (GGUF order), type and offset in the data section."""
        name = self.string("tensor name")
        n_dims = self.scalar("<I", name)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self.fail(f"tensor {name} has {n_dims} dimensions")
        dims = [self.scalar("<Q", name) for _ in range(n_dims)]
        raw_type = self.scalar("<I", name)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(f"tensor {name} has unknown type {raw_type}") from None
        return name, dims, qtype, self.scalar("<Q", name)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses a GGUF file's header: metadata and tensor directory.

    Faster than ``gguf.GGUFReader`` on large vocabularies (which spends seconds building numpy views
    per token string); tensor data is not read.

    Args:
        path: the ``.gguf`` file.

    Raises:
        GGUFError: the file is empty, not GGUF, big-endian, of an unsupported version, or truncated.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # mmap refuses empty files
            raise GGUFError(f"{path}: not a valid GGUF file ({exc})") from exc
    with buf:
        cur = _Cursor(buf, path)
        cur.need(4, "magic")
        if buf[:4] != _GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.scalar("<I", "version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version >= 1 << 16 else ""
            raise GGUFError(f"{path}: unsupported GGUF version {version}{hint}; expected 2 or 3")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            metadata[key] = cur.value(cur.scalar("<I", key), key)
        infos = [cur.tensor_entry() for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        file_size = len(buf)

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, qtype, rel in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} has row length {dims[0]}, "
                            f"not a multiple of {qtype.name}'s block {block}")
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        offset = data_start + rel
        if offset + nbytes > file_size:
            raise GGUFError(f"{path}: truncated: tensor {name} needs bytes {offset}..{offset + nbytes} "
                            f"but the file has {file_size}")
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, offset, nbytes)
    return GGUFFile(path, metadata, tensors)


def read_gguf_raw(f: BinaryIO, info: GGUFTensorInfo) -> np.ndarray:
    """One tensor's stored bytes (uint8 ``[info.nbytes]``), as its type lays them out.

    Args:
        f: the GGUF file opened in binary mode.
        info: the tensor's entry from :func:`read_gguf`.
    """
    raw = np.empty(info.nbytes, dtype=np.uint8)
    f.seek(info.offset)
    if f.readinto(raw) != info.nbytes:
        raise GGUFError(f"{f.name}: truncated while reading tensor {info.name}")
    return raw
