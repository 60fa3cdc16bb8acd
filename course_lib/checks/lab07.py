"""Checks for Lab 07: vDNN's prefetching saved-tensor hook pair, written by the learner as a class
`cls(model, layers)` that is called like the model and has `swap` (a StorageSwap, with its transfer log) and
`close()`.

    check_gradients(cls)   one step's gradients with the hooks equal the reference's, bit for bit, also when every
                           copy is slow (no tensor is used before its layer's copy has finished)
    check_peak(cls)        every layer's fetch begins before backward first needs it (the top one's from the head);
                           on a simulated accelerator of the stated budget: device activations peak at exactly
                           A_emb + A_layer + max(A_head, A_layer) (docs/formulas.md §6.4), nothing runs out
    check_bytes(cls)       L · A_layer bytes out and back per step, one copy per distinct storage saved in a layer
"""
from __future__ import annotations

import collections
import threading

import torch

from ..core.data import ShardedBatches
from ..core.model import GPT, activation_bytes, block_activation_bytes, get_config
from ..memopt.offload import ActivationOffload, _Packed, offloaded_activation_peak
from ..memory import MemoryTracker, SimulatedAccelerator, SimulatedOutOfMemoryError, fmt_bytes
from . import check

CFG = get_config("nano", n_layer=4)
B = 2
_HINT = ("pack: stash the storage only inside a layer and never a parameter; unpack: make the layer arrive first, "
         "then start the next one's prefetch (i − 1, or the top layer from the head)")


def _batch():
    return ShardedBatches(CFG.seq_len, B, seed=7).global_batch(0)


def _watch_order(off, hold: float = 0.0) -> dict:
    """Record, per layer, when its device buffers were allocated (its fetch or prefetch began) and whether its
    copy had finished when backward got its tensors, against when backward first needed one of them; wraps the
    offloader's `unpack` and its swap's `allocate` and `copy_in`. With `hold` > 0 a background copy of a layer waits
    until backward first asks for that layer, then until that unpack has returned or `hold` seconds have passed: a
    hook that waits for the copy gets it `hold` later, one that does not is seen using a layer that has not
    arrived — every time, not only when the copy thread happens to be late."""
    order = {"needed": {}, "allocated": {}, "copied": set(), "unready": set()}
    entered: dict = collections.defaultdict(threading.Event)
    returned: dict = collections.defaultdict(threading.Event)
    count = iter(range(1 << 30))
    unpack, allocate, copy_in = off.unpack, off.swap.allocate, off.swap.copy_in

    def watched_unpack(x):
        layer = x.stash.group if isinstance(x, _Packed) else "head"
        order["needed"].setdefault(layer, next(count))
        entered[layer].set()
        out = unpack(x)
        if layer != "head" and layer not in order["copied"]:
            order["unready"].add(layer)
        returned[layer].set()
        return out

    def watched_allocate(stashes):
        stashes = list(stashes)
        if stashes:
            order["allocated"].setdefault(stashes[0].group, next(count))
        return allocate(stashes)

    def watched_copy_in(stashes, *args):
        groups = {s.group for s in stashes}
        if hold and threading.current_thread() is not threading.main_thread():
            for g in groups:
                entered[g].wait(20 * hold)
                returned[g].wait(hold)
        copy_in(stashes, *args)
        order["copied"].update(groups)
    off.unpack, off.swap.allocate, off.swap.copy_in = watched_unpack, watched_allocate, watched_copy_in
    return order


def _fetched_on_demand(order: dict) -> list:
    """The layers whose fetch began only when backward needed them, top first."""
    return sorted((i for i, t in order["needed"].items() if i != "head" and order["allocated"].get(i, t + 1) > t),
                  reverse=True)


def _fetched_too_early(order: dict) -> list:
    """The layers whose fetch began before backward reached the layer above (the head, for the top layer)."""
    needed, top = order["needed"], CFG.n_layer - 1
    return sorted((i for i, t in order["allocated"].items()
                   if t < needed.get("head" if i == top else i + 1, float("inf"))), reverse=True)


def _order_hint(order: dict) -> str | None:
    late, early = _fetched_on_demand(order), _fetched_too_early(order)
    if early:
        return (f"layer(s) {early} were fetched before backward reached the layer above them: prefetch one layer "
                f"ahead only — layer i − 1 when layer i is first unpacked (the top layer from the head)")
    if not late:
        return None
    if len(late) == CFG.n_layer:
        return "no layer was prefetched: when layer i is first unpacked, start layer i − 1's fetch on the pool"
    if late == [CFG.n_layer - 1]:
        return ("backward begins in the head: when unpack gets a tensor that is not a note, start the top layer's "
                "prefetch")
    return "when layer i is first unpacked, start layer i − 1's fetch on the pool (background=True)"


def _step(cls, tracker=None, order=None, hold: float = 0.0):
    """One forward + backward through cls(model, model.blocks): (gradients, tracker, the offloader). With a dict
    `order`, also records when each layer was fetched against when it was first needed (`_watch_order`)."""
    torch.set_num_threads(1)
    model = GPT(CFG, seed=3)
    off = cls(model, model.blocks)
    if order is not None:
        order.update(_watch_order(off, hold))
    x, y = _batch()
    try:
        with (tracker or MemoryTracker()).watch(model) as mem:
            _, loss = off(x, y)
            loss.backward()
            del loss
    finally:
        off.close()
    return {k: p.grad for k, p in model.named_parameters()}, mem, off


def _reference():
    model = GPT(CFG, seed=3)
    _, loss = model(*_batch())
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _budget() -> int:
    """The device budget: what the course's own vDNN (notebook 07) peaks at on this step."""
    _, mem, _ = _step(lambda model, layers: ActivationOffload(model, layers))
    return mem.peak


def check_gradients(cls) -> None:
    with check("gradients") as c:
        order: dict = {}
        try:
            got, _, _ = _step(cls, order=order, hold=0.1)
        except TypeError as e:
            c.expect("unpack_hook" not in str(e), f"autograd got something else than a tensor back: {e}",
                     hint="unpack returns the saved tensor: swap.view(note) for a note, x itself otherwise")
            raise
        unready = sorted(order["unready"], reverse=True)
        c.expect(not unready, f"backward used layer(s) {unready} before their copies to the device had finished "
                 f"(each background copy was held back here until backward asked for its layer)",
                 hint="a layer in flight has not arrived: wait for its prefetch "
                 "(self.inflight.pop(layer).result()) before returning its tensors")
        ref = _reference()
        c.expect(got.keys() == ref.keys() and all(g is not None for g in got.values()),
                 "some parameters got no gradient", hint="unpack must return the saved tensor (swap.view for a note)")
        bad = [k for k in ref if not torch.equal(got[k], ref[k])]
        c.expect(not bad, f"{len(bad)} gradients differ from the reference, e.g. {bad[:2]}",
                 hint="a note must come back as the same tensor: swap.view(note) after its layer has arrived")
        c.passed(f"all {len(ref)} gradients equal the reference bit for bit ({CFG.n_layer} blocks, batch {B})")


def check_peak(cls) -> None:
    with check("peak") as c:
        budget = _budget()
        formula = offloaded_activation_peak(CFG, B)
        order: dict = {}
        try:
            _, mem, _ = _step(cls, SimulatedAccelerator(budget).track(), order)
        except SimulatedOutOfMemoryError as e:
            c.expect(False, f"ran out of the stated budget of {budget:,} B: {str(e).split('. To fit')[0]}",
                     hint=_order_hint(order) or "is every tensor a layer saves offloaded (and nothing else: no "
                                                "parameter), and each storage remembered once?")
        late = _fetched_on_demand(order)
        c.expect(not late, f"layer(s) {late} were fetched only when backward first needed them: backward waited "
                 f"for the copy instead of computing while it ran", hint=_order_hint(order))
        early = _fetched_too_early(order)
        c.expect(not early, f"layer(s) {early} were fetched more than one layer ahead", hint=_order_hint(order))
        got = mem.max_by_category["activations"]
        layer = block_activation_bytes(CFG, B)
        c.expect(got <= formula, f"device activations peaked at {got:,} B, over A_emb + A_layer + max(A_head, "
                 f"A_layer) = {formula:,} B (all of them: {activation_bytes(CFG, B):,} B)", hint=_HINT)
        c.expect(got == formula, f"device activations peaked at {got:,} B, under the formula's {formula:,} B by "
                 f"{formula - got:,} B — one layer ({layer:,} B) is not arriving while the one above computes",
                 hint="prefetch: when layer i is first unpacked, start layer i − 1 on the pool (and the top layer "
                      "when backward begins in the head)")
        c.passed(f"device activations peak at {got:,} B = A_emb + A_layer + max(A_head, A_layer) (not "
                 f"{activation_bytes(CFG, B):,}); device peak {fmt_bytes(mem.peak)} within the budget of "
                 f"{budget:,} B")


def check_bytes(cls) -> None:
    with check("bytes") as c:
        _, _, off = _step(cls)
        _, _, ref = _step(lambda model, layers: ActivationOffload(model, layers))
        log, want = off.swap.log, CFG.n_layer * block_activation_bytes(CFG, B)
        out, back = log.bytes_sent(op="d2h"), log.bytes_recv(op="h2d")
        c.expect(out == want, f"{out:,} B went to the host, expected L · A_layer = {want:,} B",
                 hint="pack must return t itself outside a layer (self.layer is None) and for a storage in "
                      "self.keep (the parameters and buffers)" if out > want else
                      "stash every storage a layer saves (inside a layer, not a parameter, not empty)")
        returns = {}
        for e in log.events:
            if e.op == "h2d":
                returns[e.tag] = returns.get(e.tag, 0) + 1
        twice = sorted(tag for tag, n in returns.items() if n > 1)
        c.expect(not twice, f"{', '.join(twice)} came back more than once ({back:,} B in all, L · A_layer = "
                 f"{want:,} B)", hint="every layer must come back exactly once: wait for its prefetch (the Future "
                                      "in self.inflight) or fetch it, never both")
        c.expect(back == want, f"{back:,} B came back, expected L · A_layer = {want:,} B",
                 hint="a layer's list in self.by_layer holds a storage more than once: remember a stash only "
                      "when swap.stash says it is new" if back > want else
                      "every stash of a layer must come back: fetch all of self.by_layer[layer]")
        copies, storages = log.messages(op="d2h"), ref.log.messages(op="d2h")
        c.expect(copies == storages, f"{copies} copies to the host for {storages} distinct storages",
                 hint="swap.stash copies a storage only on its first save; keep one stash per storage")
        c.passed(f"{out:,} B out and {back:,} B back = L · A_layer each way, in {copies} copies (one per storage)")


__all__ = ["check_gradients", "check_peak", "check_bytes"]
