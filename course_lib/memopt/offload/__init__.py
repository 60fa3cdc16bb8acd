"""Offload: keep less on the accelerator by moving training state over the host link, and count what it costs
(notebook 07, lab 07). One subject per file:

    swaps         StorageSwap: a storage to the host once, however often it is saved; the transfer log
    activations   ActivationOffload: vDNN (Rhu et al., MICRO 2016) by hooks on the model's blocks, any number of
                  forwards awaiting backward (a pipeline stage's micro-batches); `apply_activation_offload`
    schedule      the last pass on the modeled PCIe link (LinkSchedule) and the break-even device speed
    optimizer     OffloadAdam: ZeRO-Offload (Ren et al., ATC'21), the fp32 state and the Adam step on the CPU, with
                  the one-step delayed parameter update (DPU)
    disk          DiskTier: ZeRO-Infinity's SSD tier for the optimizer state (Rajbhandari et al., SC'21)
    apply         apply_offload: all of it for `train.run`, the optimizer inside ZeRO-1/2 over the dp axis
    plots         notebook 07's pictures: one offloaded step, swap plans vs budget, what fits

The cross-technique "what fits" model (`Machine`, `fit_options`, `largest_fitting`, `zero_offload_step_time`) lives
in `course_lib.memopt.memory_fit`; it is re-exported here for notebook 07.

On a CPU box the "device" is the simulated accelerator (`memory.SimulatedAccelerator`: only bytes placed on the
device count against its capacity), "host" is memory labelled `placed("host")` and "disk" real files. Every transfer
is a real copy, booked in a transfer log (a `distributed.comm.Ledger` whose group is "pcie" or "disk": d2h and writes
are "sent", h2d and reads "received"). The PCIe link's *time* is the α–β model (`costmodel.PRESETS`, labelled
modeled); disk time is measured. Checked against (docs/formulas.md §6):

    activations on the device, offloaded    A_emb + A_layer + max(A_head, A_layer)   the layers in flight: the one
                                            whose backward runs and the one arriving (§6.4); each further forward
                                            awaiting backward adds its A_emb + A_head
    ZeRO-Offload model states on the device 2Ψ  (bf16 parameters; each gradient leaves as autograd produces it)
    ZeRO-Offload link bytes per step        2Ψ down (bf16 gradients) + 2Ψ up (bf16 parameters) (§6.1)
    SSD tier bytes per step                 12Ψ read + 12Ψ written  (fp32 master, m, v) (§6.6)

Notebook 14's offload systems, on the same pieces:

    mobius/         Mobius (Feng et al., ASPLOS 2023): stages in host memory take turns on the device, the next one
                    prefetched while one computes — its model and partition search, its executor, and the modeled
                    commodity server (GPUs behind shared PCIe switches)
    flashneuron     FlashNeuron (Bae et al., FAST'21): chosen layers' activations to an NVMe SSD and back
    decision        the decision picture: notebook 07's techniques with Mobius, vDNN and FlashNeuron (modeled)
"""
from ...optim import adamw_  # noqa: F401  (the one AdamW step; re-exported: notebook 07 shows it here)
from ..memory_fit import DEFAULT_LINK, Machine, fit_options, gpt_shape, largest_fitting, zero_offload_step_time
from .activations import (
                          ActivationOffload,
                          activation_offload_of,
                          apply_activation_offload,
                          offloaded_activation_peak,
                          save_on_cpu_traffic,
)
from .apply import apply_offload, offload_log
from .disk import DiskTier, OffloadDiskError, measure_disk
from .optimizer import TIERS, OffloadAdam
from .schedule import LinkSchedule, OffloadPass, break_even_speedup, link_schedule
from .swaps import StorageSwap, _Packed, transfer_log  # noqa: F401  (_Packed: lab 07 and the swap planner use it)

__all__ = ["DEFAULT_LINK", "transfer_log", "StorageSwap", "ActivationOffload", "activation_offload_of",
           "apply_activation_offload", "OffloadPass", "LinkSchedule", "link_schedule", "offloaded_activation_peak",
           "break_even_speedup", "save_on_cpu_traffic", "adamw_", "TIERS", "OffloadAdam", "OffloadDiskError",
           "DiskTier", "measure_disk", "zero_offload_step_time", "apply_offload", "offload_log", "Machine",
           "gpt_shape", "fit_options", "largest_fitting"]
