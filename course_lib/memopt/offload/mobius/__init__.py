"""Mobius (Feng et al., ASPLOS 2023): the model's stages live in host memory and take turns on the accelerator; while
one stage computes, the next one is prefetched over PCIe, so the device holds only the stage in use and the one
arriving. Boundary activations go to the host in forward and each stage is recomputed from its boundary in
backward; each stage's gradients leave as its backward ends (docs/formulas.md §14.1).

    units_of / unit_bytes   the GPT cut into units: embedding | block 0 … block L−1 | head (ln_f + LM head)
    even_partition          the course's even split of the blocks (`model.stage_bounds`), embedding first, head last
    mobius_bytes            h2d and d2h bytes per step, the formula the executor's transfer log must equal
    states_peak/state_peaks the model-state bytes on the device at their peak (planning bound; exact per category)
    mobius_plan             the step's order of operations: load, fwd, bwd, drop (the prefetch order)
    mobius_timeline         the step on one clock: measured (or stated) compute, modeled PCIe transfers
    search_partition        Mobius's partition problem (a MIP in the paper) solved exhaustively at toy size

Checked against (P_s: stage s's parameter bytes, S stages, M micro-batches, A_b = e·B·T·d one boundary):

    h2d per step   2·ΣP_s − P_{S−1} + M·(S−1)·A_b      (each stage loaded in forward and again in backward, except
                                                       the last, which stays; boundaries come back)
    d2h per step   ΣP_s + M·(S−1)·A_b                  (gradients once; boundaries out)
    parameters, gradients on the device, each   max_s (P_s + P_{s+1})   (in use + arriving; in use + leaving)

The package, one subject per module:

    model       units, partitions, bytes, the order of operations, the step on one clock, the partition search
    executor    `MobiusExecutor`: one step on the simulated accelerator, real copies, measured compute per stage;
                `reference_step`, the single-process step it must equal; `random_batches`, a step's micro-batches
    cluster     Mobius on a modeled commodity server: GPUs behind shared PCIe switches, cross mapping (modeled)
"""
from .executor import MobiusExecutor, random_batches, reference_step
from .model import (
    MobiusTimeline,
    even_partition,
    mobius_bytes,
    mobius_plan,
    mobius_timeline,
    search_partition,
    stage_sums,
    state_peaks,
    states_peak,
    unit_activation_bytes,
    unit_bytes,
    units_of,
)

__all__ = ["units_of", "unit_bytes", "unit_activation_bytes", "even_partition", "stage_sums", "states_peak",
           "state_peaks", "mobius_bytes", "MobiusTimeline", "mobius_plan", "mobius_timeline", "search_partition",
           "reference_step", "random_batches", "MobiusExecutor"]
