"""What fits, and at what cost: an analytic model of device, host and disk bytes and modeled seconds per step for
each memory technique, as a function of model shape, technique and machine (notebook 07 §6; the capstone's
calculator). Nothing here runs a model: every number is a formula of docs/formulas.md, fed with measured rates.

    zero_offload_step_time   ZeRO-Offload's modeled step, with and without the one-step delayed update (§6.1)
    Machine                  one accelerator, its host and disk, the links between them (memory, FLOP/s, links)
    gpt_shape                a GPT of Ψ parameters with GPT-3's aspect ratio
    fit_terms                the terms fit_options combines: activation bytes, compute, CPU Adam, ZeRO-3, SSD
    fit_options              which technique fits Ψ on a machine, what it keeps where, its modeled step time
    largest_fitting          the largest Ψ a technique fits (bisection on fit_options)

Bytes per technique (mixed-precision Adam: 16Ψ of model states, §2.2; 16-bit activations per layer, Korthikanti et
al. MLSys'23 Table 2, `parallel.tensor.sequence.paper_activation_bytes`):

    none            device 16Ψ + A                         recompute        device 16Ψ + A_rc,  compute × 4/3
    ZeRO-3 ×N       device 16Ψ/N + A                       offload: host    device 2Ψ + A, host 16Ψ
    offload: SSD    device 2Ψ + A, host 4Ψ, disk 12Ψ
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.costmodel import Link, get_link
from ..parallel.tensor.sequence import paper_activation_bytes
from ..parallel.zero import zero_state_bytes

DEFAULT_LINK = "PCIe Gen4 x16"      # the host link every offload model here defaults to (costmodel.PRESETS)


def zero_offload_step_time(t_forward: float, t_backward: float, t_cpu_step: float, psi: int, *,
                           link: Link | str = DEFAULT_LINK, dpu: bool = False, elem_bytes: int = 2) -> dict:
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


@dataclass(frozen=True)
class Machine:
    """One accelerator and its host, for the decision picture. Everything here is a model: the memory sizes and the
    device's sustained FLOP rate are assumptions; the links are presets (docs/formulas.md §6.3, §9); the disk
    bandwidths and the CPU-Adam rate per core should be measured (notebook 07 passes this machine's)."""
    device_bytes: float = 80e9
    host_bytes: float = 256e9
    disk_bytes: float = 30e12
    device_flops: float = 300e12             # sustained bf16 FLOP/s (an assumption, not a datasheet peak)
    pcie: Link | str = DEFAULT_LINK
    network: Link | str = "InfiniBand NDR"
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


@dataclass(frozen=True)
class FitTerms:
    """The terms `fit_options` combines for a model of Ψ parameters on a machine (the formulas are there)."""
    acts: dict            # activation bytes on the device: {recompute?: bytes}
    compute: dict         # compute seconds per optimizer step: {recompute?: seconds}
    adam: float           # seconds of the CPU Adam step over Ψ
    zero3: int            # ZeRO-3 model-state bytes per rank
    comm: float           # ZeRO-3 network seconds per step
    disk: float           # SSD seconds per step: 12Ψ read and 12Ψ written


def fit_terms(psi: float, m: Machine) -> FitTerms:
    """Activation bytes, compute seconds, the CPU Adam step, ZeRO-3's bytes and traffic, the SSD's seconds."""
    shape = gpt_shape(psi)
    L, h, a = shape["n_layer"], shape["d_model"], shape["n_head"]
    s, b = m.seq_len, m.micro_batch_size
    layer = paper_activation_bytes(s, b, h, a)                 # sbh(34 + 5as/h), Korthikanti et al. Table 2
    acts = {False: L * layer, True: L * 2 * s * b * h + layer}
    tokens = s * m.sequences_per_step
    compute = {False: tokens * (6 * psi + 12 * L * s * h) / m.device_flops}
    compute[True] = compute[False] * 4 / 3
    adam = psi / (m.adam_per_core * m.host_cores)
    N = m.zero_ranks
    zero3 = sum(zero_state_bytes(int(psi), N, 3, param=2, grad=2, optim=12).values())
    comm = get_link(m.network).time(3 * (N - 1) / N * 2 * psi)
    disk = 12 * psi / m.disk_read + 12 * psi / m.disk_write
    return FitTerms(acts, compute, adam, zero3, comm, disk)


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
    t = fit_terms(psi, m)
    N = m.zero_ranks

    def offload(cpu, rc):
        compute = t.compute[rc]
        return zero_offload_step_time(compute / 3, 2 * compute / 3, cpu, int(psi), link=m.pcie, dpu=True)["total"]

    options = {
        "none": (lambda rc: 16 * psi + t.acts[rc], lambda rc: 0, lambda rc: 0, lambda rc: t.compute[rc], False),
        "recompute": (lambda rc: 16 * psi + t.acts[rc], lambda rc: 0, lambda rc: 0, lambda rc: t.compute[rc], True),
        f"ZeRO-3 ×{N}": (lambda rc: t.zero3 + t.acts[rc], lambda rc: 0, lambda rc: 0,
                         lambda rc: max(t.compute[rc], t.comm), None),
        "offload: host": (lambda rc: 2 * psi + t.acts[rc], lambda rc: 16 * psi, lambda rc: 0,
                          lambda rc: offload(t.adam, rc), None),
        "offload: SSD": (lambda rc: 2 * psi + t.acts[rc], lambda rc: 4 * psi, lambda rc: 12 * psi,
                         lambda rc: offload(max(t.adam, t.disk), rc), None),
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


__all__ = ["DEFAULT_LINK", "zero_offload_step_time", "Machine", "gpt_shape", "FitTerms", "fit_terms", "fit_options",
           "largest_fitting"]
