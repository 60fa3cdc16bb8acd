"""Exact memory accounting on CPU: live bytes by category × placement, peak, timeline, and a simulated accelerator.

There is no CPU memory-stats API in PyTorch, RSS does not fall after frees and tracemalloc does not see tensor
storage. What *is* exact is to watch every storage as it is created: a `TorchDispatchMode` sees the output of every
op, and a weakref finalizer on the output's storage fires when it is freed. Every storage gets two labels:

    category   what the bytes are for (what holds them):
        parameters   registered with `track`/`watch` (numel × element size, exactly)
        gradients    relabelled by a post-accumulate-grad hook on each parameter
        optimizer    relabelled by the optimizer's step post-hook (AdamW: exp_avg + exp_avg_sq = 2 × params, plus a
                     4-byte `step` tensor per parameter tensor)
        activations  relabelled while autograd holds them for backward (`saved_tensors_hooks`)
        comm         allocated under `alloc_category("comm")` (communication buffers)
        other        everything else: temporaries, buffers, inputs, logits
      Later techniques add their own with `register_category` (stashed weights, recomputed activations, snapshots).
    placement  where the bytes live: "device" (the accelerator), "host" (CPU memory) or "disk" (files). On this CPU
               box all three are host RAM or files; the label is what offload code moves between.

Labels come from context variables (`alloc_category`, `placed`), so they are per thread: a communication thread
that allocates under `alloc_category("comm")` does not relabel what the main thread allocates meanwhile. A dispatch
mode is per thread too; `carry_tracking(fn)` runs `fn` in another thread under the trackers of the caller.

Time is `time.perf_counter()` — the clock the traffic ledger uses — so a memory timeline and a per-rank ledger can
be drawn on one time axis (`MemoryReport.t0`, `plots.plot_memory(..., t0=...)`).

`SimulatedAccelerator(capacity)` raises `SimulatedOutOfMemoryError` (naming the largest categories) when the
*device* bytes exceed the capacity: notebooks fit models into it with ZeRO, offload and recomputation. It is a model
of a device memory limit, not a measurement of one.

    labels       categories, placements, the clock, `alloc_category` / `placed` / `untracked`, byte formats
    tracker      `MemoryTracker` (the accountant), `carry_tracking` (other threads), `SimulatedAccelerator`
    report       `MemoryReport`, `SimulatedOutOfMemoryError`, `tensor_bytes`
"""
from .labels import (  # noqa: F401
                     CATEGORIES,
                     CATEGORY_COLORS,
                     PLACEMENTS,
                     _active,
                     _category,
                     _Outer,
                     _paused,
                     _placement,
                     active_trackers,
                     alloc_category,
                     fmt_bytes,
                     now,
                     parse_bytes,
                     placed,
                     register_category,
                     saved_tensors_hooks_over,
                     untracked,
)
from .report import MemoryReport, SimulatedOutOfMemoryError, tensor_bytes  # noqa: F401
from .tracker import MemoryTracker, SimulatedAccelerator, carry_tracking  # noqa: F401
