"""vDNN (Rhu et al., MICRO 2016, arXiv 1602.08124): every activation a layer saves for backward is copied to host
memory as autograd saves it and brought back in backward, the next layer's tensors prefetched on a background thread
while this layer's backward runs.

    ActivationOffload          hooks on a model and its blocks (a GPT, its tensor-parallel form, a pipeline stage):
                               no wrapper has to be called, so it works wherever the model runs (a pipeline
                               executor calling the stage); any number of forwards may await their backward
    apply_activation_offload   the same, in place: `apply_<technique>(model, mesh, *, options) -> model`
    offloaded_activation_peak  the device activations it leaves, docs/formulas.md §6.4
    save_on_cpu_traffic        what `torch.autograd.graph.save_on_cpu` would move, for comparison

Checked against (A_emb, A_layer, A_head: `model.embed_activation_bytes`, `block_activation_bytes`,
`head_activation_bytes`; k forwards awaiting backward):

    device activations at their peak   (k − 1)·(A_emb + A_head) + A_emb + A_layer + max(A_head, A_layer)
    host, and link bytes each way      k·L·A_layer  (each storage moved once, however often it is saved)
"""
from __future__ import annotations

import itertools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ...core.costmodel import Link, get_link
from ...core.handles import attach, detach, handle_of
from ...core.model import block_activation_bytes, blocks_of, embed_activation_bytes, get_config, head_activation_bytes
from ...distributed.comm import Ledger
from ...memory import carry_tracking, now, saved_tensors_hooks_over
from ..memory_fit import DEFAULT_LINK
from .schedule import LinkSchedule, OffloadPass, link_schedule
from .swaps import StorageSwap, _book, _Packed, _Stash, transfer_log

_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model or block -> ref to its ActivationOffload


class _Forward:
    """One forward whose backward has not finished: what its layers stashed, in the order they ran."""
    __slots__ = ("key", "order", "stashes", "inflight", "arrived", "open", "started", "stats")

    def __init__(self, key: int):
        self.key = key
        self.order: list = []                    # layers in the order this forward ran them
        self.stashes: dict = {}                  # layer -> [_Stash] it moved to the host
        self.inflight: dict = {}                 # layer -> its prefetch (a Future), until its backward asks
        self.arrived: set = set()
        self.open = True                         # the forward is still running
        self.started = False                     # its backward has begun
        self.stats = OffloadPass()

    def below(self, layer: int):
        """The layer whose backward comes after `layer`'s: the one this forward ran before it."""
        k = self.order.index(layer)
        return self.order[k - 1] if k else None


class ActivationOffload(nn.Module):
    """vDNN on `model`'s blocks (`model.blocks_of`, or `layers`), by hooks on the model and on each block.

        forward   the model's pre-hook opens a forward (a key of its own); while a block runs, its saved tensors go
                  through pack: a storage is copied to the host once (however many ops save it) and autograd keeps a
                  note; the device copy dies with the forward's last reference to it
        backward  when the gradient of the model's output arrives, this forward's top layer starts coming back;
                  when layer i's first tensor is asked for, it is on the device already (prefetched) or is fetched
                  now, and the layer that ran before it in this forward starts coming back on a background thread

    Every forward keeps its own layers, so any number of forwards may await backward (1F1B keeps up to S on stage 0)
    and be run backward in any order. Tensors saved outside the blocks (embedding, head, loss), parameters, buffers
    and the forward's own inputs (a later pipeline stage's received activation, which the executor holds) stay
    where they are. Gradients are bitwise those without offload: only copies move. The module is a thin
    wrapper that calls `model` (for `train.run`); the hooks work as well when `model` is called directly.
    """

    def __init__(self, model: nn.Module, layers=None, *, prefetch: bool = True, log: Ledger | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"ActivationOffload needs an nn.Module, got {type(model).__name__}")
        if isinstance(layers, nn.ModuleDict):
            layers = list(layers.values())        # a stage's blocks: the modules, not their keys
        layers = blocks_of(model) if layers is None else list(layers)
        if not layers:
            raise ValueError("ActivationOffload needs at least one layer to offload (pass layers=[...])")
        if handle_of(model, "recompute") is not None:
            raise ValueError("recomputation is applied to this model's blocks: it replays them in backward, where "
                             "there is nothing left to offload; offload or recompute a block, not both "
                             "(memopt.recompute.remove_recompute(model) first, or pass layers= the others)")
        taken = [m for m in [model, *layers] if activation_offload_of(m) is not None]
        if taken:
            raise ValueError(f"activation offload is already applied to this {type(taken[0]).__name__}: apply it "
                             f"once, to the model that is called (a pipeline stage, not also the GPT it was cut from)")
        self.module = model
        self.layers = layers                      # plain list: the modules stay registered under self.module only
        self.prefetch = prefetch
        self.log = transfer_log() if log is None else log
        self.swap = StorageSwap(self.log, on_release=self._forget)
        self.last_pass = OffloadPass()            # the statistics of the latest forward and its backward
        self._lock = threading.RLock()
        self._forwards: dict[int, _Forward] = {}  # key -> a forward awaiting (or in) its backward
        self._keys = itertools.count()
        self._open: _Forward | None = None      # the forward running now
        self._layer = None                        # the layer whose forward is running
        self._saving = None                       # the saved-tensor hooks pushed while it runs
        self._keep: set = set()
        self._pool: ThreadPoolExecutor | None = None
        self._handles = [model.register_forward_pre_hook(self._begin),
                         model.register_forward_hook(self._end, always_call=True)]
        for i, layer in enumerate(layers):
            self._handles += [layer.register_forward_pre_hook(lambda mod, args, i=i: self._enter(i, args)),
                              layer.register_forward_hook(lambda mod, args, out, i=i: self._exit(i, out),
                                                          always_call=True)]
        for m in [model, *layers]:
            _OWNER[m] = weakref.ref(self)
        attach(model, "activation_offload", self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def in_flight(self) -> int:
        """Forwards whose saved tensors are still held (awaiting or in backward)."""
        with self._lock:
            return len(self._forwards)

    # ---------------------------------------------------------------- forward: one key per forward, its layers
    def _begin(self, module, args) -> None:
        if self._open is not None:
            raise RuntimeError(f"{type(module).__name__} was called inside its own forward: activation offload "
                               f"keeps one forward running at a time")
        # what never leaves: the parameters and buffers (autograd saves weights too; they are on the device anyway)
        # and this forward's inputs, which the caller holds (a pipeline stage's received activation: moving it
        # would free nothing and bring a second copy back)
        inputs = [t for t in tree_flatten(args)[0] if torch.is_tensor(t)]
        self._keep = {t.untyped_storage()._cdata for t in [*self.module.parameters(), *self.module.buffers(), *inputs]}
        rec = _Forward(next(self._keys))
        with self._lock:
            self._forwards[rec.key] = rec
        self._open, self.last_pass = rec, rec.stats

    def _end(self, module, args, out) -> None:
        rec, self._open = self._open, None
        if rec is None:
            return
        with self._lock:
            rec.open = False
            if not rec.stashes:                   # nothing saved (no_grad, or nothing in the layers): forget it
                del self._forwards[rec.key]
                return
        if self.prefetch:                         # the gradient of an output arrives: this forward's backward begins
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda g, rec=rec: self._backward_begins(rec))

    def _enter(self, i: int, args) -> None:
        rec = self._open
        if rec is None:
            raise RuntimeError(f"layer {i} ran outside a forward of the {type(self.module).__name__} activation "
                               f"offload was applied to: apply it to the model that is called (the pipeline stage, "
                               f"not the GPT it was cut from); recomputation replays layers in backward, so do not "
                               f"offload and recompute the same blocks")
        if self._layer is not None or i in rec.stats.forward:
            raise RuntimeError(f"layer {i} ran inside layer {self._layer} or twice in one forward: offload layers "
                               f"that run one after another, each once per forward")
        self._layer = i
        rec.order.append(i)
        rec.stats.forward[i] = (now(), None)
        x = args[0] if args and torch.is_tensor(args[0]) else None
        if x is not None and x.requires_grad:     # its gradient is complete when layer i's backward has ended
            x.register_hook(lambda g, rec=rec, i=i: self._backward_span(rec, i, end=True))
        self._saving = saved_tensors_hooks_over(self.pack, self.unpack)
        self._saving.__enter__()

    def _exit(self, i: int, out) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.__exit__(None, None, None)
        rec, self._layer = self._open, None
        if rec is None or rec.stats.forward.get(i, (0, 0))[1] is not None:
            return
        t0 = rec.stats.forward[i][0]
        rec.stats.forward[i] = (t0, now())
        _book(self.log, "compute", "forward", f"layer {i}", t0, group="compute")
        if torch.is_tensor(out) and out.requires_grad:   # its gradient is complete when layer i's backward starts
            out.register_hook(lambda g, rec=rec, i=i: self._backward_span(rec, i, end=False))

    def _backward_span(self, rec: _Forward, i: int, end: bool) -> None:
        t = now()
        if not end:
            rec.stats.backward[i] = (t, None)
        elif i in rec.stats.backward:
            t0 = rec.stats.backward[i][0]
            rec.stats.backward[i] = (t0, t)
            _book(self.log, "compute", "backward", f"layer {i}", t0, group="compute")

    # ---------------------------------------------------------------- the hook pair (pushed while a layer runs)
    def pack(self, t: torch.Tensor):
        rec, i = self._open, self._layer
        storage = t.untyped_storage()
        if rec is None or i is None or t.layout != torch.strided or not storage.nbytes() or \
                storage._cdata in self._keep:
            return t                              # (a deferred weight gradient packs in backward: it stays)
        s, new = self.swap.stash(t, (rec.key, i), f"layer {i}")
        if new:
            with self._lock:
                rec.stashes.setdefault(i, []).append(s)
            rec.stats.offloads.append((now(), i, s.nbytes))
            rec.stats.layer_bytes[i] = rec.stats.layer_bytes.get(i, 0) + s.nbytes
        rec.stats.saves += 1
        return self.swap.packed(s, t, (rec.key, i))

    def unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        key, layer = x.group
        rec = self._forwards.get(key)
        if rec is not None:
            if layer not in rec.arrived:
                rec.stats.needed.setdefault(layer, now())
                self._arrive(rec, layer)
            nxt = rec.below(layer) if self.prefetch else None
            if nxt is not None and nxt not in rec.arrived and nxt not in rec.inflight and rec.stashes.get(nxt):
                self.issue(rec, nxt, background=True)
        if x.stash.device is None:                # a storage another layer stashed first: bring it on its own
            self.swap.copy_in([x.stash], self.swap.allocate([x.stash]), f"layer {layer}", now())
        return self.swap.view(x)

    def _backward_begins(self, rec: _Forward) -> None:
        if rec.started:
            return
        rec.started = True
        top = next((i for i in reversed(rec.order) if rec.stashes.get(i)), None)
        if top is not None and top not in rec.arrived and top not in rec.inflight:
            self.issue(rec, top, background=True)

    # ---------------------------------------------------------------- fetching back
    def issue(self, rec: _Forward, layer: int, background: bool) -> None:
        """Start bringing `layer` of forward `rec` back: its device buffers are allocated now, here; the copies run
        on the background thread if `background`."""
        stashes = [s for s in rec.stashes.get(layer, ()) if s.device is None]
        buffers = self.swap.allocate(stashes)
        t0 = now()
        rec.stats.fetches[layer] = (t0, sum(s.nbytes for s in stashes))
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch")
            rec.inflight[layer] = self._pool.submit(carry_tracking(self.swap.copy_in), stashes, buffers,
                                                    f"layer {layer}", t0)
        else:
            self.swap.copy_in(stashes, buffers, f"layer {layer}", t0)
            rec.arrived.add(layer)

    def _arrive(self, rec: _Forward, layer: int) -> None:
        fut = rec.inflight.pop(layer, None)
        if fut is None:                          # nobody prefetched it (prefetch=False): fetch it now
            self.issue(rec, layer, background=False)
        else:
            fut.result()
        rec.arrived.add(layer)

    def _forget(self, s: _Stash) -> None:
        key, layer = s.group
        with self._lock:
            rec = self._forwards.get(key)
            ours = rec.stashes.get(layer) if rec is not None else None
            if ours is None or s not in ours:
                return
            ours.remove(s)
            if not ours:
                del rec.stashes[layer]
            if not rec.stashes and not rec.open:  # its backward is done (or its graph dropped): nothing is held
                del self._forwards[key]

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the prefetch thread (a later backward starts it again); the hooks stay (`remove` takes them off)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def remove(self) -> None:
        """Take the hooks off the model and its blocks, and stop the thread."""
        self.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in [self.module, *self.layers]:
            if activation_offload_of(m) is self:
                del _OWNER[m]
        detach(self.module, "activation_offload")

    def __enter__(self) -> ActivationOffload:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- the modeled link
    def modeled_schedule(self, link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0) -> LinkSchedule:
        """The latest forward + backward on a modeled link (see `LinkSchedule`)."""
        return link_schedule(self.last_pass, get_link(link), speedup=speedup)


def activation_offload_of(model: nn.Module) -> ActivationOffload | None:
    """The `ActivationOffload` hooked on `model` or on this block, if any (a model's own: `handle_of(model,
    'activation_offload')`)."""
    ref = _OWNER.get(model)
    return ref() if ref is not None else None


def apply_activation_offload(model: nn.Module, mesh=None, *, layers=None, prefetch: bool = True,
                             log: Ledger | None = None) -> nn.Module:
    """vDNN on `model`'s blocks, in place: the same model comes back, its blocks offloading what they save, whoever
    calls it (a GPT, a TensorParallelGPT, a PipelineStage). `handle_of(model, 'activation_offload')` is the handle:
    its `log`, `last_pass`, `close()`. The mesh is not used (each rank offloads its own activations). A model without
    blocks is refused (`model.blocks_of` says what it accepts), and so is a second application."""
    ActivationOffload(model, layers, prefetch=prefetch, log=log)
    return model


def offloaded_activation_peak(cfg, batch_size: int, seq_len: int | None = None, elem_bytes: int = 4, *,
                              in_flight: int = 1) -> int:
    """Device bytes of activations at their peak with every block offloaded (`ActivationOffload`, GPT blocks) and
    `in_flight` forwards run before their backwards:

        (k − 1)·(A_emb + A_head) + A_emb + A_layer + max(A_head, A_layer)   (n_layer ≥ 2; one block: A_layer + …)

    A_layer = `model.block_activation_bytes`, A_emb = `embed_activation_bytes` (the token ids and positions, freed
    only when that forward's backward ends), A_head = `head_activation_bytes` (ln_f, log-softmax, targets), freed
    when the head's backward is done. Each forward waiting keeps its A_emb + A_head on the device; the one in
    backward starts in the head with its top block arriving (A_head + A_layer), then each block computes while the
    one below arrives (2·A_layer) — docs/formulas.md §6.4."""
    if not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight is the number of forwards awaiting backward, an integer >= 1, got {in_flight!r}")
    c = get_config(cfg)
    T = seq_len or c.seq_len
    layer = block_activation_bytes(c, batch_size, T, elem_bytes)
    emb = embed_activation_bytes(c, batch_size, T, elem_bytes)
    head = head_activation_bytes(c, batch_size, T, elem_bytes)
    return (in_flight - 1) * (emb + head) + emb + layer + max(head, layer if c.n_layer >= 2 else 0)


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


__all__ = ["ActivationOffload", "activation_offload_of", "apply_activation_offload", "offloaded_activation_peak",
           "save_on_cpu_traffic"]
