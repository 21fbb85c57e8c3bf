"""Packed models on disk: a model's tensors after packing (projections and head in our kernels' layout, the
embedding table, the norms), written on the first start from a GGUF file and mapped back on later ones, so a
warm start reads no GGUF tensor and converts nothing.

An entry is keyed by the GGUF file's sha256, the weight format asked for, the backend (kernel build), the
model dtype, the kernel sources' digest, a digest of the Python that converts and packs (and of the gguf and
torch versions) and ``LAYOUT``; any change makes another entry. It is two files in
``cache_dir()/packed``: ``<key>.pt`` (``torch.save``; read back with ``mmap``, so its pages are the file's)
and ``<key>.json``, written last: the key's parts, the layers' layout and a crc32 of every 16 MiB of the
``.pt`` file. An entry without its json, with other parts, or whose ``.pt`` size or any crc differs is never
used; the caller builds the model again and rewrites it. After a write the least recently used entries are
removed while the cache holds more than ``SPECDECODE_PACKED_CACHE_GB`` (default 16) GiB;
``SPECDECODE_PACKED_CACHE=0`` turns the cache off.

It does not decide what is packed or how (``packing.py``, ``build.packed_from``); it only saves a packed
model and rebuilds one from its saved tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specdecode.models import native
from specdecode.models.backends import Backend
from specdecode.models.config import ModelConfig
from specdecode.models.fetch import cache_dir
from specdecode.models.linear import NativeLinear, QuantLinear, SplitLinear
from specdecode.models.packing import PROJECTIONS, adopt
from specdecode.models.transformer import Transformer

LAYOUT = 2  # bumped whenever what is saved, or how a layer is rebuilt from it, changes
SWITCH_ENV, BUDGET_ENV = "SPECDECODE_PACKED_CACHE", "SPECDECODE_PACKED_CACHE_GB"
_CRC_SPAN = 16 << 20  # bytes per crc32: spans checked in parallel (zlib releases the GIL)
_HASH_SPAN = 16 << 20
TMP_SUFFIX = ".tmp"


def serves(backend: Backend) -> bool:
    """Whether models packed for ``backend`` are kept: on for our kernels' builds (oneDNN's packed layout is
    opaque and cannot be saved), off where ``SPECDECODE_PACKED_CACHE`` is 0/off/false/no."""
    switched_off = os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "off", "false", "no")
    budget_bytes()  # a bad budget is refused before anything is packed
    return backend.name in native.BUILDS and not switched_off


def budget_bytes() -> float:
    """The cache's budget, ``SPECDECODE_PACKED_CACHE_GB`` GiB (default 16).

    Raises:
        ValueError: the variable is not a number >= 0 (the message names it).
    """
    value = os.environ.get(BUDGET_ENV, "16")
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"{BUDGET_ENV}={value!r}: expected the packed-model cache's size in GiB, a number >= 0")
    return gib * (1 << 30)


def folder() -> Path:
    return cache_dir() / "packed"


@dataclass(frozen=True)
class EntryKey:
    """What a packed model depends on; every field is part of the entry's name."""

    file_sha256: str
    weights: str
    backend: str
    dtype: str
    kernels: str
    conversion: str  # the Python that reads, converts and packs blocks, and the libraries it leans on
    layout: int = LAYOUT

    @classmethod
    def of(cls, gguf: Path, weights: str, backend: Backend, dtype: torch.dtype) -> "EntryKey":
        return cls(file_digest(gguf), weights, backend.name, str(dtype).replace("torch.", ""), native.source_digest(),
                   conversion_digest())

    @property
    def name(self) -> str:
        parts = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.file_sha256[:16]}-{self.weights}-{self.backend}-{hashlib.sha256(parts).hexdigest()[:12]}"


def conversion_digest() -> str:
    """A short hash of the sources that decide a packed model's bytes besides the kernels (reading, converting,
    choosing formats, packing, naming) and of the gguf and torch versions: an edit to any rebuilds the entries."""
    from importlib.metadata import version

    from specdecode.models import block_codecs, hf_import, linear, loader, packing, super_blocks, weights

    h = hashlib.sha256(f"gguf {version('gguf')}, torch {torch.__version__}".encode())
    for module in (block_codecs, hf_import, linear, loader, packing, super_blocks, weights):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:12]


def file_digest(path: Path) -> str:
    """The sha256 of a file, remembered in ``folder()/digests.json`` by path, size and modification time (a
    fetched model's verified ``.sha256`` marker is trusted the same way), so it is computed once per file."""
    path = path.resolve()
    stat = path.stat()
    # the inode and change time too: a file copied over another with its size and mtime kept is another file
    ident = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}:{stat.st_ctime_ns}"
    marker = path.with_name(path.name + ".sha256")
    if marker.is_file() and marker.stat().st_mtime_ns >= stat.st_mtime_ns:
        digest, _, size = marker.read_text().strip().partition(" ")
        if size == str(stat.st_size) and len(digest) == 64:
            return digest
    memo_file = folder() / "digests.json"
    memo = _read_json(memo_file) or {}
    if ident in memo:
        return memo[ident]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_SPAN):
            h.update(chunk)
    memo[ident] = h.hexdigest()
    _write_atomically(memo_file, json.dumps(memo).encode())
    return memo[ident]


def load(key: EntryKey, config: ModelConfig, backend: Backend, say: Callable[[str], None]) -> Transformer | None:
    """The packed model of entry ``key``, or None where there is none or it is damaged (then it is removed).

    Args:
        key: the entry.
        config: the model's architecture (from the GGUF's header).
        backend: the backend named in ``key`` (its kernels are loaded).
        say: told when an entry is damaged.
    """
    pt, meta_file = _paths(key)
    meta = _read_json(meta_file)
    if meta is None or not pt.is_file():
        return None
    if meta.get("key") != asdict(key) or meta.get("config") != _as_json(asdict(config)) or not _intact(pt, meta):
        say(f"packed model {pt.name} is damaged or stale; rebuilding it")
        _remove(key)
        return None
    try:
        os.utime(meta_file)  # recently used: evicted last
        state = torch.load(pt, mmap=True, weights_only=True)
        return _rebuild(config, backend, key.weights, state, meta["layers"])
    except Exception as exc:  # checksums passed, yet unreadable (another torch's format, a pickle error ...)
        say(f"packed model {pt.name} cannot be read ({type(exc).__name__}: {exc}); rebuilding it")
        _remove(key)
        return None


def save(key: EntryKey, model: Transformer, say: Callable[[str], None]) -> None:
    """Writes ``model`` (packed for ``key``'s backend) as entry ``key``; a failure to write is reported and
    leaves no entry (the cache is only an optimization)."""
    pt, meta_file = _paths(key)
    tmp = _temporary(pt)
    try:
        pt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), tmp)
        meta = {"key": asdict(key), "config": _as_json(asdict(model.config)), "layers": _layers(model),
                "size": tmp.stat().st_size, "crc32": _crcs(tmp)}
        os.replace(tmp, pt)
        _write_atomically(meta_file, json.dumps(meta).encode())
    except Exception as exc:  # torch.save reports a full disk as RuntimeError
        say(f"could not write the packed model to {pt.parent} ({exc}); the next start packs it again")
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return
    _evict(keep=meta_file)


def _layers(model: Transformer) -> dict[str, list[Any]]:
    """How to rebuild each packed layer: its format (a split layer's: each part's format and outputs), output and
    input features, and kernel build."""
    out = {}
    for name, layer in _packed_layers(model):
        if isinstance(layer, SplitLinear):
            fmt = [[part.fmt, part.out_features] for part in layer.parts]
        elif isinstance(layer, (NativeLinear, QuantLinear)):
            fmt = layer.weight_format
        else:
            raise TypeError(f"{name} is a {type(layer).__name__}; only our kernels' layers are saved")
        out[name] = [fmt, layer.out_features, layer.in_features, layer.path]
    return out


def _packed_layers(model: Transformer) -> list[tuple[str, Any]]:
    names = [f"layers.{i}.{p}" for i in range(len(model.layers)) for p in PROJECTIONS] + ["head_layer"]
    return [(name, model.get_submodule(name)) for name in names]


def _rebuild(config: ModelConfig, backend: Backend, weights: str, state: dict[str, torch.Tensor],
             layers: dict[str, list[Any]]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    for name, (fmt, n, k, path) in layers.items():
        if isinstance(fmt, list):  # a split layer's parts
            layer = SplitLinear([QuantLinear.from_packed(state[f"{name}.parts.{i}.packed"], part_fmt, part_n, k,
                                                         state.get(f"{name}.parts.{i}.bias"), path)
                                 for i, (part_fmt, part_n) in enumerate(fmt)])
        elif fmt == "bf16":
            layer = NativeLinear.from_packed(state[f"{name}.packed"], n, k, state.get(f"{name}.bias"), path)
        else:
            layer = QuantLinear.from_packed(state[f"{name}.packed"], fmt, n, k, state.get(f"{name}.bias"), path)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, layer)
    model.lm_head = None
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    adopt(model, backend, weights)
    return model


def _paths(key: EntryKey) -> tuple[Path, Path]:
    base = folder() / key.name
    return base.with_suffix(".pt"), base.with_suffix(".json")


def _crcs(path: Path) -> list[int]:
    """crc32 of every ``_CRC_SPAN`` bytes of ``path``, two spans at a time, each thread reading into one reused
    buffer (a mapping would count the whole file into the process's resident memory a second time)."""
    size = path.stat().st_size
    buffers = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:
        def crc(at: int) -> int:
            if not hasattr(buffers, "data"):
                buffers.data = bytearray(_CRC_SPAN)
            got = os.preadv(fd, [buffers.data], at)
            if got != min(_CRC_SPAN, size - at):
                raise OSError(f"{path} changed while it was read")
            return zlib.crc32(memoryview(buffers.data)[:got])

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(crc, range(0, size, _CRC_SPAN)))
    finally:
        os.close(fd)


def _intact(pt: Path, meta: dict[str, Any]) -> bool:
    try:
        return pt.stat().st_size == meta.get("size") and meta["size"] > 0 and _crcs(pt) == meta.get("crc32")
    except (OSError, ValueError):
        return False


def _as_json(value: Any) -> Any:
    """``value`` as read back from JSON (tuples become lists), for comparing with a saved one."""
    return json.loads(json.dumps(value))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _temporary(path: Path) -> Path:
    """A name beside ``path`` that no other process or thread writes (``_evict`` removes old leftovers)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _remove(key: EntryKey) -> None:
    for path in _paths(key):
        path.unlink(missing_ok=True)


def _evict(keep: Path) -> None:
    """Removes what an interrupted write left (temporaries older than an hour, a ``.pt`` without its json), then
    the least recently used entries (by their json's time) while the cache holds more than the budget."""
    budget = budget_bytes()
    try:
        now = time.time()
        for leftover in folder().glob(f".*{TMP_SUFFIX}"):
            if now - leftover.stat().st_mtime > 3600:
                leftover.unlink(missing_ok=True)
        for pt in folder().glob("*.pt"):
            if not pt.with_suffix(".json").exists() and now - pt.stat().st_mtime > 3600:
                pt.unlink(missing_ok=True)
        entries = sorted((p for p in folder().glob("*.json") if p.name != "digests.json"),
                         key=lambda p: p.stat().st_mtime_ns)
        sizes = {meta: meta.with_suffix(".pt").stat().st_size if meta.with_suffix(".pt").is_file() else 0
                 for meta in entries}
        total = sum(sizes.values())
        for meta, size in sizes.items():
            if total <= budget:
                break
            if meta != keep:
                meta.unlink(missing_ok=True)  # the json first: a half-removed entry is never read
                meta.with_suffix(".pt").unlink(missing_ok=True)
                total -= size
    except OSError:
        pass  # another process removed an entry meanwhile: the next write evicts again
