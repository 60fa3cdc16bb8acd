"""Checks for Lab 14: the order of a Mobius step, the prefetch plan (notebook 14; docs/formulas.md §14.1).

A plan is a list of operations ('load', s), ('fwd', s), ('bwd', s), ('drop', s) that `MobiusExecutor.step` runs
on the simulated accelerator. A good plan keeps at most the stage in use and the one arriving on the device, loads
each stage once for its forward and once for its backward except the last (which stays), and issues every load
before the compute it must hide under:

    check_plan(plan_fn)   plan_fn(S) for an uneven GPT cut into S = 5 stages, run under a device budget of
                          §14.1's state peak + the planning bound on activations: the device never exceeds it,
                          h2d and d2h bytes equal the formula, the gradients are bitwise the reference's, and the
                          modeled step (stated costs) is as fast as one-ahead prefetch allows, and nothing is
                          left on the device after the last backward; each plausible wrong plan is named by its
                          cause (a stage dropped before its compute, or not reloaded, is named as such)
"""
from __future__ import annotations

import torch

from ..core.costmodel import Link
from ..core.model import GPT, GPTConfig
from ..memopt.offload import mobius as MB
from ..memory import SimulatedAccelerator, SimulatedOutOfMemoryError, fmt_bytes
from . import check, exercises

CFG = GPTConfig(vocab_size=1024, seq_len=8, n_layer=3, n_head=2, d_model=32)   # embedding, head ≫ a block
B, M = 1, 2
BOUNDARY = 4 * B * CFG.seq_len * CFG.d_model

exercises({"mobius_prefetch_plan": "Exercise 1 (the prefetch plan)"})
_REFERENCE: dict = {}                                   # the reference gradients, computed once per process


def _reference_grads(batches) -> list:
    if "grads" not in _REFERENCE:
        _REFERENCE["grads"] = [p.grad for p in MB.reference_step(CFG, batches).parameters()]
    return _REFERENCE["grads"]


def _residency_fault(plan, S):
    """Why a plan holds more than two stages at some compute (None if it never does): a stage that was computed
    and is not needed next was not dropped, or a stage was loaded more than one compute ahead."""
    order = [("fwd", s) for s in range(S)] + [("bwd", s) for s in reversed(range(S))]
    loaded, k = set(), 0
    for kind, s in plan:
        if kind == "load":
            loaded.add(s)
        elif kind == "drop":
            loaded.discard(s)
        elif (kind, s) in order[k:k + 1]:
            k += 1
            nxt = order[k][1] if k < len(order) else None
            extra = loaded - {s, nxt}
            if extra:
                done = {x for x in extra if ("fwd", x) in order[:k]}
                return ("kept", min(done), (kind, s)) if done else ("early", min(extra), (kind, s))
    return None


def _first_missing(plan):
    """The index of the first compute whose stage is not on the device, or None."""
    loaded = set()
    for k, (kind, s) in enumerate(plan):
        if kind == "load":
            loaded.add(s)
        elif kind == "drop":
            loaded.discard(s)
        elif s not in loaded:
            return k
    return None


def _missing_cause(plan, S):
    """(message, hint) naming why the first compute whose stage is not on the device finds it missing, or None
    (every compute finds its stage, or no plausible slip explains it)."""
    k = _first_missing(plan)
    if k is None:
        return None
    kind, s = plan[k]
    ops = f"{kind} {s}"
    last_load = max((i for i, op in enumerate(plan[:k]) if op == ("load", s)), default=None)
    if last_load is not None:
        drop = next(i for i, op in enumerate(plan[last_load:k], last_load) if op == ("drop", s))
        if not any(op == ("fwd", s) for op in plan[last_load:drop]):
            return (f"the plan drops stage {s} (operation {drop}) after loading it (operation {last_load}) and "
                    f"before {ops} runs: the compute finds it gone",
                    "drop a stage after its compute, never between its load and its compute")
        if s == S - 1:
            return (f"the plan drops the last stage after fwd {s} and does not load it again for {ops}",
                    "the last stage's backward follows its forward: keep it on the device in between (no drop, "
                    "no reload)")
        return (f"the plan drops stage {s} after fwd {s} and does not load it again for {ops}",
                f"load stage {s} again just before bwd {s + 1} computes (one ahead)")
    # never loaded for this compute: was another stage loaded more than one compute ahead instead?
    order = [("fwd", x) for x in range(S)] + [("bwd", x) for x in reversed(range(S))]
    done = 0                                             # computes run before plan[i]
    for op in plan[:k]:
        if op[0] in ("fwd", "bwd"):
            done += 1
        elif op[0] == "load":
            use = next((j for j in range(done, len(order)) if order[j][1] == op[1]), done)
            if use - done > 1:
                return (f"the plan never loads stage {s} before {ops}; it loads stage {op[1]} before "
                        f"{' '.join(map(str, order[done]))}, {use - done} computes ahead",
                        "prefetch one ahead: just before a compute, load the stage of the compute after it")
    if (kind, s) == ("fwd", 0):
        return ("the plan never loads stage 0: fwd 0 finds nothing on the device",
                "start the plan with ('load', 0): every compute needs its stage loaded first, stage 0 included")
    return None


def _left_on_device(plan):
    """The stages the plan leaves loaded after its last operation."""
    loaded = set()
    for kind, s in plan:
        if kind == "load":
            loaded.add(s)
        elif kind == "drop":
            loaded.discard(s)
    return sorted(loaded)


def check_plan(plan_fn) -> None:
    """Run `plan_fn(S)` (S = 5 stages of the uneven GPT) on the simulated accelerator; see the module docstring."""
    with check("plan") as c:
        batches = MB.random_batches(CFG, M, B)
        model = GPT(CFG, seed=0)
        bounds = [(u, u + 1) for u in range(CFG.n_layer + 2)]
        S = len(bounds)
        plan = [tuple(op) for op in plan_fn(S)]
        c.expect(all(len(op) == 2 and op[0] in ("load", "fwd", "bwd", "drop") for op in plan),
                 f"plan_fn({S}) must return (op, stage) pairs, op one of 'load', 'fwd', 'bwd', 'drop'; got "
                 f"{plan[:3]}…")
        P = MB.stage_sums(MB.unit_bytes(model), bounds)
        budget = MB.states_peak(P) + max(MB.stage_sums(MB.unit_activation_bytes(CFG, B, M), bounds))
        fault = _residency_fault(plan, S)
        try:
            with SimulatedAccelerator(budget).track() as mem:
                ex = MB.MobiusExecutor(model, bounds, device_bytes=budget)
                mem.watch(model)
                ex.step(batches, plan=plan)
        except SimulatedOutOfMemoryError:
            if fault is not None and fault[0] == "kept":
                c.expect(False, f"the device ran out of its {fmt_bytes(budget)}: stage {fault[1]} is still there at "
                                f"{' '.join(map(str, fault[2]))}, after its forward",
                         hint="drop each stage once it has computed (the next time it is needed, it is loaded "
                              "again); only the last stage stays from its forward to its backward")
            c.expect(False, f"the device ran out of its {fmt_bytes(budget)}: more than two stages on the device"
                            + (f" (stage {fault[1]} arrives before {' '.join(map(str, fault[2]))})" if fault else ""),
                     hint="prefetch one stage ahead only: load stage s + 1 just before stage s computes")
        except RuntimeError as e:
            missing = "not on the device" in str(e)
            cause = _missing_cause(plan, S) if missing else None
            if cause:
                c.expect(False, cause[0], hint=cause[1])
            hint = ("every compute needs its stage loaded first, including stage 0 and the backward's stages"
                    if missing else
                    "forwards run 0 … S−1, then backwards S−1 … 0 (each backward needs the gradient of the stage "
                    "after it)")
            c.expect(False, str(e), hint=hint)
        ex.restore()
        left = _left_on_device(plan)
        c.expect(not left, f"stage{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} still on the device "
                           f"when the step ends (the executor frees {'them' if len(left) > 1 else 'it'} for you)",
                 hint="drop each stage after its backward too: the device holds only the stage in use and the one "
                      "arriving, and nothing is in use after bwd 0")
        want = MB.mobius_bytes(P, M, BOUNDARY)
        h2d, d2h = ex.log.bytes_recv(op="h2d"), ex.log.bytes_sent(op="d2h")
        c.expect(h2d <= want["h2d"],
                 f"{h2d:,} B came in, the formula says {want['h2d']:,} (2ΣP − P_last + M(S−1)A_b): "
                 f"{h2d - want['h2d']:,} B too many",
                 hint="the last stage stays on the device between its forward and its backward: do not drop and "
                      "reload it" if h2d - want["h2d"] == P[-1] else "load each stage once per forward and once per "
                                                                        "backward")
        c.expect((h2d, d2h) == (want["h2d"], want["d2h"]), f"h2d {h2d:,} B, d2h {d2h:,} B; the formula says "
                 f"{want['h2d']:,} and {want['d2h']:,}")
        bad = [n for (n, p), g in zip(model.named_parameters(), _reference_grads(batches))
               if not torch.equal(p.grad, g)]
        c.expect(not bad, f"gradients differ from the reference in {bad[:3]}")
        fwd = [b / 1e9 for b in P]                        # stated costs: 1 s per GB of a stage's parameters
        link = Link("stated link", 0.0, 0.5e9)         # a load takes twice its stage's forward
        mine = MB.mobius_timeline(P, fwd, [3 * f for f in fwd], boundary_bytes=BOUNDARY, num_microbatches=M, link=link,
                                  plan=plan)
        best = MB.mobius_timeline(P, fwd, [3 * f for f in fwd], boundary_bytes=BOUNDARY, num_microbatches=M, link=link)
        c.expect(mine.total <= best.total * (1 + 1e-12),
                 f"the modeled step takes {mine.total * 1e3:.3f} ms, {(mine.total / best.total - 1) * 100:.0f}% "
                 f"longer than with one-ahead prefetch ({best.total * 1e3:.3f} ms): loads wait for the compute "
                 f"before them", hint="issue stage s + 1's load before stage s computes, not after")
        c.passed(f"device peak {fmt_bytes(mem.peak)} ≤ budget {fmt_bytes(budget)}; h2d {h2d:,} B and d2h {d2h:,} B "
                 f"= the formula; gradients bitwise the reference's; modeled step {mine.total * 1e3:.3f} ms")


__all__ = ["CFG", "check_plan"]
