"""FlashNeuron (Bae et al., FAST'21): what chosen layers save for backward goes straight from the device to an NVMe
SSD, optionally compressed, and comes back for backward; an offline scheduler picks the layers so the writes hide
under the forward's compute and the reads under the backward's (docs/formulas.md §14.3–14.5).

    CODECS               'raw' (lossless, 1×) and 'bf16' (lossy: round to nearest bfloat16, 2× on floating-point
                         storages; |x̃ − x| ≤ 2⁻⁸·|x| + 2⁻¹³⁴ per element)
    ActivationFiles      the SSD tier's chunk files (`disk.DiskTier`: atomic writes, quota, one clear error, the
                         directory removed on any failure) holding one file per offloaded storage
    FlashNeuronOffload   saved-tensor hooks on the chosen blocks: each storage encoded and written once, read back and
                         decoded when backward asks; gradients bitwise those of a run whose saved tensors went through
                         the same codec in memory
    flashneuron_bytes    bytes written (= read) per step, the formula the tier's log must equal
    select_offload       the offline selection from measured per-block compute and measured disk bandwidth
    storage_paths        GPUDirect Storage vs the bounce through host memory, as data (copies, CPU, bandwidth)

Checked against (A_layer = `model.block_activation_bytes`, T² of it the bool causal mask, n offloaded blocks):

    written per step = read per step = n·(r·(A_layer − T²) + T²)     r = 1 ('raw'), ½ ('bf16')
"""
from __future__ import annotations

import errno
import os
import shutil
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...core.costmodel import Link, Stage, get_link, pipelined_time
from ...core.model import block_activation_bytes, blocks_of, get_config
from ...memory import alloc_category, fmt_bytes, placed, saved_tensors_hooks_over
from ...transports.paths import Move
from .disk import DiskTier, OffloadDiskError
from .swaps import transfer_log

CODECS = {"raw": 1.0, "bf16": 0.5}                 # bytes written per byte of a floating-point storage
BF16_REL, BF16_ABS = 2.0 ** -8, 2.0 ** -134        # round to nearest bfloat16: half an ulp of 8 significant bits


def bf16_error_ok(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether y is within the bf16 codec's bound of x, element by element."""
    return bool(((y.double() - x.double()).abs() <= BF16_REL * x.double().abs() + BF16_ABS).all())


def _encode(raw: torch.Tensor, dtype: torch.dtype, codec: str) -> torch.Tensor:
    """A storage's bytes (uint8) → what goes to the file."""
    if codec == "bf16" and dtype == torch.float32:
        return raw.view(torch.float32).to(torch.bfloat16).view(torch.uint8)
    return raw


def _decode(data: torch.Tensor, dtype: torch.dtype, codec: str) -> torch.Tensor:
    if codec == "bf16" and dtype == torch.float32:
        return data.view(torch.bfloat16).to(torch.float32).view(torch.uint8)
    return data


class ActivationFiles(DiskTier):
    """One file per offloaded storage, written and read through the SSD tier's own chunk I/O (`DiskTier`: each
    write atomic, the quota checked before it, ENOSPC and a missing or read-only directory turned into one
    `OffloadDiskError` line; the directory removed on close). A file is deleted once its storage has come back."""

    def __init__(self, *, directory=None, quota: int | None = None, planned_bytes: int = 0, log=None,
                 durable: bool = False, fault=None):
        self.dtype = torch.uint8
        self.durable = durable
        self.quota = quota
        self.fault = fault
        self.log = transfer_log() if log is None else log
        self.chunk_nbytes: dict = {}
        self.planned_bytes = planned_bytes
        self.root = self._make_dir(directory)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._trackers = ()
        self._pool = None
        self._on_disk = 0
        self._counted = False
        self._next = 0

    @property
    def file_bytes(self) -> int:
        """What the tier needs on disk, for DiskTier's messages: the plan, or at least what is there plus the file
        being written."""
        return max(self.planned_bytes, self._on_disk + (self.chunk_nbytes.get(self._next - 1, 0) if self._next else 0))

    def put(self, data: torch.Tensor) -> int:
        """Write `data` (uint8) to a new file; its number. On any failure the whole directory goes."""
        c, self._next = self._next, self._next + 1
        self.chunk_nbytes[c] = data.numel()
        try:
            if not os.access(self.root, os.W_OK):
                raise OffloadDiskError(f"offload directory {self.root} is not writable: pass offload_dir= a "
                                       f"writable directory on a local disk")
            self.write_chunk(c, data)
        except BaseException:
            self.close()
            raise
        self._on_disk += data.numel()
        return c

    def take(self, c: int) -> torch.Tensor:
        """Read file c back (into host memory: on this box the bounce path) and delete it."""
        try:
            buf = self._read(c)
        except BaseException:
            self.close()
            raise
        os.unlink(self.path(c))
        self._on_disk -= self.chunk_nbytes.pop(c)
        return buf

    @property
    def files(self) -> list:
        return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []


class _Saved:
    __slots__ = ("owner", "chunk", "dtype", "nbytes", "device", "holders")

    def __init__(self, owner, chunk, dtype, nbytes):
        self.owner = owner
        self.chunk = chunk
        self.dtype = dtype
        self.nbytes = nbytes
        self.device = None
        self.holders = 0


class _Note:
    """What autograd keeps instead of an offloaded tensor."""
    __slots__ = ("saved", "dtype", "size", "stride", "offset")

    def __init__(self, saved, t):
        self.saved = saved
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        saved.holders += 1

    def __del__(self):
        s = self.saved
        s.holders -= 1
        if not s.holders:
            s.device = None
            s.owner._forget(s)


class FlashNeuronOffload:
    """Saved-tensor hooks on `layers` (a list of block indices of `model`): each storage a chosen block saves is
    encoded with `codec`, written to `ActivationFiles` once (however often it is saved) and dropped from the
    device; when backward first asks for it, it is read, decoded and copied to the device. Parameters and buffers
    stay. Transfers are synchronous here; their time on a real
    device is the modeled schedule of `select_offload`."""

    def __init__(self, model: nn.Module, layers, *, codec: str = "raw", directory=None, quota=None, log=None,
                 fault=None, durable: bool = False):
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
        blocks = blocks_of(model)
        self.model = model
        self.codec = codec
        self.layers = sorted(set(layers))
        self.log = transfer_log() if log is None else log
        self.files = ActivationFiles(directory=directory, quota=quota, log=self.log, fault=fault, durable=durable)
        self._keep = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self._stashed: dict = {}                        # storage key -> (weakref to the storage, _Saved)
        self.errors: list = []                          # (max |x̃ − x|, stored) of the lossy codec, per storage
        self._handles = []
        for i in self.layers:
            blk = blocks[i]
            self._handles += [blk.register_forward_pre_hook(lambda m, a: self._enter(a)),
                              blk.register_forward_hook(lambda m, a, o: self._exit(), always_call=True)]
        self._hooks = None

    def _enter(self, args):
        self._hooks = saved_tensors_hooks_over(self.pack, self.unpack)
        self._hooks.__enter__()

    def _exit(self):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if t.layout != torch.strided or not storage.nbytes() or key in self._keep:
            return t
        hit = self._stashed.get(key)
        if hit is None or hit[0]() is not storage:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            with placed("host"), alloc_category("activations"):
                data = _encode(raw, t.dtype, self.codec).clone()
            if self.codec == "bf16" and t.dtype == torch.float32:
                back = _decode(data, t.dtype, self.codec).view(torch.float32)
                self.errors.append(bf16_error_ok(raw.view(torch.float32), back))
            hit = (weakref.ref(storage), _Saved(self, self.files.put(data), t.dtype, storage.nbytes()))
            self._stashed[key] = hit
        return _Note(hit[1], t)

    def unpack(self, x):
        if not isinstance(x, _Note):
            return x
        s = x.saved
        if s.device is None:
            data = self.files.take(s.chunk)
            with placed("device"), alloc_category("activations"):
                s.device = _decode(data, s.dtype, self.codec).clone().untyped_storage()
        return torch.empty(0, dtype=x.dtype).set_(s.device, x.offset, x.size, x.stride)

    def _forget(self, s) -> None:
        for k, (_ref, v) in list(self._stashed.items()):
            if v is s:
                del self._stashed[k]

    def close(self) -> None:
        """Take the hooks off and remove the directory."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RoundedInMemory:
    """The lossy codec's reference: the same blocks' saved float32 tensors rounded through bfloat16 in memory, no
    files — the gradients of `FlashNeuronOffload(codec='bf16')` must equal these bit for bit (the files add no
    error; the codec's is bounded element by element)."""

    def __init__(self, model: nn.Module, layers):
        blocks = blocks_of(model)
        keep = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}

        def pack(t):
            if t.dtype != torch.float32 or t.untyped_storage()._cdata in keep:
                return t
            return t.to(torch.bfloat16).to(torch.float32)

        def enter(m, a):
            self._hooks = saved_tensors_hooks_over(pack, lambda t: t)
            self._hooks.__enter__()

        def leave(m, a, o):
            self._hooks.__exit__(None, None, None)

        self.handles = [h for i in sorted(set(layers)) for h in (blocks[i].register_forward_pre_hook(enter),
                                                                 blocks[i].register_forward_hook(leave))]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def flashneuron_bytes(cfg, batch_size: int, n_blocks: int, codec: str = "raw", seq_len: int | None = None) -> int:
    """Bytes written (and read) per step offloading `n_blocks` blocks (the module docstring's formula; fp32)."""
    c = get_config(cfg)
    T = seq_len or c.seq_len
    layer = block_activation_bytes(c, batch_size, T)
    return int(n_blocks * (CODECS[codec] * (layer - T * T) + T * T))


@dataclass
class Selection:
    """An offline plan: the blocks to offload, and its modeled disk schedule."""
    layers: list
    kept_bytes: int          # activation bytes the device keeps (blocks not offloaded)
    write_exposed: float     # seconds the forward would wait for writes (0: hidden)
    read_exposed: float      # seconds the backward would wait for reads (0: hidden)
    fits: bool


def select_offload(block_bytes, forward_s, backward_s, *, write_bw: float, read_bw: float, room: float,
                   ratio: float = 1.0) -> Selection:
    """FlashNeuron's offline scheduler: offload blocks in forward order (the first ones come back last, so their reads
    have the most backward to hide under) until the kept activations fit in `room` bytes — the choice is by bytes
    alone. Then price it on the measured times and disk: block i's write (ratio·a_i/write_bw) queues from the end of
    its forward and must end by the end of the forward pass; reads go in reverse order from the start of backward,
    block i's before its backward; what does not hide is `write_exposed` / `read_exposed`."""
    n = len(block_bytes)
    chosen, kept = [], sum(block_bytes)
    for i in range(n):
        if kept <= room:
            break
        chosen.append(i)
        kept -= block_bytes[i]

    def exposure(layers):
        t, free = 0.0, 0.0
        for i in range(n):
            t += forward_s[i]
            if i in layers:
                free = max(free, t) + ratio * block_bytes[i] / write_bw
        w = max(0.0, free - t)
        t, free, r = 0.0, 0.0, 0.0
        for i in reversed(range(n)):
            if i in layers:
                free = free + ratio * block_bytes[i] / read_bw
                r = max(r, free - t)
            t += backward_s[i]
        return w, r

    w, r = exposure(chosen)
    return Selection(chosen, kept, w, r, kept <= room)


# ---------------------------------------------------------------------------------------------- GDS vs bounce
def storage_paths() -> dict:
    """Device → SSD, as data in notebook 01's style (`transports.paths.Move`): every copy and DMA, by engine.

        bounce (buffered write)   GPU copy engine → host buffer; CPU copies it into the page cache; NVMe DMA
        bounce (O_DIRECT)         GPU copy engine → host buffer; NVMe DMA from it
        GPUDirect Storage         NVMe DMA reads device memory over PCIe (peer to peer): 0 host copies
    """
    return {
        "bounce (buffered)": (Move(("w", "gpu"), ("w", "host"), "GPU copy engine", True),
                              Move(("w", "host"), ("w", "kernel"), "CPU (kernel)", True),
                              Move(("w", "kernel"), ("w", "ssd"), "NVMe DMA", False)),
        "bounce (O_DIRECT)": (Move(("w", "gpu"), ("w", "host"), "GPU copy engine", True),
                              Move(("w", "host"), ("w", "ssd"), "NVMe DMA", False)),
        "GPUDirect Storage": (Move(("w", "gpu"), ("w", "ssd"), "NVMe DMA", False),),
    }


def storage_path_costs(nbytes: float, *, disk_bw: float, host_copy_bw: float, pcie: Link | str = "PCIe Gen4 x16",
                       chunks: int = 16) -> dict:
    """Per path (modeled): host copies, whether the CPU touches the data, host-memory bytes moved (S for each end
    of a move in host memory or the page cache: 4S buffered, 2S with O_DIRECT, 0 with GDS; docs/formulas.md §14.5),
    CPU seconds (its copies at `host_copy_bw`) and the pipelined time of its stages (`costmodel.pipelined_time`,
    `chunks` chunks)."""
    pcie = get_link(pcie)
    disk = Link("NVMe (measured)", 0.0, disk_bw, kind="measured")
    cpu = Link("CPU memcpy (measured)", 0.0, host_copy_bw, kind="measured")
    out = {}
    for name, moves in storage_paths().items():
        stages, host_bytes, cpu_s = [], 0.0, 0.0
        for m in moves:
            if m.engine == "GPU copy engine":
                stages.append(Stage("d2h", pcie, "staging"))
            elif m.engine == "CPU (kernel)":
                stages.append(Stage("page cache copy", cpu, "cpu"))
                cpu_s += nbytes / host_copy_bw
            else:
                stages.append(Stage("NVMe", disk, "disk"))
            host_bytes += nbytes * sum(end[1] in ("host", "kernel") for end in (m.src, m.dst))
        out[name] = {"copies": sum(m.copy for m in moves), "cpu_on_data_path": any(m.engine == "CPU (kernel)"
                                                                                    for m in moves),
                     "host_memory_bytes": host_bytes, "cpu_seconds": cpu_s,
                     "seconds": pipelined_time(stages, nbytes, chunks)}
    return out


def disk_full_error(nbytes: int) -> OSError:
    """The OSError a full disk raises, for `fault=` in tests and the notebook."""
    return OSError(errno.ENOSPC, f"No space left on device (writing {fmt_bytes(nbytes)})")


__all__ = ["CODECS", "BF16_REL", "BF16_ABS", "bf16_error_ok", "ActivationFiles", "FlashNeuronOffload",
           "RoundedInMemory", "flashneuron_bytes", "Selection", "select_offload", "storage_paths", "storage_path_costs",
           "disk_full_error"]
