"""Offload: keep less on the accelerator by moving training state over the host link, and count what it costs.

    ActivationOffload   vDNN (Rhu et al., MICRO 2016, arXiv 1602.08124): every activation a layer saves for backward
                        is copied to host memory as autograd saves it, and brought back in backward, the next layer's
                        tensors prefetched on a background thread while this layer's backward runs
    OffloadAdam         ZeRO-Offload (Ren et al., USENIX ATC'21, arXiv 2101.06840): low-precision parameters on the
                        device; fp32 master weights, Adam's m and v and the Adam step on the CPU; gradients go down
                        during backward, updated parameters come up after the step; optionally the one-step delayed
                        parameter update (DPU), which overlaps the CPU step with the next forward and backward
    DiskTier            ZeRO-Infinity's SSD tier (Rajbhandari et al., SC'21, arXiv 2104.07857): OffloadAdam's
                        optimizer state in real files, read and written chunk by chunk each step, the next chunk's
                        read overlapped on a thread pool; files replaced atomically and removed at the end
    apply_offload       all of it for `train.run`, composed with ZeRO-2 over the mesh's dp axis (each rank offloads
                        only its shard; `course_lib.parallel.compose.apply_zero`)

On a CPU box the "device" is the simulated accelerator (`memory.SimulatedAccelerator`: only bytes placed on the
device count against its capacity), "host" is memory labelled `placed("host")` and "disk" real files. Every transfer
is a real copy, booked in a transfer log (a `dist.comm.Ledger` whose group is "pcie" or "disk": d2h and writes are
"sent", h2d and reads "received"). The PCIe link's *time* is the α–β model (`costmodel.PRESETS`, labelled modeled);
disk time is measured. Checked against (docs/formulas.md §6):

    activations on the device, offloaded    A_emb + A_layer + max(A_head, A_layer)   the layers in flight: the one
                                            whose backward runs and the one arriving (§6.4)
    ZeRO-Offload model states on the device 2Ψ  (bf16 parameters; each gradient leaves as autograd produces it)
    ZeRO-Offload link bytes per step        2Ψ down (bf16 gradients) + 2Ψ up (bf16 parameters) (§6.1)
    SSD tier bytes per step                 12Ψ read + 12Ψ written  (fp32 master, m, v) (§6.6)
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import weakref
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..costmodel import Link, get_link
from ..dist.comm import Event, Ledger
from ..memory import (active_trackers, alloc_category, carry_tracking, fmt_bytes, now, placed,
                      saved_tensors_hooks_over)
from ..optim import adamw_  # noqa: F401  (the one AdamW step; re-exported: notebook 07 shows it here)

DEFAULT_LINK = "PCIe Gen4 x16"


# ============================================================================================ the transfer log
def transfer_log(rank: int = 0) -> Ledger:
    """A ledger for one device's link to its host (and its host's disk): d2h and disk writes are booked as sent,
    h2d and disk reads as received, compute spans as 'compute' events — so bytes are read like the traffic ledger's
    (`log.bytes_sent(op="d2h")`) and everything shares `memory.now`."""
    return Ledger(rank, 1)


def _book(log: Ledger, kind: str, op: str, tag: str, t0: float, nbytes: int = 0, group: str = "pcie") -> None:
    log.record(Event(kind, op, tag, t0, now(), nbytes if kind == "send" else 0, nbytes if kind == "recv" else 0,
                     None, group))


def _bytes_view(storage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no new storage: the memory accountant sees nothing allocated)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _copy_storage(storage, placement: str, category: str) -> torch.Tensor:
    """A copy of a whole storage, allocated at `placement` under `category`: the one real copy a transfer makes."""
    with placed(placement), alloc_category(category):
        out = torch.empty(storage.nbytes(), dtype=torch.uint8)
    return out.copy_(_bytes_view(storage))


# ============================================================================================ 1. activations (vDNN)
class _Stash:
    """One storage moved off the device: its host copy, and its device copy while backward needs it back."""
    __slots__ = ("group", "nbytes", "host", "device", "original", "handles", "hold")

    def __init__(self, group, storage):
        self.group, self.nbytes = group, storage.nbytes()
        self.original = weakref.ref(storage)     # to tell this storage from a later one at a reused address
        self.host = None
        self.device = None
        self.handles = 0
        self.hold = None                         # the device original, while a modeled d2h is still running


class _Packed:
    """What autograd keeps instead of an offloaded tensor: where its storage went and how to view it again."""
    __slots__ = ("owner", "stash", "dtype", "size", "stride", "offset")

    def __init__(self, owner, stash, t: torch.Tensor):
        self.owner, self.stash = owner, stash
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def __del__(self):                  # autograd let go: after this tensor's backward, or when the graph is dropped
        self.owner.release(self.stash)


class StorageSwap:
    """Storages out to the host and back, one copy each, for a pair of saved-tensor hooks.

    Autograd saves *tensors*, often several views of one storage (q, k and v share nothing, but a transposed k
    and k do) and the same tensor for several ops (ln1's output feeds wq, wk and wv). What occupies memory is the
    storage, so a storage is copied once, however many times it is saved, and each saved tensor becomes a note
    (`_Packed`: dtype, size, stride, offset) over the copy. A storage is known by its address only while it lives:
    once the original is freed its address can be reused, so a note is matched by a weak reference to the storage
    itself, not by the address. When autograd lets go of the last note, both copies go.
    """

    def __init__(self, log: Ledger, on_release=None):
        self.log = log
        self.on_release = on_release
        self._lock = threading.RLock()
        self._stashes: dict[int, _Stash] = {}     # storage key -> stash of the storage living there now

    def stash(self, t: torch.Tensor, group, tag: str) -> "tuple[_Stash, bool]":
        """The stash of t's storage, copied to the host (booked as a d2h) if this is its first save; and whether it
        was new."""
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            s = self._stashes.get(key)
            if s is not None and s.original() is storage:
                return s, False
            s = _Stash(group, storage)
            t0 = now()
            s.host = _copy_storage(storage, "host", "activations")
            _book(self.log, "send", "d2h", tag, t0, s.nbytes)
            self._stashes[key] = s
            return s, True

    def packed(self, s: _Stash, t: torch.Tensor) -> _Packed:
        with self._lock:
            s.handles += 1
        return _Packed(self, s, t)

    @staticmethod
    def allocate(stashes) -> list:
        """Device buffers for `stashes` (allocated by the caller's thread, so the peak does not depend on when a
        copy thread runs)."""
        with placed("device"), alloc_category("activations"):
            buffers = [torch.empty(s.nbytes, dtype=torch.uint8) for s in stashes]
        for s, b in zip(stashes, buffers):
            s.device = b.untyped_storage()
        return buffers

    def copy_in(self, stashes, buffers, tag: str, t0: float) -> None:
        """The h2d copies into buffers from `allocate` (any thread), booked as one transfer issued at t0. The list
        is emptied, so a thread pool holding this call's arguments a little longer holds no device memory."""
        for s, b in zip(stashes, buffers):
            b.copy_(s.host)
        buffers.clear()
        _book(self.log, "recv", "h2d", tag, t0, sum(s.nbytes for s in stashes))

    @staticmethod
    def view(p: _Packed) -> torch.Tensor:
        """The saved tensor again, over the device copy of its storage."""
        return torch.empty(0, dtype=p.dtype).set_(p.stash.device, p.offset, p.size, p.stride)

    def release(self, s: _Stash) -> None:
        with self._lock:
            s.handles -= 1
            if s.handles:
                return
            s.host = s.device = s.hold = None    # nothing in the graph refers to it any more: both copies go
            for k, v in list(self._stashes.items()):
                if v is s:
                    del self._stashes[k]
        if self.on_release is not None:
            self.on_release(s)


@dataclass
class OffloadPass:
    """What one forward + backward did, for the modeled link schedule (times on `memory.now`)."""
    layer_bytes: dict = field(default_factory=dict)      # layer -> bytes of the unique storages it offloaded
    offloads: list = field(default_factory=list)          # (t issued, layer, bytes) one per storage, d2h
    fetches: dict = field(default_factory=dict)           # layer -> (t issued, bytes), h2d
    needed: dict = field(default_factory=dict)            # layer -> t its backward first asked for a tensor
    forward: dict = field(default_factory=dict)           # layer -> (t0, t1) of its forward
    backward: dict = field(default_factory=dict)          # layer -> (t0, t1) of its backward
    saves: int = 0                                        # pack calls on offloaded tensors (several per storage)


class ActivationOffload(nn.Module):
    """vDNN for any model whose layers run one after another (`layers`: the GPT's blocks by default).

        forward   layer i saves a tensor → pack: copy its storage to the host once (however many ops save it),
                  keep a note for autograd; the device copy dies with the forward's last reference to it
        backward  layer i's first tensor is asked for → unpack: its layer is on the device already (prefetched)
                  or is fetched now; then the prefetch of layer i − 1 starts on a background thread (the top layer's
                  starts when backward begins, in the head)

    Tensors saved outside the layers (the head's, the embedding's), parameters and buffers stay where they are. So
    the activations on the device peak at A_emb + A_layer + max(A_head, A_layer): the layers in flight are the one
    computing and the one arriving (`offloaded_activation_peak`, docs/formulas.md §6.4). Gradients are bitwise
    those without offload: only copies move. One forward and its backward at a time.
    """

    def __init__(self, model: nn.Module, layers=None, *, prefetch: bool = True, log: Ledger | None = None):
        super().__init__()
        self.module = model
        layers = list(model.blocks if layers is None else layers)
        if not layers:
            raise ValueError("ActivationOffload needs at least one layer to offload (pass layers=[...])")
        self.layers = layers                      # plain list: the modules stay registered under self.module only
        self.prefetch = prefetch
        self.log = transfer_log() if log is None else log
        self.swap = StorageSwap(self.log, on_release=self._forget)
        self.last_pass = OffloadPass()
        self._layer = None                        # the layer whose forward is running
        self._by_layer: dict[int, list] = defaultdict(list)
        self._inflight: dict[int, object] = {}    # layer -> its prefetch (a Future), until its backward asks
        self._arrived: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._keep: set[int] = set()
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda mod, args, i=i: self._enter(i, args))
            layer.register_forward_hook(lambda mod, args, out, i=i: self._exit(i, out))

    # ---------------------------------------------------------------- forward: which layer runs, its spans
    def _enter(self, i: int, args) -> None:
        self._layer = i
        self.last_pass.forward[i] = (now(), None)
        x = args[0] if args and torch.is_tensor(args[0]) else None
        if x is not None and x.requires_grad:        # its gradient is complete when layer i's backward has ended
            x.register_hook(lambda g, i=i: self._backward_span(i, end=True))

    def _exit(self, i: int, out) -> None:
        self._layer = None
        self.last_pass.forward[i] = (self.last_pass.forward[i][0], now())
        _book(self.log, "compute", "forward", f"layer {i}", self.last_pass.forward[i][0], group="compute")
        if torch.is_tensor(out) and out.requires_grad:   # its gradient is complete when layer i's backward starts
            out.register_hook(lambda g, i=i: self._backward_span(i, end=False))

    def _backward_span(self, i: int, end: bool) -> None:
        t = now()
        if not end:
            self.last_pass.backward[i] = (t, None)
        elif i in self.last_pass.backward:
            t0 = self.last_pass.backward[i][0]
            self.last_pass.backward[i] = (t0, t)
            _book(self.log, "compute", "backward", f"layer {i}", t0, group="compute")

    def forward(self, *args, **kwargs):
        self.last_pass = OffloadPass()
        self._arrived.clear()
        self._inflight.clear()
        # what never leaves: the parameters and buffers (autograd saves weights too; they are on the device anyway)
        self._keep = {t.untyped_storage()._cdata for t in [*self.module.parameters(), *self.module.buffers()]}
        with saved_tensors_hooks_over(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    # ---------------------------------------------------------------- the hook pair
    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if self._layer is None or t.layout != torch.strided or not storage.nbytes() or storage._cdata in self._keep:
            return t
        s, new = self.swap.stash(t, self._layer, f"layer {self._layer}")
        if new:
            self._by_layer[self._layer].append(s)
            p = self.last_pass
            p.offloads.append((now(), self._layer, s.nbytes))
            p.layer_bytes[self._layer] = p.layer_bytes.get(self._layer, 0) + s.nbytes
        self.last_pass.saves += 1
        return self.swap.packed(s, t)

    def _unpack(self, x):
        layer = x.stash.group if isinstance(x, _Packed) else None
        if layer is not None and layer not in self._arrived:
            self.last_pass.needed.setdefault(layer, now())
            self._arrive(layer)
        if self.prefetch:   # the layer whose backward comes next: below this one, or the top one once backward begins
            nxt = layer - 1 if layer is not None else max(self._by_layer, default=-1)
            if nxt >= 0 and nxt not in self._arrived and nxt not in self._inflight and self._by_layer.get(nxt):
                self._issue(nxt, background=True)
        return self.swap.view(x) if isinstance(x, _Packed) else x

    # ---------------------------------------------------------------- fetching back
    def _issue(self, layer: int, background: bool) -> None:
        """Start bringing `layer` back: its device buffers are allocated now, here; the copies run on the
        background thread if `background`."""
        stashes = [s for s in self._by_layer[layer] if s.device is None]
        buffers = self.swap.allocate(stashes)
        t0 = now()
        self.last_pass.fetches[layer] = (t0, sum(s.nbytes for s in stashes))
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch")
            self._inflight[layer] = self._pool.submit(carry_tracking(self.swap.copy_in), stashes, buffers,
                                                      f"layer {layer}", t0)
        else:
            self.swap.copy_in(stashes, buffers, f"layer {layer}", t0)
            self._arrived.add(layer)

    def _arrive(self, layer: int) -> None:
        fut = self._inflight.pop(layer, None)
        if fut is None:                          # nobody prefetched it (prefetch=False): fetch it now
            self._issue(layer, background=False)
        else:
            fut.result()
        self._arrived.add(layer)

    def _forget(self, s: _Stash) -> None:
        ours = self._by_layer.get(s.group)
        if ours is not None and s in ours:
            ours.remove(s)
            if not ours:
                del self._by_layer[s.group]

    def close(self) -> None:
        """Stop the prefetch thread (train_parallel and the notebooks call this when done)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---------------------------------------------------------------- the modeled link
    def modeled_schedule(self, link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0) -> "LinkSchedule":
        """The last forward + backward on a modeled link (see `LinkSchedule`)."""
        return link_schedule(self.last_pass, get_link(link), speedup=speedup)


@dataclass
class LinkSchedule:
    """Measured compute spans and modeled transfers of one offloaded forward + backward, on one time axis.

    Rules (vDNN's): layer i's offload starts when autograd saves each tensor and must be done by the end of layer
    i + 1's forward (so only the layers in flight wait on the device); layer i's prefetch starts when it is issued
    (when the backward of layer i + 1 starts) and must be done when layer i's backward first asks. Each direction of
    the link carries one transfer at a time (α + S·β each). A transfer late for its deadline stalls the compute, and
    every later time shifts by the stall. `speedup` models a device that computes that many times faster than this
    CPU (compute spans are divided by it; the link is not).
    """
    compute: list           # (t0, t1, label) seconds from the start of the forward, after stalls
    transfers: list         # (lane 'd2h' | 'h2d', t0, t1, bytes, layer) modeled
    exposed: float          # seconds the compute waited for the link
    compute_seconds: float  # measured compute (÷ speedup)
    link_seconds: dict      # lane -> modeled seconds busy
    link: Link
    start: float = 0.0      # memory.now of the forward's start: time 0 of this schedule

    @property
    def hidden(self) -> bool:
        return self.exposed == 0.0


def link_schedule(p: OffloadPass, link: Link, *, speedup: float = 1.0) -> LinkSchedule:
    """Replay one pass on a modeled link (the rules are `LinkSchedule`'s)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup!r}")
    if not p.forward or not p.offloads:
        raise ValueError("nothing was offloaded in this pass: run a forward and backward through ActivationOffload")
    start = min(t0 for t0, _ in p.forward.values())
    scale = lambda t: (t - start) / speedup                     # noqa: E731  (measured time -> modeled device time)
    layers = sorted(p.forward)
    fwd_end = {i: scale(p.forward[i][1]) for i in layers}
    offload_due = {i: fwd_end[layers[min(k + 1, len(layers) - 1)]] for k, i in enumerate(layers)}
    events = []                                                 # (time, order, kind, payload)
    for t0, layer, n in p.offloads:
        events.append((scale(t0), 0, "issue", ("d2h", layer, n)))
    for layer, (t0, n) in p.fetches.items():
        events.append((scale(t0), 0, "issue", ("h2d", layer, n)))
    for layer, t in offload_due.items():
        events.append((t, 1, "due", ("d2h", layer)))
    for layer, t in p.needed.items():
        events.append((scale(t), 1, "due", ("h2d", layer)))
    events.sort(key=lambda e: (e[0], e[1]))
    delay, free = 0.0, {"d2h": 0.0, "h2d": 0.0}
    done: dict = {}
    transfers, stalls = [], []                                  # stalls: (measured time, added delay)
    for t, _, kind, payload in events:
        if kind == "issue":
            lane, layer, n = payload
            t0 = max(t + delay, free[lane])
            t1 = t0 + link.time(n)
            free[lane] = t1
            done[(lane, layer)] = max(done.get((lane, layer), 0.0), t1)
            transfers.append((lane, t0, t1, n, layer))
        else:
            lane, layer = payload
            late = done.get((lane, layer), 0.0) - (t + delay)
            if late > 0:
                delay += late
                stalls.append((t, late))

    def shifted(t):                                             # a measured compute time after the stalls before it
        return t + sum(d for ts, d in stalls if ts <= t)

    compute = [(shifted(scale(a)), shifted(scale(b)), f"fwd {i}") for i, (a, b) in p.forward.items() if b]
    compute += [(shifted(scale(a)), shifted(scale(b)), f"bwd {i}") for i, (a, b) in p.backward.items() if b]
    ends = [b for a, b in p.backward.values() if b] + [b for a, b in p.forward.values() if b]
    busy = {lane: sum(t1 - t0 for ln, t0, t1, _, _ in transfers if ln == lane) for lane in ("d2h", "h2d")}
    return LinkSchedule(sorted(compute), transfers, delay, scale(max(ends)), busy, link, start)


def offloaded_activation_peak(cfg, batch_size: int, seq_len: int | None = None, elem_bytes: int = 4) -> int:
    """Device bytes of activations at their peak with every block offloaded (`ActivationOffload`, GPT blocks):

        A_emb + A_layer + max(A_head, A_layer)   (n_layer ≥ 2; with one block: A_emb + A_head + A_layer)

    A_layer = `model.block_activation_bytes`; A_emb = 8·B·T + 8·T, the token ids and positions the embeddings save
    (freed only when backward ends); A_head = everything else the model saves (ln_f, log-softmax, targets), freed
    when the head's backward is done. Backward starts in the head with the top block arriving (A_head + A_layer),
    then each block computes while the one below arrives (2·A_layer) — docs/formulas.md §6.4."""
    from ..model import activation_bytes, block_activation_bytes, get_config
    c = get_config(cfg)
    T = seq_len or c.seq_len
    layer = block_activation_bytes(c, batch_size, T, elem_bytes)
    emb = 8 * batch_size * T + 8 * T
    head = activation_bytes(c, batch_size, T, elem_bytes) - c.n_layer * layer - emb
    return emb + layer + max(head, layer if c.n_layer >= 2 else 0)


def break_even_speedup(p: OffloadPass, link: "Link | str" = DEFAULT_LINK, *, hi: float = 1e7) -> float:
    """The smallest device speedup over this CPU (compute ÷ s, link unchanged) at which the modeled link stops
    hiding behind compute: below it every transfer is hidden (bisection on `link_schedule`)."""
    link = get_link(link)
    if link_schedule(p, link, speedup=hi).exposed == 0.0:
        return float("inf")
    lo = 1.0
    if link_schedule(p, link, speedup=lo).exposed > 0.0:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if link_schedule(p, link, speedup=mid).exposed == 0.0 else (lo, mid)
        if hi / lo < 1.001:
            break
    return hi


def save_on_cpu_traffic(model: nn.Module, batch) -> dict:
    """What `torch.autograd.graph.save_on_cpu` moves for one forward + backward of `model(*batch)`, counted by an
    inner hook that sees every tensor it is handed: it copies each saved *tensor* (numel × element size, a compact
    copy of a view), every time it is saved, parameters and norm weights included — on a GPU all of that crosses
    the link twice. Storages are told apart by identity, not address (a freed address is reused). Returns the
    counts and the gradients (on this CPU box save_on_cpu moves nothing: the tensors already are on the CPU)."""
    keep = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: list = []
    out = {"saves": 0, "bytes": 0, "parameter_bytes": 0, "parameter_saves": 0, "storages": 0, "storage_bytes": 0}

    def count(t):
        n = t.numel() * t.element_size()
        out["saves"] += 1
        out["bytes"] += n
        storage = t.untyped_storage()
        if storage._cdata in keep:
            out["parameter_bytes"] += n
            out["parameter_saves"] += 1
        elif not any(ref() is storage for ref in seen):
            seen.append(weakref.ref(storage))
            out["storages"] += 1
            out["storage_bytes"] += storage.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.save_on_cpu(), saved_tensors_hooks_over(count, lambda t: t):
        _, loss = model(*batch)
    loss.backward()
    out["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return out


# ============================================================================================ 2. ZeRO-Offload
TIERS = ("device", "host", "disk")


class OffloadAdam(torch.optim.Optimizer):
    """Mixed-precision AdamW whose fp32 state lives on `tier` (ZeRO-Offload: 'host'; ZeRO-Infinity: 'disk';
    'device' is the same recipe without offload, the baseline it must equal bit for bit).

        device (2Ψ)       parameters in their low precision (bf16); each gradient leaves for the host as autograd
                          accumulates it (a hook), so no full set of gradients ever sits on the device
        link (per step)   2Ψ down: the bf16 gradients · 2Ψ up: the updated parameters, cast to bf16 on the host
        host              bf16 gradients 2Ψ (4Ψ with DPU: two buffers) · fp32 master, m, v 12Ψ (tier 'host')
        disk              fp32 master, m, v 12Ψ in files, 12Ψ read and 12Ψ written per step (tier 'disk')

    The step is `adamw_` on the CPU. With `dpu=True` (after `dpu_warmup` ordinary steps) `step()` waits for the
    previous CPU step, uploads its parameters and starts this step's on a background thread, so the next forward and
    backward run on parameters one update old while the CPU works (Ren et al. 2021 §5.2). `flush()` finishes the last
    one. The master weights start from the low-precision parameters (as in mixed-precision recipes that cast the
    model first). Use as any optimizer with `train.run`; inside ZeRO-2 it is the inner optimizer of
    `ShardedOptimizer` and sees only this rank's shards (`apply_offload(model, mesh)`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, tier: str = "host", master_dtype: torch.dtype = torch.float32, dpu: bool = False,
                 dpu_warmup: int = 1, grads_in_backward: bool = True, log: Ledger | None = None,
                 offload_dir: str | None = None, chunk_bytes: int = 1 << 20, durable: bool = True,
                 disk_quota: int | None = None, fault=None):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} (where the fp32 optimizer state lives), got {tier!r}")
        if dpu and tier == "device":
            raise ValueError("dpu=True overlaps the CPU step with the next forward and backward: it needs "
                             "tier='host' or 'disk'")
        if not isinstance(dpu_warmup, int) or dpu_warmup < 1:
            raise ValueError(f"dpu_warmup must be an integer >= 1 (ordinary steps before the delayed ones), "
                             f"got {dpu_warmup!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.tier, self.master_dtype, self.dpu, self.dpu_warmup = tier, master_dtype, dpu, dpu_warmup
        self.log = transfer_log() if log is None else log
        self.steps_done = 0                      # CPU steps completed
        self.timings: list[dict] = []            # per step: seconds of the CPU step, of the upload, waited
        self._disk_options = dict(directory=offload_dir, chunk_bytes=chunk_bytes, durable=durable,
                                  quota=disk_quota, fault=fault)
        self.disk: DiskTier | None = None
        self._host_grads: dict = {}              # param -> [bf16 host buffer] (two with DPU)
        self._fresh: set = set()                 # params whose host gradient this step has not written yet
        self._slot = 0                           # which buffer backward writes (DPU alternates)
        self._pending = None                     # the background CPU step (DPU)
        self._pool: ThreadPoolExecutor | None = None
        self._hooks = []
        self._calls = 0
        params = self._params()
        self._fresh = set(params)
        if grads_in_backward and tier != "device":
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_down) for p in params if p.requires_grad]

    def _params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    # ---------------------------------------------------------------- gradients go down
    def _host_grad(self, p: torch.Tensor) -> torch.Tensor:
        bufs = self._host_grads.get(p)
        if bufs is None:
            with placed("host"), alloc_category("gradients"):
                bufs = self._host_grads[p] = [torch.empty_like(p) for _ in range(2 if self.dpu else 1)]
        return bufs[self._slot]

    def _grad_down(self, p: torch.Tensor) -> None:   # a hook: must return None
        g = p.grad
        for tracker in active_trackers():            # autograd allocated it as a temporary: it is a gradient
            tracker.track(g, "gradients")
        buf = self._host_grad(p)
        t0 = now()
        if p in self._fresh:
            buf.copy_(g)
            self._fresh.discard(p)
        else:                                        # gradient accumulation: the host sums the micro-batches
            buf.add_(g)
        _book(self.log, "send", "d2h", "gradients", t0, g.numel() * g.element_size())
        p.grad = None

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadAdam.step does not take a closure")
        if self.tier != "device":
            for p in self._params():                 # gradients still on the device (no hook, or a ZeRO shard)
                if p.grad is not None:
                    self._grad_down(p)
        self._calls += 1
        slot = self._slot
        stepped = [p for p in self._params() if (p.grad is not None if self.tier == "device" else
                                                  p not in self._fresh)]      # torch skips a parameter without grad
        self._fresh = set(self._params())
        if not self.dpu or self._calls <= self.dpu_warmup:
            waited = self.flush()
            timing = self._update(slot, stepped)
            timing["upload"] = self._upload(slot, stepped)
            timing["waited"] = waited
            self.timings.append(timing)
        else:
            waited = self.flush()                    # the previous step's parameters come up now
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-adam")
            self._pending = (self._pool.submit(carry_tracking(self._update), slot, stepped), slot, stepped, waited)
            self._slot = 1 - slot                    # the next backward writes the other gradient buffer

    def flush(self) -> float:
        """Wait for a delayed CPU step and bring its parameters up (DPU); returns seconds waited."""
        if self._pending is None:
            return 0.0
        fut, slot, stepped, before = self._pending
        self._pending = None
        t0 = now()
        timing = fut.result()
        waited = now() - t0
        timing["upload"] = self._upload(slot, stepped)
        timing["waited"] = before + waited
        self.timings.append(timing)
        return waited

    def _update(self, slot: int, stepped: list) -> dict:
        """The CPU step (any thread): Adam on the fp32 state, then the new parameters cast to the low precision,
        written into the gradient buffer the step has just consumed (no other host buffer needed)."""
        t0 = now()
        with torch.no_grad(), placed("device" if self.tier == "device" else "host"):
            if self.tier == "disk":
                self._disk_step(slot, stepped)
            else:
                todo = set(stepped)
                for group in self.param_groups:
                    for p in group["params"]:
                        if p not in todo:
                            continue
                        st = self._state(p)
                        grad = p.grad if self.tier == "device" else self._host_grads[p][slot]
                        st["step"] += 1
                        self._adam(group, st["master"], grad, st["exp_avg"], st["exp_avg_sq"], st["step"])
                        if self.tier == "device":
                            p.copy_(st["master"])
                        else:
                            grad.copy_(st["master"])         # the bf16 parameters to upload
        self.steps_done += 1
        return {"update": now() - t0}

    def _adam(self, group, master, grad, exp_avg, exp_avg_sq, step: int) -> None:
        beta1, beta2 = group["betas"]
        adamw_(master, grad.to(self.master_dtype), exp_avg, exp_avg_sq, step, lr=group["lr"],
               beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:       # created at the first step, at its tier, so the memory accountant counts it there
            with placed("device" if self.tier == "device" else "host"), alloc_category("optimizer"):
                st["master"] = p.detach().to(self.master_dtype, copy=True)
                st["exp_avg"] = torch.zeros_like(st["master"])
                st["exp_avg_sq"] = torch.zeros_like(st["master"])
            st["step"] = 0                # a Python int: AdamW's counter, not 4 more bytes of state per tensor
        return st

    @torch.no_grad()
    def _upload(self, slot: int, stepped: list) -> float:
        if self.tier == "device":
            return 0.0
        start = now()
        for p in stepped:
            t0 = now()
            p.copy_(self._host_grads[p][slot])
            _book(self.log, "recv", "h2d", "parameters", t0, p.numel() * p.element_size())
        return now() - start

    def _disk_step(self, slot: int, stepped: list) -> None:
        params = self._params()
        if len(stepped) != len(params):
            raise ValueError("tier='disk' steps every parameter every step: a parameter received no gradient")
        if self.disk is None:
            self.disk = DiskTier([p.numel() for p in params], log=self.log, dtype=self.master_dtype,
                                 **self._disk_options)
            self._disk_params = params
            self.disk.initialize([p.detach() for p in params])
        group = self.param_groups[0]
        if any(g is not group and {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} !=
               {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in self.param_groups):
            raise ValueError("tier='disk' supports one set of hyper-parameters for all parameter groups")

        def update(i, master, exp_avg, exp_avg_sq):
            p = self._disk_params[i]
            grad = self._host_grads[p][slot]
            self._adam(group, master, grad.view(-1), exp_avg, exp_avg_sq, self.steps_done + 1)
            grad.view(-1).copy_(master)
        self.disk.step(update)

    # ---------------------------------------------------------------- the rest of the optimizer interface
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None

    def host_bytes(self) -> dict:
        """Bytes this optimizer keeps off the device, by what they are: {'gradients', 'optimizer'} (host) and
        'disk' (files)."""
        grads = sum(b.numel() * b.element_size() for bufs in self._host_grads.values() for b in bufs)
        opt = sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                  if torch.is_tensor(v)) if self.tier == "host" else 0
        return {"gradients": grads, "optimizer": opt, "disk": self.disk.file_bytes if self.disk else 0}

    def close(self) -> None:
        """Finish a delayed step, stop the thread, remove the SSD tier's files."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self.disk is not None:
                self.disk.close()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()


# ============================================================================================ 3. the SSD tier
class OffloadDiskError(RuntimeError):
    """The SSD tier could not use its directory (not writable, full, or a file vanished)."""


class DiskTier:
    """Optimizer state (fp32 master, m, v) of a list of tensors in real files, one file per chunk of tensors.

    Chunks follow the course's bucketing rule (`dist.flat.bucket_params`, here in bytes of state: 12 per element).
    Each step reads every chunk, updates it and writes it back: chunk c + 1 is read on a thread pool while chunk c is
    updated, and chunk c is written while c + 1 is updated, so at most three chunks are in host memory. A write goes
    to `chunk.tmp`, is flushed (fsync when `durable`) and renamed over the chunk (atomic on POSIX), and with
    `durable` its pages are dropped from the page cache, so the next read comes from the disk, not from RAM. Every
    read and write is booked in `log` (group 'disk': writes sent, reads received) with its measured time.

    The directory is a fresh temporary one inside `directory`; it is removed by `close()`, on any error, and at exit.
    Before writing anything the free space (or `quota`, a simulated size limit) must hold all chunks plus one
    rewrite; `fault(chunk, nbytes)`, called before every write, lets tests inject an OSError (a disk filling up).
    """

    def __init__(self, numels, *, directory: str | None = None, chunk_bytes: int = 1 << 20, log: Ledger | None = None,
                 dtype: torch.dtype = torch.float32, durable: bool = True, quota: int | None = None, fault=None):
        from ..dist.flat import FlatBuffer, bucket_params
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        numels = [int(n) for n in numels]
        if not numels or min(numels) <= 0:
            raise ValueError("DiskTier needs at least one tensor, each with at least one element")
        self.dtype, self.durable, self.quota, self.fault = dtype, durable, quota, fault
        self.log = transfer_log() if log is None else log
        elem = torch.tensor([], dtype=dtype).element_size()
        # chunks by the bucketing rule, on stand-ins of each tensor's size: 3 state values per element
        stand_ins = [torch.empty(1).expand(n) for n in numels]
        groups = bucket_params(stand_ins, max(1, chunk_bytes // 3))
        index = {id(t): i for i, t in enumerate(stand_ins)}
        self.chunks = [[index[id(t)] for t in g] for g in groups]           # tensor indices per chunk
        self.layouts = [FlatBuffer(shapes=[numels[i] for i in c], dtype=dtype) for c in self.chunks]
        self.chunk_nbytes = [3 * lay.padded * elem for lay in self.layouts]
        self.file_bytes = sum(self.chunk_nbytes)
        self.root = self._make_dir(directory)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._trackers = active_trackers()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="offload-disk")
        self._on_disk = 0
        self._counted = False
        try:
            need = self.file_bytes + max(self.chunk_nbytes)                 # all chunks + one atomic rewrite
            free = shutil.disk_usage(self.root).free
            room = free if quota is None else min(free, quota)
            if need > room:
                raise OffloadDiskError(
                    f"offload directory {self.root} has room for {fmt_bytes(room)}"
                    f"{' (quota)' if quota is not None and quota < free else ''}, but the SSD tier needs "
                    f"{fmt_bytes(need)} (optimizer state {fmt_bytes(self.file_bytes)} + one chunk being rewritten). "
                    f"Free space there, or pass offload_dir= a directory on a larger disk.")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make_dir(directory) -> str:
        base = tempfile.gettempdir() if directory is None else os.fspath(directory)
        try:
            return tempfile.mkdtemp(prefix="course-offload-", dir=base)
        except OSError as e:
            raise OffloadDiskError(f"cannot create the SSD tier's files in {base!r}: {e.strerror or e}. Pass "
                                   f"offload_dir= an existing, writable directory on a local disk.") from None

    def path(self, c: int) -> str:
        return os.path.join(self.root, f"chunk{c:04d}.bin")

    # ---------------------------------------------------------------- one chunk in and out
    def _read(self, c: int) -> torch.Tensor:
        with placed("host"), alloc_category("optimizer"):
            buf = torch.empty(self.chunk_nbytes[c] // torch.tensor([], dtype=self.dtype).element_size(),
                              dtype=self.dtype)
        t0 = now()
        try:
            with open(self.path(c), "rb", buffering=0) as f:
                got = f.readinto(memoryview(buf.numpy()).cast("B"))
        except OSError as e:
            raise OffloadDiskError(f"reading {self.path(c)} failed: {e.strerror or e}") from None
        if got != self.chunk_nbytes[c]:
            raise OffloadDiskError(f"{self.path(c)} holds {got} bytes, expected {self.chunk_nbytes[c]}: the file was "
                                   f"truncated or replaced while training")
        _book(self.log, "recv", "read", f"chunk {c}", t0, got, group="disk")
        return buf

    def _write(self, c: int, buf: torch.Tensor) -> None:
        final, tmp = self.path(c), self.path(c) + ".tmp"
        n = buf.numel() * buf.element_size()
        t0 = now()
        try:
            if self.quota is not None and self._on_disk + n > self.quota:
                raise OSError(errno.ENOSPC, "No space left on device (quota)")
            if self.fault is not None:
                self.fault(c, n)
            with open(tmp, "wb", buffering=0) as f:
                f.write(memoryview(buf.numpy()).cast("B"))
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, final)                   # atomic: a reader sees the old chunk or the new one, never half
            if self.durable and hasattr(os, "posix_fadvise"):
                fd = os.open(final, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # the next read comes from the disk
                finally:
                    os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OffloadDiskError(f"offload directory {self.root} is full: writing chunk {c} "
                                       f"({fmt_bytes(n)}) failed ({e.strerror}). The SSD tier needs "
                                       f"{fmt_bytes(self.file_bytes)} there; free space or pass offload_dir= a "
                                       f"larger disk.") from None
            raise OffloadDiskError(f"writing {final} failed: {e.strerror or e}") from None
        _book(self.log, "send", "write", f"chunk {c}", t0, n, group="disk")

    # ---------------------------------------------------------------- the state, chunk by chunk
    def initialize(self, tensors) -> None:
        """Write the first state: master = the tensors (cast to dtype), m = v = 0."""
        tensors = list(tensors)
        try:
            for c, idx in enumerate(self.chunks):
                with placed("host"), alloc_category("optimizer"):
                    buf = torch.zeros(self.chunk_nbytes[c] // torch.tensor([], dtype=self.dtype).element_size(),
                                      dtype=self.dtype)
                lay = self.layouts[c]
                master = buf[:lay.padded]
                lay.pack(master, [tensors[i].reshape(-1) for i in idx])
                self._write(c, buf)
                self._on_disk += self.chunk_nbytes[c]
            for tracker in self._trackers:
                tracker.add_external(("offload", self.root), self.file_bytes, "optimizer", "disk")
            self._counted = True
        except BaseException:
            self.close()
            raise

    def step(self, update) -> None:
        """Read, update and write back every chunk: `update(i, master, exp_avg, exp_avg_sq)` for tensor i (views
        into the chunk just read, changed in place). The next chunk's read and this chunk's write overlap the
        update on the thread pool; at most one write is outstanding, so at most three chunks are in memory."""
        # A chunk travels to and from the threads in a one-element list that the receiving side empties: the
        # pool's own bookkeeping (a finished task's arguments, a future's result) then never keeps a chunk alive,
        # so host memory falls the moment a write is done, not whenever the pool lets go.
        def read(c, box):
            box.append(self._read(c))

        def write(c, box):
            self._write(c, box.pop())

        read, write = carry_tracking(read), carry_tracking(write)
        boxes = {0: []}
        pending_read = self._pool.submit(read, 0, boxes[0])
        pending_write = None
        try:
            for c, idx in enumerate(self.chunks):
                pending_read.result()
                buf = boxes.pop(c).pop()
                if c + 1 < len(self.chunks):
                    boxes[c + 1] = []
                    pending_read = self._pool.submit(read, c + 1, boxes[c + 1])
                else:
                    pending_read = None
                lay = self.layouts[c]
                parts = [buf[k * lay.padded:(k + 1) * lay.padded] for k in range(3)]   # master | m | v
                for j, i in enumerate(idx):
                    update(i, *(lay.view(part, j) for part in parts))
                if pending_write is not None:
                    pending_write.result()
                pending_write = self._pool.submit(write, c, [buf])
                del buf, parts
            pending_write.result()
        except BaseException:
            for fut in (pending_read, pending_write):
                if fut is not None:
                    fut.cancel()
                    with contextlib.suppress(BaseException):
                        fut.result()
            self.close()
            raise

    def close(self) -> None:
        """Remove the files and the directory (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._counted:
            for tracker in self._trackers:
                tracker.remove_external(("offload", self.root))
            self._counted = False
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def measure_disk(directory: str | None = None, nbytes: int = 32 << 20, chunk_bytes: int = 4 << 20) -> dict:
    """Sequential write and read bandwidth of the disk under `directory`, in bytes/s, the way the SSD tier uses it:
    chunks written, fsynced and dropped from the page cache, then read back. The file is removed."""
    n, count = max(1, chunk_bytes // 12), max(2, nbytes // chunk_bytes)
    tier = DiskTier([n] * count, directory=directory, chunk_bytes=chunk_bytes)
    try:
        tier.initialize([torch.randn(n) for _ in range(count)])
        tier.step(lambda i, master, m, v: None)
        reads = [e for e in tier.log.events if e.op == "read"]
        writes = [e for e in tier.log.events if e.op == "write"]
        return {"read": sum(e.recv for e in reads) / sum(e.t1 - e.t0 for e in reads),
                "write": sum(e.sent for e in writes) / sum(e.t1 - e.t0 for e in writes), "bytes": tier.file_bytes}
    finally:
        tier.close()


# ============================================================================================ modeled step times
def zero_offload_step_time(t_forward: float, t_backward: float, t_cpu_step: float, psi: int, *,
                           link: "Link | str" = DEFAULT_LINK, dpu: bool = False, elem_bytes: int = 2) -> dict:
    """Modeled seconds per ZeRO-Offload step from measured compute and CPU-step times and the link model:

        down    = t_link(e·Ψ), overlapped with backward: exposed max(0, down − t_backward)
        up      = t_link(e·Ψ), after the CPU step
        no DPU  T = t_forward + t_backward + exposed down + t_cpu_step + up
        DPU     T = max(t_forward + t_backward + exposed down, t_cpu_step + up)   (the CPU step and the upload of
                                                                                 step i overlap step i + 1)
    """
    link = get_link(link)
    down, up = link.time(elem_bytes * psi), link.time(elem_bytes * psi)
    gpu = t_forward + t_backward + max(0.0, down - t_backward)
    cpu = t_cpu_step + up
    return {"total": max(gpu, cpu) if dpu else gpu + cpu, "device": gpu, "cpu": cpu, "down": down, "up": up}


# ============================================================================================ composing
def apply_offload(model: nn.Module, mesh=None, *, activations: bool = True, optimizer: str | None = "host",
                  dtype: torch.dtype | None = torch.bfloat16, zero_stage: int = 2, layers=None,
                  prefetch: bool = True, log: Ledger | None = None, bucket_cap_bytes: int | None = None,
                  **optimizer_kwargs):
    """(model, optimizer) with offload, for `train.run`:

        dtype        the device keeps the parameters in this precision (None: as they are)
        optimizer    'host' (ZeRO-Offload) | 'disk' (ZeRO-Infinity's SSD tier) | 'device' (the same mixed-precision
                     AdamW without offload) | None (no optimizer: the caller brings one); `optimizer_kwargs` go to
                     `OffloadAdam` (lr, betas, eps, weight_decay, dpu, offload_dir, chunk_bytes, …)
        mesh         with a dp axis of size > 1, ZeRO-`zero_stage` (1 or 2) over it, built by
                     `compose.apply_zero`: every rank offloads only the shard it owns
        activations  wrap the model in `ActivationOffload` over `layers` (the GPT's blocks by default)

    In the composition order of `compose`, activation offload sits with recomputation (it wraps the blocks that run
    here) and the optimizer offload inside ZeRO (its inner optimizer). One transfer log (`log`) books both.
    """
    log = transfer_log(getattr(getattr(mesh, "world", None), "rank", 0)) if log is None else log
    if dtype is not None:
        model = model.to(dtype)
    opt = None
    if optimizer is not None:
        kwargs = dict(tier=optimizer, log=log, **optimizer_kwargs)
        dp = None
        if mesh is not None:
            from ..dist.mesh import axis_comm
            dp = axis_comm(mesh, "dp")
        if dp is not None and dp.world_size > 1:
            if zero_stage not in (1, 2):
                raise ValueError(f"offload composes with ZeRO stage 1 or 2 (each rank offloads the optimizer state "
                                 f"of its shard), got zero_stage={zero_stage!r}; ZeRO-3 offload (parameters too) "
                                 f"is not built here")
            from ..parallel.zero import apply_zero
            model, opt = apply_zero(model, mesh, zero_stage, optimizer_cls=OffloadAdam,
                                    bucket_cap_bytes=bucket_cap_bytes, **kwargs)
        else:
            opt = OffloadAdam(model.parameters(), **kwargs)
    if activations:
        model = ActivationOffload(model, layers, prefetch=prefetch, log=log)
    return model, opt


def offload_log(optimizer) -> Ledger:
    """The transfer log of an `OffloadAdam`, also inside ZeRO's ShardedOptimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, OffloadAdam):
        raise TypeError(f"expected an OffloadAdam (or a ShardedOptimizer around one), got {type(inner).__name__}")
    return inner.log


# ====================================================================================== 5. what fits, at what cost
@dataclass(frozen=True)
class Machine:
    """One accelerator and its host, for the decision picture. Everything here is a model: the memory sizes and the
    device's sustained FLOP rate are assumptions; the links are presets (docs/formulas.md §6.3, §9); the disk
    bandwidths and the CPU-Adam rate per core should be measured (the notebook passes this machine's)."""
    device_bytes: float = 80e9
    host_bytes: float = 256e9
    disk_bytes: float = 30e12
    device_flops: float = 300e12             # sustained bf16 FLOP/s (an assumption, not a datasheet peak)
    pcie: "Link | str" = DEFAULT_LINK
    network: "Link | str" = "InfiniBand NDR"
    disk_read: float = 3e9                   # bytes/s
    disk_write: float = 2e9                  # bytes/s
    adam_per_core: float = 1e8               # parameters per second one core steps
    host_cores: int = 32
    zero_ranks: int = 16                     # devices ZeRO-3 shards over
    seq_len: int = 2048
    micro_batch_size: int = 1                # sequences whose activations are alive at once
    sequences_per_step: int = 16             # sequences per optimizer step (gradient accumulation)


def gpt_shape(psi: float) -> dict:
    """A GPT of about Ψ parameters with GPT-3's aspect ratio, d_model = 128·n_layer and 128-wide heads:
    Ψ ≈ 12·n_layer·d² ⇒ d = (128·Ψ/12)^(1/3), rounded to a multiple of 128."""
    d = max(128, int(round((128 * psi / 12) ** (1 / 3) / 128)) * 128)
    return {"d_model": d, "n_layer": max(1, d // 128), "n_head": max(1, d // 128)}


def fit_options(psi: float, m: Machine = Machine()) -> dict:
    """For a model of Ψ parameters on machine `m`: which technique fits and its modeled seconds per step.

    Bytes (mixed-precision Adam, 16Ψ of model states, docs/formulas.md §2.2, §6.1) and 16-bit activations per layer
    sbh(34 + 5as/h), or 2sbh + one layer's with full recomputation (§4.3, §5.1):

        none            device 16Ψ + A
        recompute       device 16Ψ + A_rc                                 compute × 4/3 (§5.3)
        ZeRO-3          device 16Ψ/N + A          network 3·(N−1)/N·2Ψ per rank, overlapped: max(compute, comm)
        offload: host   device 2Ψ + A, host 16Ψ   DPU step time of `zero_offload_step_time`
        offload: SSD    device 2Ψ + A, host 4Ψ, disk 12Ψ; the CPU step is max(Adam, 12Ψ read + 12Ψ written)

    A technique whose activations do not fit adds full recomputation (and its 4/3) if that makes it fit. Compute is
    (6Ψ + 12·L·T·d) FLOPs per token ÷ device_flops (§5.3), over `sequences_per_step` sequences of which
    `micro_batch_size` are alive at once (gradient accumulation: the optimizer's costs are paid once per step)."""
    shape = gpt_shape(psi)
    L, h, a = shape["n_layer"], shape["d_model"], shape["n_head"]
    s, b = m.seq_len, m.micro_batch_size
    layer = s * b * h * (34 + 5 * a * s / h)
    acts = {False: L * layer, True: L * 2 * s * b * h + layer}
    tokens = s * m.sequences_per_step
    compute = {False: tokens * (6 * psi + 12 * L * s * h) / m.device_flops}
    compute[True] = compute[False] * 4 / 3
    adam = psi / (m.adam_per_core * m.host_cores)
    from ..parallel.zero import model_state_bytes
    N = m.zero_ranks
    zero3 = sum(model_state_bytes(int(psi), N, 3, param=2, grad=2, optim=12).values())
    comm = get_link(m.network).time(3 * (N - 1) / N * 2 * psi)
    disk = 12 * psi / m.disk_read + 12 * psi / m.disk_write

    def offload(cpu, rc):
        t = compute[rc]
        return zero_offload_step_time(t / 3, 2 * t / 3, cpu, int(psi), link=m.pcie, dpu=True)["total"]

    options = {
        "none": (lambda rc: 16 * psi + acts[rc], lambda rc: 0, lambda rc: 0, lambda rc: compute[rc], False),
        "recompute": (lambda rc: 16 * psi + acts[rc], lambda rc: 0, lambda rc: 0, lambda rc: compute[rc], True),
        f"ZeRO-3 ×{N}": (lambda rc: zero3 + acts[rc], lambda rc: 0, lambda rc: 0,
                         lambda rc: max(compute[rc], comm), None),
        "offload: host": (lambda rc: 2 * psi + acts[rc], lambda rc: 16 * psi, lambda rc: 0,
                          lambda rc: offload(adam, rc), None),
        "offload: SSD": (lambda rc: 2 * psi + acts[rc], lambda rc: 4 * psi, lambda rc: 12 * psi,
                         lambda rc: offload(max(adam, disk), rc), None),
    }
    out = {}
    for name, (dev, host, dsk, secs, forced) in options.items():
        for rc in ([forced] if forced is not None else [False, True]):
            fits = dev(rc) <= m.device_bytes and host(rc) <= m.host_bytes and dsk(rc) <= m.disk_bytes
            if fits or rc is True or forced is not None:
                out[name] = {"fits": fits, "recompute": rc, "device": dev(rc), "host": host(rc), "disk": dsk(rc),
                             "seconds": secs(rc)}
                break
    return out


def largest_fitting(option: str, m: Machine = Machine(), lo: float = 1e6, hi: float = 1e15) -> float:
    """The largest Ψ (to 0.1 %) for which `option` fits on `m` (bisection on `fit_options`); 0 if none does."""
    if not fit_options(lo, m)[option]["fits"]:
        return 0.0
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if fit_options(mid, m)[option]["fits"] else (lo, mid)
    return lo


__all__ = ["DEFAULT_LINK", "transfer_log", "StorageSwap", "ActivationOffload", "OffloadPass", "LinkSchedule",
           "link_schedule", "offloaded_activation_peak", "break_even_speedup", "save_on_cpu_traffic", "adamw_", "TIERS",
           "OffloadAdam", "OffloadDiskError", "DiskTier", "measure_disk", "zero_offload_step_time", "apply_offload",
           "offload_log", "Machine", "gpt_shape", "fit_options", "largest_fitting"]
