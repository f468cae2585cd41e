"""The expert store: every MoE layer's experts laid out on disk, read back with `os.preadv`.

Layout: one file per MoE layer, one record per expert, every per-expert tensor of the layer's
switch module (for a 4-bit SwitchGLU nine: gate/up/down x weight/scales/biases; a SwitchMLP's
fc1/fc2, expert biases, other quantization modes' scales: whatever the model holds) back to back,
so that one `preadv` scatters a record straight into its destination buffers. Records start on
page boundaries (the cold tier drops exactly a record's pages). `index.json` holds the tensor
layout, offsets and one CRC-32 per expert, and a digest of the model it was built from.

Reader threads only issue system calls into NumPy or slot memory: MLX streams are
thread-local, so MLX arrays are made by the consuming thread, never here.
"""

import hashlib
import json
import os
import shutil
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import disk_short, progress
from ..models.anatomy import expert_params, get_param, moe_layers

FORMAT = "titan-expert-store"
VERSION = 1
PAGE = 4096
TIERS = ("page_cache", "cold")
VERIFY = ("first", "always", "never")

# NumPy cannot name bfloat16; the store only moves bytes, so a 16-bit view stands in.
NP_DTYPES = {
    "uint32": np.uint32,
    "int32": np.int32,
    "uint16": np.uint16,
    "int16": np.int16,
    "uint8": np.uint8,
    "int8": np.int8,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
}


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


class StoreError(RuntimeError):
    """A store that is missing, corrupt, truncated or built from another model."""


def built_from(path, model_path) -> bool:
    """Whether the store in `path` exists and was built from the model in `model_path`."""
    try:
        return json.loads((Path(path) / "index.json").read_text()).get("model_digest") == model_digest(model_path)
    except (OSError, ValueError):
        return False


def _cancel_unread(part, task):
    """A hand-off that never ran (the store closed first) leaves none of its reads pending."""
    if task.cancelled():
        for _, fut in part:
            fut.cancel()


@dataclass(frozen=True)
class TensorSpec:
    name: str  # e.g. "gate_proj.weight"
    shape: tuple
    dtype: str  # MLX dtype name
    offset: int  # within the expert record
    nbytes: int


def model_digest(model_path) -> str:
    """What the store must match: config.json and every weight file's safetensors header."""
    model_path = Path(model_path)
    h = hashlib.sha256((model_path / "config.json").read_bytes())
    for f in sorted(model_path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(n))
    manifest = model_path / "titan-build.json"
    if manifest.exists():
        h.update(manifest.read_bytes())
    return h.hexdigest()


def _dtype_name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def _expert_bytes(arr) -> memoryview:

    arr = mx.contiguous(arr)
    mx.eval(arr)
    return memoryview(arr).cast("B")


def build(model, model_path, out, model_id: str) -> Path:
    """Write the expert store of a (lazily) loaded mlx-lm model into `out`, atomically."""

    out = Path(out)
    blocks = list(moe_layers(model))
    need = [_layer_bytes(glu) for _, glu in blocks]
    short = disk_short(out.parent, sum(need))
    if short is not None:
        raise StoreError(
            f"{short} to build the expert store of '{model_id}' ({sum(need) / 1e9:.2f} GB in {len(need)} "
            "layer files); free space there or set TITAN_RESOURCES to a larger disk"
        )
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        return _write(blocks, need, model_path, out, tmp, model_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _layer_bytes(glu) -> int:
    """A MoE layer's file: its experts' records, each rounded up to a page."""
    params = list(expert_params(glu))
    record = -(-sum(int(np.prod(a.shape[1:])) * a.dtype.size for _, a in params) // PAGE) * PAGE
    return record * params[0][1].shape[0]


def _write(blocks, need, model_path, out: Path, tmp: Path, model_id: str) -> Path:
    layers = []
    tensors = None
    start = time.perf_counter()
    what = f"the expert store of {model_id}"
    progress(what, 0, len(blocks), 0, sum(need), 0.0)
    for ordinal, (li, glu) in enumerate(blocks):
        specs, off = [], 0
        for name, a in expert_params(glu):
            shape = tuple(a.shape[1:])
            nbytes = int(np.prod(shape)) * a.dtype.size
            specs.append(TensorSpec(name, shape, _dtype_name(a.dtype), off, nbytes))
            off += nbytes
        if tensors is None:
            tensors = specs
        elif specs != tensors:
            raise StoreError(f"MoE layer {li}: expert tensors differ from the first MoE layer's")
        record = -(-off // PAGE) * PAGE
        num_experts = get_param(glu, specs[0].name).shape[0]
        fname = f"layer_{ordinal:03d}.bin"
        crcs = []
        with open(tmp / fname, "wb") as f:
            for e in range(num_experts):
                chunks = [_expert_bytes(get_param(glu, t.name)[e]) for t in specs]
                crc = 0
                for c in chunks:
                    crc = zlib.crc32(c, crc)
                    f.write(c)
                f.write(b"\0" * (record - off))
                crcs.append(crc)
            f.flush()
            os.fsync(f.fileno())
        layers.append({"layer": li, "file": fname, "experts": num_experts, "crc32": crcs})
        mx.clear_cache()
        progress(what, ordinal + 1, len(blocks), sum(need[: ordinal + 1]), sum(need), time.perf_counter() - start)
    if tensors is None:
        raise StoreError(f"model '{model_id}' has no MoE layer: nothing to store")
    index = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_id,
        "model_digest": model_digest(model_path),
        "expert_bytes": tensors[-1].offset + tensors[-1].nbytes,
        "record_bytes": -(-(tensors[-1].offset + tensors[-1].nbytes) // PAGE) * PAGE,
        "tensors": [
            dict(name=t.name, shape=list(t.shape), dtype=t.dtype, offset=t.offset, nbytes=t.nbytes) for t in tensors
        ],
        "layers": layers,
    }
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


class Store:
    """An opened expert store: validated index, one descriptor per layer file, reader threads."""

    def __init__(self, path, model_path=None, tier="page_cache", readers=4, verify="first"):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, not {tier!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, not {verify!r}")
        self.path = Path(path)
        self.tier = tier
        self.verify = verify
        index_path = self.path / "index.json"
        if not index_path.exists():
            raise StoreError(f"{index_path}: no store index (build it with `python -m engine store build MODEL`)")
        try:
            idx = json.loads(index_path.read_text())
            if idx.get("format") != FORMAT or idx.get("version") != VERSION:
                raise ValueError(f"format {idx.get('format')!r} version {idx.get('version')!r}")
            self.tensors = [
                TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["offset"], t["nbytes"]) for t in idx["tensors"]
            ]
            self.expert_bytes = int(idx["expert_bytes"])
            self.record_bytes = int(idx["record_bytes"])
            self.layers = idx["layers"]
            self.model = idx["model"]
            for t in self.tensors:
                if (
                    t.dtype not in NP_DTYPES
                    or int(np.prod(t.shape)) * np.dtype(NP_DTYPES[t.dtype]).itemsize != t.nbytes
                ):
                    raise ValueError(
                        f"tensor {t.name}: shape {t.shape} and dtype {t.dtype} do not make {t.nbytes} bytes"
                    )
            for layer in self.layers:
                if len(layer["crc32"]) != layer["experts"]:
                    raise ValueError(
                        f"layer {layer['layer']}: {len(layer['crc32'])} checksums for {layer['experts']} experts"
                    )
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{index_path}: malformed store index ({e})") from None
        if model_path is not None:
            digest = model_digest(model_path)
            if digest != idx.get("model_digest"):
                raise StoreError(
                    f"{self.path}: this store was built from another model than {model_path} "
                    f"(digest {str(idx.get('model_digest'))[:12]} != {digest[:12]}); rebuild it with "
                    f"`python -m engine store build {self.model} --force`"
                )
        self._fds = []
        for layer in self.layers:
            fpath = self.path / layer["file"]
            want = layer["experts"] * self.record_bytes
            try:
                size = os.stat(fpath).st_size
            except FileNotFoundError:
                self.close()
                raise StoreError(f"{fpath}: missing store file of MoE layer {layer['layer']}") from None
            if size < want:
                self.close()
                last = size // self.record_bytes
                raise StoreError(
                    f"{fpath}: truncated ({size} of {want} bytes): experts {last}..{layer['experts'] - 1} "
                    f"of MoE layer {layer['layer']} are missing"
                )
            if size > want:  # every byte past the index's records was written by something else
                self.close()
                raise StoreError(
                    f"{fpath}: damaged: {size} bytes, {size - want} past the {want} its index gives MoE layer "
                    f"{layer['layer']}; rebuild it with `python -m engine store build {self.model} --force`"
                )
            self._fds.append(os.open(fpath, os.O_RDONLY))
        self._verified = [np.zeros(layer["experts"], bool) for layer in self.layers]
        # Demand reads and prefetches have their own threads, so that a read the decode thread
        # waits for never queues behind speculative ones.
        self.readers = readers
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="titan-reader")
        self._prefetch_pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="titan-reader-prefetch")

    # -- layout ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_experts(self, layer: int) -> int:
        return self.layers[layer]["experts"]

    def empty_record(self) -> np.ndarray:
        """A record buffer on a page boundary (misaligned destinations make reads slower)."""
        return aligned_empty(self.expert_bytes)

    def views(self, record: np.ndarray) -> list:
        """NumPy views of the per-expert tensors inside one record buffer."""
        return [record[t.offset : t.offset + t.nbytes].view(NP_DTYPES[t.dtype]).reshape(t.shape) for t in self.tensors]

    # -- reading --------------------------------------------------------------------------
    def read_into(self, layer: int, expert: int, dests) -> float:
        """Read one expert with a single `preadv` into `dests` (writable buffers, in tensor
        order, or one buffer of expert_bytes). Returns the seconds spent in the read."""
        meta = self.layers[layer]
        if not 0 <= expert < meta["experts"]:
            raise StoreError(f"{self.path / meta['file']}: expert {expert} out of range (layer has {meta['experts']})")
        fd = self._fds[layer]
        offset = expert * self.record_bytes
        if self.tier == "cold":
            os.posix_fadvise(fd, offset, self.record_bytes, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        n = os.preadv(fd, dests, offset)
        dt = time.perf_counter() - t0
        if n != self.expert_bytes:
            raise StoreError(
                f"{self.path / meta['file']}: short read of expert {expert} of MoE layer {meta['layer']} "
                f"({n} of {self.expert_bytes} bytes): the file is truncated"
            )
        if self.verify == "always" or (self.verify == "first" and not self._verified[layer][expert]):
            crc = 0
            for d in dests:
                crc = zlib.crc32(d, crc)
            if crc != meta["crc32"][expert]:
                raise StoreError(
                    f"{self.path / meta['file']}: checksum mismatch for expert {expert} of MoE layer {meta['layer']} "
                    f"(index {meta['crc32'][expert]:#010x}, read {crc:#010x}): the store is corrupt; rebuild it"
                )
            self._verified[layer][expert] = True
        return dt

    def submit_many(self, layer: int, reads, prefetch: bool = False) -> list:
        """Queue reads of one layer on the reader threads, `reads` = [(expert, dests), ...]; each
        read's future yields its read seconds. At most `readers` hand-offs (each wakes a thread),
        not one per read: each takes every readers-th read, in order, so the first named are read
        first."""
        futures = [Future() for _ in reads]
        pool = self._prefetch_pool if prefetch else self._pool
        n = min(self.readers, len(reads))
        for g in range(n):
            part = list(zip(reads[g::n], futures[g::n]))
            pool.submit(self._read_part, layer, part).add_done_callback(partial(_cancel_unread, part))
        return futures

    def _read_part(self, layer: int, part):
        for (expert, dests), fut in part:
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while it waited: a wasted prefetch dropped at its drain
            try:
                fut.set_result(self.read_into(layer, expert, dests))
            except BaseException as e:
                fut.set_exception(e)

    def empty_block(self, n: int) -> np.ndarray:
        """`n` record rows on page boundaries, for a batch of reads (copy mode)."""
        return aligned_empty(n * self.record_bytes).reshape(n, self.record_bytes)

    def read_block(self, layer: int, experts):
        """Read several experts of a layer into the rows of one block (each row on a page
        boundary); returns (block of shape (n, row bytes >= expert_bytes), [pread seconds])."""
        experts = list(experts)
        block = self.empty_block(len(experts))
        futures = self.submit_many(layer, [(e, [block[i, : self.expert_bytes]]) for i, e in enumerate(experts)])
        return block, [f.result() for f in futures]

    def read_batch(self, layer: int, experts):
        """`read_block` as NumPy views: ({expert: [tensor views]}, [pread seconds])."""
        experts = list(experts)
        block, seconds = self.read_block(layer, experts)
        return {e: self.views(row) for e, row in zip(experts, block)}, seconds

    def verify_all(self, layers=None):
        """Check every expert's checksum; raises StoreError naming the first bad one."""
        saved = self.verify
        self.verify = "always"
        try:
            rec = self.empty_record()
            for li in range(self.num_layers) if layers is None else layers:
                for e in range(self.num_experts(li)):
                    self.read_into(li, e, [rec])
        finally:
            self.verify = saved

    def close(self):
        for name in ("_pool", "_prefetch_pool"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                setattr(self, name, None)
        for fd in getattr(self, "_fds", []):
            os.close(fd)
        self._fds = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
