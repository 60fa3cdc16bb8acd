"""Checks for Lab 07: vDNN's prefetching saved-tensor hook pair, written by the learner as a class
`cls(model, layers)` that is called like the model and has `swap` (a StorageSwap, with its transfer log) and
`close()`.

    check_gradients(cls)   one step's gradients with the hooks equal the reference's, bit for bit
    check_peak(cls)        on a simulated accelerator of the stated budget: device activations peak at exactly
                           A_emb + A_layer + max(A_head, A_layer) (docs/formulas.md §6.4), nothing runs out
    check_bytes(cls)       L · A_layer bytes out and back per step, one copy per distinct storage saved in a layer
"""
from __future__ import annotations

import torch

from ..data import ShardedBatches
from ..memory import MemoryTracker, SimulatedAccelerator, SimulatedOutOfMemoryError, fmt_bytes
from ..memopt.offload import ActivationOffload, offloaded_activation_peak
from ..model import GPT, activation_bytes, block_activation_bytes, get_config
from . import check

CFG = get_config("nano", n_layer=4)
B = 2
_HINT = ("pack: stash the storage only inside a layer and never a parameter; unpack: make the layer arrive first, "
         "then start the next one's prefetch (i − 1, or the top layer from the head)")


def _batch():
    return ShardedBatches(CFG.seq_len, B, seed=7).global_batch(0)


def _step(cls, tracker=None):
    """One forward + backward through cls(model, model.blocks): (gradients, tracker, the offloader)."""
    torch.set_num_threads(1)
    model = GPT(CFG, seed=3)
    off = cls(model, model.blocks)
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
        got, _, _ = _step(cls)
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
        try:
            _, mem, _ = _step(cls, SimulatedAccelerator(budget).track())
        except SimulatedOutOfMemoryError as e:
            c.expect(False, f"ran out of the stated budget of {budget:,} B: {str(e).split('. To fit')[0]}",
                     hint="is every tensor a layer saves offloaded? is a layer's prefetch issued only one layer ahead?")
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
                 hint="offload only inside the layers, every storage they save (not the parameters)")
        c.expect(back == want, f"{back:,} B came back, expected L · A_layer = {want:,} B",
                 hint="every layer must come back exactly once: fetch it or prefetch it, never both")
        copies, storages = log.messages(op="d2h"), ref.log.messages(op="d2h")
        c.expect(copies == storages, f"{copies} copies to the host for {storages} distinct storages",
                 hint="swap.stash copies a storage only on its first save; keep one stash per storage")
        c.passed(f"{out:,} B out and {back:,} B back = L · A_layer each way, in {copies} copies (one per storage)")


__all__ = ["check_gradients", "check_peak", "check_bytes"]
