"""The costs of recomputation measured on a real model: every term of `costs.ChainCosts` block by block (bytes with the
memory accountant, FLOPs with torch's FlopCounterMode, seconds timed), and probes that measure a whole run (its FLOPs
per phase, its activation peak). Checked against the closed forms of `costs.formula_costs`
(tests/unit/test_recompute.py).
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from ...core.model import GPT, get_config
from ...memory import MemoryTracker
from ...train import MemoryProbe, Probe
from . import attention_core, checkpoint, recompute_all
from .costs import BlockCost, ChainCosts


def _lone_block(block, x, policy) -> tuple[int, int, int]:
    """(held, work, FLOPs) of one block run alone, forward and backward, under the memory accountant and torch's
    FlopCounterMode: held = activations after forward, work = the most activations + recomputed in backward."""
    with MemoryTracker().watch(block) as mem:      # watched: weights autograd saves are parameters, not activations
        with FlopCounterMode(display=False) as fc:
            h = x.detach().clone().requires_grad_()
            out = block(h) if policy is None else checkpoint(block, h, policy=policy)
            held = mem.current["activations"]
            start = len(mem.timeline)
            out.backward(torch.ones_like(out))
        work = max(s["device"].get("activations", 0) + s["device"].get("recomputed", 0)
                   for _, s in mem.timeline[start:])
    block.zero_grad(set_to_none=True)
    return held, work, fc.get_total_flops()


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(cfg, batch_size: int, *, seed: int = 0, repeats: int = 3) -> ChainCosts:
    """Every term measured on a real model, block by block: bytes with the memory accountant (each block alone:
    stored, fully and selectively recomputed), FLOPs with torch's FlopCounterMode, seconds as the median of `repeats`
    timed runs (noisy: for the `cost='seconds'` optimum, never asserted)."""
    c = get_config(cfg)
    model = GPT(c, seed=seed)
    idx = torch.randint(0, c.vocab_size, (batch_size, c.seq_len), generator=torch.Generator().manual_seed(seed))
    with MemoryTracker().watch(model) as mem:
        ids, targets = idx.clone(), idx.roll(1, dims=1)
        x = model.embed(ids)
        embed = mem.current["activations"]
        h = x.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(model.head(h).flatten(0, 1), targets.flatten())
        head = mem.current["activations"] - embed
        loss.backward()            # releases what the head saved (a graph dropped unused would keep its outputs)
    model.zero_grad(set_to_none=True)
    del loss, h
    x = x.detach()
    blocks = []
    for block in model.blocks:
        (saved, _, store), (held_f, work_f, full), (held_sel, work_sel, sel) = (
            _lone_block(block, x, p) for p in (None, recompute_all, attention_core))
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            out = block(x)
        if work_f != saved or held_f != x.numel() * x.element_size():    # what full recomputation must measure
            raise RuntimeError(f"block measured inconsistently: full recomputation held {held_f:,} bytes (its input "
                               f"is {x.numel() * x.element_size():,}) and rebuilt {work_f:,} (stored: {saved:,})")

        def seconds(policy, x=x, block=block):
            def fwd_bwd():
                h = x.clone().requires_grad_()
                y = block(h) if policy is None else checkpoint(block, h, policy=policy)
                y.backward(torch.ones_like(y))
            return _seconds(fwd_bwd, repeats)
        t_store, t_full, t_sel = seconds(None), seconds(recompute_all), seconds(attention_core)
        with torch.no_grad():
            t_fwd = _seconds(lambda block=block, x=x: block(x), repeats)
        block.zero_grad(set_to_none=True)
        blocks.append(BlockCost(saved, held_f, held_sel, work_sel, fc.get_total_flops(), full - store, sel - store,
                                t_fwd, max(0.0, t_full - t_store), max(0.0, t_sel - t_store)))
        x = out
    return ChainCosts(embed, head, tuple(blocks))


class FlopProbe(Probe):
    """FLOPs of every 'forward' and 'backward' phase, counted by torch's FlopCounterMode (matrix multiplies)."""
    name = "flops"

    def __init__(self):
        self.steps: list[dict] = []
        self._mode = None

    def enter(self, step, phase):
        if phase in ("forward", "backward"):
            if len(self.steps) <= step:
                self.steps.append({})
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()

    def exit(self, step, phase):
        if self._mode is not None and phase in ("forward", "backward"):
            self._mode.__exit__(None, None, None)
            self.steps[step][phase] = self.steps[step].get(phase, 0) + self._mode.get_total_flops()
            self._mode = None

    def close(self):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def finish(self):
        return self.steps


def activation_peak(report) -> int:
    """The most bytes saved for backward (activations) plus recomputed ones at any moment of a MemoryReport (or of
    a MemoryTracker's own timeline)."""
    if isinstance(report, MemoryTracker):
        snaps = (snap["device"] for _, snap in report.timeline)
    else:
        snaps = (snap for _, snap in report.timeline)
    return max(snap.get("activations", 0) + snap.get("recomputed", 0) for snap in snaps)


class ActivationPeakProbe(MemoryProbe):
    """The memory accountant over a run, handing back only its `activation_peak` — for runs that need that one
    number (many short pipeline steps): building the whole report copies the timeline, which costs more than a
    short step itself."""
    name = "activation peak"

    def finish(self):
        self.close()
        return activation_peak(self.tracker)
