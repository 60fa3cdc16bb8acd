"""Modeled seconds per training step, broken into compute, exposed communication per mesh axis and the pipeline
bubble, with MFU and HFU (formulas §15.3–15.4). Everything here is *modeled*: peak FLOP/s and link rates are
stated figures, and the only free numbers are the `Efficiency` constants, each fitted on one stated published row.

FLOPs per token (forward; Narayanan et al. SC'21 eq. 2–3 generalised to GQA, gated MLPs and MoE):

    per layer   2·(Q, K, V, O and active MLP weights) + 4·s·d   (QKᵀ and A·V over all s keys)
    LM head     2·d·V
    model       3 × forward                                     (MFU counts these; Korthikanti et al. §6)
    hardware    + one more forward of the layers (full recomputation) or + 4·s·d per layer (selective) (HFU)

Step = t_compute × pipeline factor + exposed communication, where

    t_compute         hardware FLOPs per device ÷ (peak × e(d/tp)),  e(x) = e_compute · x/(x + x½),
                      + the score maps' memory traffic ÷ the device's memory bandwidth (no flash attention:
                      softmax and dropout over a·s² elements per layer, `score_map_bytes`)
    pipeline factor   makespan ÷ (M·(F + B)) from notebook 05's simulator (F = 1, B = 2); 1 with pp = 1
    tp                4 all-reduces of b·s·d per layer and micro-batch (SP: 4 all-gathers + 4 reduce-scatters,
                      the same bytes; + 2 all-reduces when full recomputation reruns the forward, + 1 all-gather
                      when selective recomputation regathers SP's input); not overlapped
    pp                2 transfers of b·s·d/tp per micro-batch and chunk (Megatron's scatter/gather)
    cp                all-gather of K and V per layer forward, reduce-scatter of their gradients backward
    dp                ZeRO 0–2: one all-reduce of the gradients (or reduce-scatter + all-gather: the same bytes),
                      overlapped with the last micro-batch's backward (or, `overlap_dp=False`, after it);
                      ZeRO-3: all-gather ×2 + reduce-scatter per
                      micro-batch, overlapped with that micro-batch's compute (prefetch)

Each collective uses the ring times of `costmodel` on the link its group spans: `intra` if the group's devices sit
in one node (mesh order pp × dp × cp × tp, tp innermost), else `inter`, with bandwidth × e_network.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

from ..core.costmodel import Link, ring_all_gather_time, ring_all_reduce_time
from ..parallel.pipeline.schedules import bubble_formula, make_schedule, simulate
from .config import PRECISIONS, Cluster, Decoder, Job
from .memory import device_params, layer_params, param_count


@dataclass(frozen=True)
class Efficiency:
    """The calculator's free constants (formulas §15.5): `compute`, the fraction of peak FLOP/s large matmuls reach;
    `half_width`, the local matmul width d/tp at which they reach half of it (smaller GEMMs run less efficiently:
    e(x) = compute · x/(x + half_width)); `network`, the fraction of a link's line rate a collective reaches.
    `fitted_on` names the published row each was fitted on."""
    compute: float = 1.0
    network: float = 1.0
    half_width: float = 0.0
    fitted_on: tuple = ()

    def matmul(self, width: float) -> float:
        return self.compute * width / (width + self.half_width)

    def replace(self, **changes) -> "Efficiency":
        return replace(self, **changes)


IDEAL = Efficiency()


# ============================================================================================ FLOPs
def forward_flops_per_token(m: Decoder, seq_len: int | None = None) -> dict:
    s = seq_len or m.seq_len
    lp = layer_params(m)
    active_mlp = lp["mlp"] / max(1, m.n_expert) * (m.top_k if m.n_expert else 1)
    layer = 2 * (lp["attention"] + active_mlp + lp["router"]) + 4 * s * m.d_model
    return {"layers": m.n_layer * layer, "head": 2 * m.d_model * m.vocab, "attention": m.n_layer * 4 * s * m.d_model}


def flops_per_token(m: Decoder, recompute: str | None = None) -> dict:
    """{'model': 3·forward, 'hardware': + what recomputation reruns} FLOPs per token of one training step."""
    f = forward_flops_per_token(m)
    model = 3 * (f["layers"] + f["head"])
    extra = {None: 0, "full": f["layers"], "selective": f["attention"]}[recompute]
    return {"model": model, "hardware": model + extra}


def narayanan_flops(m: Decoder, batch: int) -> float:
    """Narayanan et al. SC'21 eq. (3), the FLOPs per iteration behind their Table 1 and 2 (with recomputation):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    B, s, l, h, V = batch, m.seq_len, m.n_layer, m.d_model, m.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


# ============================================================================================ memory-bound ops
def score_map_bytes(m: Decoder, job: Job) -> float:
    """Device-memory bytes the s×s score maps move per device per step without flash attention (Korthikanti
    §4.1's tensors, 2-byte scores and probabilities, 1-byte dropout mask, per head and sequence):

        forward    softmax reads QKᵀ, writes P (2 + 2); dropout reads P, writes its mask and output (2 + 1 + 2)
                   = 9·a·s²  (4·a·s² without dropout)
        backward   dropout's reads the gradient and the mask, writes (2 + 1 + 2); softmax's reads the gradient
                   and P, writes (2 + 2 + 2) = 11·a·s²  (6·a·s² without dropout)
        recompute  full or selective recomputation runs the forward's again: + 9·a·s² (+ 4)

    Heads split over tp, queries over cp (each rank's s/cp queries against all s keys); layers over pp."""
    if job.flash_attention:
        return 0.0
    fwd, bwd = (9, 11) if m.dropout else (4, 6)
    per = fwd + bwd + (fwd if job.recompute in ("full", "selective") else 0)
    sequences = job.batch / job.dp
    return per * m.n_head / job.tp * (m.seq_len / job.cp) * m.seq_len * sequences * m.n_layer / job.pp


def score_map_seconds(m: Decoder, job: Job, cluster: Cluster) -> float:
    """`score_map_bytes` at the device's memory bandwidth (0 where the cluster states none): elementwise kernels
    that do no matmul work, so no share of peak FLOP/s describes them."""
    return score_map_bytes(m, job) / cluster.memory_bandwidth if cluster.memory_bandwidth else 0.0


# ============================================================================================ the pipeline
SIMULATE_UP_TO = 256
@lru_cache(maxsize=4096)
def pipeline_factor(schedule: str, S: int, M: int, v: int = 1) -> float:
    """Makespan of one step's schedule ÷ the work of one rank (M·(F + B), F = 1, B = 2): 1 + bubble/(1 − bubble).
    Simulated (notebook 05) for S·M·v ≤ SIMULATE_UP_TO; beyond, the closed form of docs/formulas.md §3 that the
    simulator equals exactly (tests/unit/test_pipeline_schedules.py; rechecked in test_calculator_step_time.py)."""
    if S == 1:
        return 1.0
    if S * M * v <= SIMULATE_UP_TO:
        tl = simulate(make_schedule(schedule, S, M, v))
        end = max(t1 for ops in tl for _, _, t1 in ops)
        return float(Fraction(end) / (3 * M))
    b = bubble_formula(schedule if M >= S else "1f1b", S, M, v)
    return float(1 / (1 - b))


# ============================================================================================ links
def _spans_nodes(group: int, stride: int, cluster: Cluster) -> bool:
    return group > 1 and group * stride > cluster.devices_per_node


def axis_link(axis: str, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> Link:
    """The link an axis's collective runs over (its slowest hop), at e_network × line rate."""
    stride = {"tp": 1, "cp": job.tp, "dp": job.tp * job.cp, "pp": job.tp * job.cp * job.dp}[axis]
    size = {"tp": job.tp, "cp": job.cp, "dp": job.dp, "pp": job.pp}[axis]
    link = cluster.inter if _spans_nodes(size, stride, cluster) else cluster.intra
    return replace(link, bandwidth=link.bandwidth * eff.network)


# ============================================================================================ the step
def step_time(m: Decoder, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> dict:
    """Modeled seconds of one optimizer step, by part, with MFU and HFU (module docstring)."""
    w_b, g_b, _ = PRECISIONS[job.precision]
    act_b = 2 if job.precision != "fp32" else 4
    M, b = job.microbatches, job.micro_batch
    s_loc = m.seq_len // job.cp
    tokens = job.batch * m.seq_len
    fl = flops_per_token(m, job.recompute)
    compute = fl["hardware"] * tokens / job.world / (cluster.peak_flops * eff.matmul(m.d_model / job.tp))
    compute += score_map_seconds(m, job, cluster)
    layers = m.n_layer // job.pp
    factor = pipeline_factor(job.schedule, job.pp, M, job.chunks) if job.pp > 1 else 1.0
    parts = {"compute": compute, "bubble": compute * (factor - 1)}

    # tensor parallelism: per layer and micro-batch
    tp_t = 0.0
    if job.tp > 1:
        link = axis_link("tp", job, cluster, eff)
        S = b * s_loc * m.d_model * act_b
        n_ar = 4 + (2 if job.recompute == "full" else 0)
        per = n_ar * ring_all_reduce_time(link, S, job.tp)
        if job.sequence_parallel and job.recompute == "selective":
            per += ring_all_gather_time(link, S, job.tp)
        tp_t = per * layers * M
    parts["tp"] = tp_t

    # pipeline boundaries
    pp_t = 0.0
    if job.pp > 1:
        link = axis_link("pp", job, cluster, eff)
        pp_t = 2 * M * job.chunks * link.time(b * s_loc * m.d_model * act_b / job.tp)
    parts["pp"] = pp_t

    # context parallelism: K and V all-gathered forward, their gradients reduce-scattered backward
    cp_t = 0.0
    if job.cp > 1:
        link = axis_link("cp", job, cluster, eff)
        kv = 2 * b * m.seq_len * m.kv_heads * m.head_dim // job.tp * act_b
        cp_t = 2 * ring_all_gather_time(link, kv, job.cp) * layers * M
    parts["cp"] = cp_t

    # data parallelism (over dp × cp replicas)
    dp_t = 0.0
    N = job.dp * job.cp
    psi = device_params(m, job)
    if N > 1:
        link = axis_link("dp", job, cluster, eff) if job.dp > 1 else axis_link("cp", job, cluster, eff)
        per_mb_compute = (compute + parts["bubble"]) / M
        if job.zero == 3:
            comm_mb = 3 * ring_all_gather_time(link, psi * w_b, N)
            dp_t = M * max(0.0, comm_mb - per_mb_compute)
        else:
            comm = ring_all_reduce_time(link, psi * g_b, N)
            dp_t = max(0.0, comm - per_mb_compute * 2 / 3) if job.overlap_dp else comm
    parts["dp"] = dp_t

    # optimizer offload: the weights go down and the gradients up the host link each step (ZeRO-Offload, §6)
    off_t = 0.0
    if job.offload:
        from ..memopt.memory_fit import Machine, zero_offload_step_time
        mach = Machine()
        shard = psi // (N if job.zero >= 1 else 1)
        cpu = shard / (mach.adam_per_core * mach.host_cores)
        off = zero_offload_step_time(0.0, 0.0, cpu, shard, link=mach.pcie, dpu=False)
        off_t = off["total"]
    parts["offload"] = off_t

    total = sum(parts.values())
    world_flops = job.world * cluster.peak_flops
    return {"parts": parts, "total": total,
            "mfu": fl["model"] * tokens / (total * world_flops), "hfu": fl["hardware"] * tokens / (total * world_flops),
            "tokens_per_s": tokens / total, "flops_per_token": fl, "params": param_count(m)}


__all__ = ["Efficiency", "IDEAL", "score_map_bytes", "score_map_seconds", "forward_flops_per_token", "flops_per_token",
           "narayanan_flops", "pipeline_factor",
           "axis_link", "step_time"]
