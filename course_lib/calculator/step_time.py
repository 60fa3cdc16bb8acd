"""Modeled seconds per training step, broken into compute, exposed communication per mesh axis and the pipeline
bubble, with MFU and HFU (formulas §15.3–15.4). Everything here is *modeled*: peak FLOP/s and link rates are
stated figures, and the only free numbers are the `Efficiency` constants, each fitted on one stated published row.

FLOPs per token (forward; Narayanan et al. SC'21 eq. 2–3 generalised to GQA, gated MLPs and MoE):

    per layer   2·(Q, K, V, O and active MLP weights: top_k routed + shared experts) + 4·s·w (QKᵀ and A·V;
                w = d, or the heads' width where it differs, as in DeepSeek's MLA)
    LM head     2·d·V
    model       3 × forward                                     (MFU counts these; Korthikanti et al. §6)
    hardware    + one more forward of the layers (full recomputation) or + 4·s·d per layer (selective) (HFU)

Step = pipeline time + exposed communication, where, per micro-batch, virtual stage k takes

    t_k         its layers' weight GEMMs, each on a roofline (`gemm_seconds`): the larger of its FLOPs at
                peak·e(d/tp) × the recipe's `gemm_speed` (FP8: 2) and the bytes it moves at the memory bandwidth —
                so a GEMM of few rows (an expert's share of a small micro-batch) is memory-bound; + QKᵀ and A·V
                (and the head on the last stage) at peak·e(d/tp),
                e(x) = e_compute · x/(x + x½), + its layers' score-map traffic ÷ memory bandwidth (no flash
                attention: softmax and dropout over a·s² elements per layer, `score_map_bytes`)
    pipeline    M·W_max + φ·(Σ_k t_k − W_max)/v,  W_r = Σ of rank r's stages (k ≡ r mod pp), φ = 1 (GPipe,
                1F1B, interleaved) or 1/3 (ZB-H1, whose fill is one F of three units); with fewer micro-batches than
                stages, interleaved is a flow shop of v·pp stages, Σ t_k + (M − 1)·max t_k, and ZB-H1 takes
                2/3·M·W_max + (2·Σ t_k − W_max)/3 (its 2M + 2pp − 1 units). With equal stages
                this is docs/formulas.md §3's makespan exactly; with unequal ones the slowest rank sets the steady
                state and every stage's time the fill — checked against notebook 05's simulator with per-stage
                costs in the tests. `compute` is the mean rank's M·W, `bubble` the rest (idle and imbalance).
    tp          4 all-reduces of b·s·d per layer and micro-batch (SP: 4 all-gathers + 4 reduce-scatters,
                the same bytes; + 2 all-reduces when full recomputation reruns the forward, + 1 all-gather
                when selective recomputation regathers SP's input), for every layer of the busiest rank
    ep          4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and backward; + 2 when
                full recomputation reruns the forward), each device sending its tokens' top_k · capacity copies of
                d activations over the link the ep group spans, node-limited routing counted
                (`moe_all_to_all_seconds`); `overlap_ep` hides them behind another micro-batch's MoE layer
                (DualPipe) except where they are longer
    pp          2 transfers of b·s·d/tp per micro-batch and chunk (Megatron's scatter/gather)
    optimizer   Adam's step reads and writes per parameter of the device's shard the gradient, master, moments
                and weights (bf16 recipe: 2 + 2·4 + 2·8 + 2 = 28 bytes) at the memory bandwidth
    overlap     communication hidden behind compute still holds the SMs its kernels run on: compute slows by the
                cluster's stated `comm_sm_share` of the hidden time (DeepSeek-V3: 20 of 132 SMs; 0 where unstated)
    cp          all-gather of K and V per layer forward, reduce-scatter of their gradients backward
    dp          ZeRO 0–2: one all-reduce of the dense gradients over dp·cp and one of the experts' over the
                expert-data-parallel group dp·cp/ep, in the recipe's reduction dtype, overlapped with the last
                micro-batch's backward (or, `overlap_dp=False`, after it); ZeRO-3: all-gather ×2 + reduce-scatter
                per micro-batch, overlapped with that micro-batch's compute (prefetch); the busiest rank's

Each collective uses the ring times of `costmodel` on the link its group spans: `intra` if the group's devices sit
in one node (mesh order pp × dp × cp × tp, tp innermost; ep = consecutive dp ranks), else `inter`, with bandwidth ×
e_network. Every entry point goes through `config.validate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from ..core.costmodel import Link, ring_all_gather_time, ring_all_reduce_time
from .config import RECIPES, CalculatorError, Cluster, Decoder, Job, validate
from .memory import layer_params, param_count, rank_params, ranks, stage_layers


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

    def __post_init__(self):
        for name, low in (("compute", 0.0), ("network", 0.0), ("half_width", None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or (v <= low if low is not None else v < 0):
                raise CalculatorError(f"Efficiency.{name} must be a finite number "
                                      f"{'> 0' if low is not None else '≥ 0'}, got {v!r}")

    def matmul(self, width: float) -> float:
        return self.compute * width / (width + self.half_width)

    def replace(self, **changes) -> Efficiency:
        return replace(self, **changes)


IDEAL = Efficiency()


# ============================================================================================ FLOPs
def layer_weight_flops(m: Decoder, moe: bool) -> float:
    """Forward FLOPs per token of one layer's weight GEMMs: 2 × the weights a token meets."""
    lp = layer_params(m, moe)
    active = lp["mlp"] / m.n_expert * m.top_k if moe else lp["mlp"]
    return 2 * (lp["attention"] + active + lp["shared"] + lp["router"])


def layer_forward_flops(m: Decoder, moe: bool, seq_len: int | None = None) -> float:
    """Forward FLOPs per token of one layer (module docstring): the weight GEMMs + QKᵀ and A·V over s keys."""
    return layer_weight_flops(m, moe) + 4 * (seq_len or m.seq_len) * m.score_width


def forward_flops_per_token(m: Decoder, seq_len: int | None = None) -> dict:
    s = seq_len or m.seq_len
    moe = m.moe_layers
    layers = (m.n_layer - moe) * layer_forward_flops(m, False, s) + (moe * layer_forward_flops(m, True, s) if moe
                                                                      else 0)
    return {"layers": layers, "head": 2 * m.d_model * m.vocab, "attention": m.n_layer * 4 * s * m.score_width}




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
def layer_score_map_bytes(m: Decoder, job: Job) -> float:
    """Device-memory bytes one layer's s×s score maps move per device and micro-batch without flash attention
    (Korthikanti §4.1's tensors, 2-byte scores and probabilities, 1-byte dropout mask, per head and sequence):

        forward    softmax reads QKᵀ, writes P (2 + 2); dropout reads P, writes its mask and output (2 + 1 + 2)
                   = 9·a·s²  (4·a·s² without dropout)
        backward   dropout's reads the gradient and the mask, writes (2 + 1 + 2); softmax's reads the gradient
                   and P, writes (2 + 2 + 2) = 11·a·s²  (6·a·s² without dropout)
        recompute  full or selective recomputation runs the forward's again: + 9·a·s² (+ 4)

    Heads split over tp, queries over cp (each rank's s/cp queries against all s keys)."""
    if job.flash_attention:
        return 0.0
    fwd, bwd = (9, 11) if m.dropout else (4, 6)
    per = fwd + bwd + (fwd if job.recompute in ("full", "selective") else 0)
    return per * m.n_head / job.tp * (m.seq_len / job.cp) * m.seq_len * job.micro_batch


def score_map_bytes(m: Decoder, job: Job) -> float:
    """`layer_score_map_bytes` over a step of the mean pipeline rank: × layers ÷ pp × micro-batches."""
    return layer_score_map_bytes(m, job) * m.n_layer / job.pp * job.microbatches


def score_map_seconds(m: Decoder, job: Job, cluster: Cluster) -> float:
    """`score_map_bytes` at the device's memory bandwidth (0 where the cluster states none): elementwise kernels
    that do no matmul work, so no share of peak FLOP/s describes them."""
    return score_map_bytes(m, job) / cluster.memory_bandwidth if cluster.memory_bandwidth else 0.0


# ============================================================================================ the pipeline
def pipeline_time(schedule: str, stage_times, pp: int, M: int) -> float:
    """Makespan of M micro-batches through (virtual) stages taking `stage_times` each per micro-batch, stage k on
    rank k mod pp (module docstring): M·W_max + φ·(Σ t_k − W_max)/v."""
    t = list(stage_times)
    v = len(t) // pp
    work = [sum(t[r::pp]) for r in range(pp)]
    w = max(work)
    if pp == 1:
        return M * w
    if M < pp and schedule == "interleaved":        # no micro-batch meets its own next chunk: a flow shop of v·pp
        return sum(t) + (M - 1) * max(t)
    if M < pp and schedule == "zb_h1":              # the W ops fill less than a full drain: 2M + 2pp − 1 units
        return Fraction(2, 3) * M * w + (2 * sum(t) - w) / 3
    phi = Fraction(1, 3) if schedule == "zb_h1" else 1
    return M * w + phi * (sum(t) - w) / v


def pipeline_factor(schedule: str, S: int, M: int, v: int = 1) -> float:
    """Makespan of one step's schedule with equal stages ÷ the work of one rank: 1 + bubble/(1 − bubble) of
    docs/formulas.md §3 (equal to notebook 05's simulator, tests/unit/test_calculator_step_time.py)."""
    if S == 1:
        return 1.0
    return float(pipeline_time(schedule, [Fraction(1)] * (S * v), S, M) / M / v)


# ============================================================================================ links
def _spans_nodes(group: int, stride: int, cluster: Cluster) -> bool:
    return group > 1 and group * stride > cluster.devices_per_node


AXIS_STRIDE = {"tp": lambda j: 1, "cp": lambda j: j.tp, "dp": lambda j: j.tp * j.cp, "ep": lambda j: j.tp * j.cp,
               "edp": lambda j: j.tp * j.cp * j.ep, "pp": lambda j: j.tp * j.cp * j.dp}
AXIS_SIZE = {"tp": lambda j: j.tp, "cp": lambda j: j.cp, "dp": lambda j: j.dp, "ep": lambda j: j.ep,
             "edp": lambda j: j.dp // j.ep, "pp": lambda j: j.pp}


def axis_link(axis: str, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> Link:
    """The link an axis's collective runs over (its slowest hop), at e_network × line rate."""
    link = cluster.inter if _spans_nodes(AXIS_SIZE[axis](job), AXIS_STRIDE[axis](job), cluster) else cluster.intra
    return replace(link, bandwidth=link.bandwidth * eff.network)


def all_to_all_time(link: Link, nbytes: float, p: int) -> float:
    """A pairwise all-to-all of `nbytes` per device over p ranks: each sends (p − 1)/p of it, one message per peer,
    the sends in flight together (α·(p − 1) + (p − 1)/p·S·β)."""
    if p == 1:
        return 0.0
    return link.alpha * (p - 1) + (p - 1) / p * nbytes / link.bandwidth


def moe_all_to_all_seconds(m: Decoder, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> float:
    """Seconds of one MoE layer's all-to-alls per micro-batch on one device: dispatch and combine forward, their
    gradients backward (+ dispatch and combine again under full recomputation). Each device sends its
    b·s/cp tokens (÷ tp with SP) × top_k × capacity copies of d elements — dispatched at the recipe's `dispatch`
    bytes, the rest at its activation bytes. Inside a node the group runs on `intra`; across nodes, on `inter`,
    where with node-limited routing (`max_nodes`) a token crosses to at most max_nodes nodes (one copy each, the
    fan-out inside the target node on NVLink, overlapped with it: DeepSeek-V3 §3.2.2) and otherwise every copy
    bound for another node crosses."""
    rc = RECIPES[job.precision]
    local = job.micro_batch * m.seq_len / job.cp / (job.tp if job.sequence_parallel else 1)
    copies = m.top_k * m.capacity
    per_elem = [rc.dispatch, rc.activation, rc.activation, rc.activation] + (
        [rc.dispatch, rc.activation] if job.recompute == "full" else [])
    stride = AXIS_STRIDE["ep"](job)
    intra = replace(cluster.intra, bandwidth=cluster.intra.bandwidth * eff.network)
    if not _spans_nodes(job.ep, stride, cluster):
        return sum(all_to_all_time(intra, local * copies * m.d_model * e, job.ep) for e in per_elem)
    inter = axis_link("ep", job, cluster, eff)
    nodes = job.ep * stride // cluster.devices_per_node
    crossing = min(copies, m.max_nodes) if m.max_nodes else copies
    total = 0.0
    for e in per_elem:
        over_ib = local * crossing * m.d_model * e * (nodes - 1) / nodes
        ib = inter.alpha * (nodes - 1) + over_ib / inter.bandwidth
        nvl = all_to_all_time(intra, local * copies * m.d_model * e, min(job.ep, cluster.devices_per_node))
        total += max(ib, nvl) if m.max_nodes else ib
    return total


# ============================================================================================ the step
def layer_gemms(m: Decoder, job: Job, moe: bool) -> list:
    """One layer's weight GEMMs on one device per micro-batch, forward, as (rows, k, n, count): the attention
    projections and the dense MLP over the device's b·s/cp tokens; in a MoE layer the device's n_expert/ep routed
    experts, each over the ep group's tokens × top_k ÷ n_expert, the shared experts and the router. Widths ÷ tp.
    2·Σ rows·k·n·count = `layer_weight_flops` × tokens ÷ tp."""
    tokens = job.micro_batch * m.seq_len / job.cp
    d, t = m.d_model, job.tp
    lp = layer_params(m, moe)
    mats = 3 if m.gated_mlp else 2
    out = [(tokens, d, lp["attention"] / d / t, 1)]
    if not moe:
        return out + [(tokens, d, mats * m.ffn / t, 1)]
    out.append((tokens * m.top_k * job.ep / m.n_expert, d, mats * m.expert_width / t, m.n_expert / job.ep))
    if m.shared_experts:
        out.append((tokens, d, m.shared_experts * mats * m.expert_width / t, 1))
    return out + [(tokens, d, m.n_expert / t, 1)]


def gemm_seconds(gemms, rate: float, elem: int, bandwidth: float | None) -> float:
    """A roofline per GEMM: the larger of its FLOPs at `rate` and the bytes it reads and writes (inputs, weights,
    outputs: elem·(rows·k + k·n + rows·n)) at the device's memory bandwidth (Williams et al., CACM 2009)."""
    total = 0.0
    for rows, k, n, count in gemms:
        flops = 2 * rows * k * n * count / rate
        moved = elem * (rows * k + k * n + rows * n) * count / bandwidth if bandwidth else 0.0
        total += max(flops, moved)
    return total


def stage_times(m: Decoder, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> tuple:
    """Seconds per micro-batch of each virtual stage's compute (module docstring), and (dense, MoE) per layer."""
    rc = RECIPES[job.precision]
    tokens = job.micro_batch * m.seq_len / job.cp
    rate = cluster.peak_flops * eff.matmul(m.d_model / job.tp)
    smap = layer_score_map_bytes(m, job) / cluster.memory_bandwidth if cluster.memory_bandwidth else 0.0
    core = 4 * m.seq_len * m.score_width * tokens / job.tp / rate    # QKᵀ and A·V: bf16 in every recipe
    passes = {None: (3, 3), "selective": (3, 4), "full": (4, 4)}[job.recompute]   # (weight GEMMs, core) forwards
    per = {}
    for moe in ((False, True) if m.n_expert else (False,)):
        fwd = gemm_seconds(layer_gemms(m, job, moe), rate * rc.gemm_speed, rc.gemm_bytes, cluster.memory_bandwidth)
        per[moe] = passes[0] * fwd + passes[1] * core + smap
    rate = rate * job.tp
    head = 3 * 2 * m.d_model * m.vocab * tokens / rate
    out, first = [], 0
    for n in stage_layers(m, job):
        dense = max(0, min(first + n, m.dense_layers) - first) if m.n_expert else n
        out.append(dense * per[False] + ((n - dense) * per[True] if n > dense else 0.0))
        first += n
    out[-1] += head
    return tuple(out), per


def step_time(m: Decoder, job: Job, cluster: Cluster, eff: Efficiency = IDEAL) -> dict:
    """Modeled seconds of one optimizer step, by part, with MFU and HFU (module docstring)."""
    validate(m, cluster, job)
    rc = RECIPES[job.precision]
    act_b = rc.activation
    M, b = job.microbatches, job.micro_batch
    s_loc = m.seq_len // job.cp
    tokens = job.batch * m.seq_len
    fl = flops_per_token(m, job.recompute)

    times, per_layer = stage_times(m, job, cluster, eff)
    work = [sum(times[r::job.pp]) for r in range(job.pp)]
    busy = max(range(job.pp), key=work.__getitem__)
    n_dense, n_moe = ranks(m, job)[busy][:2]
    makespan = float(pipeline_time(job.schedule, times, job.pp, M))
    compute = M * sum(work) / job.pp
    parts = {"compute": compute, "bubble": makespan - compute}

    # tensor parallelism: per layer and micro-batch, every layer of the busiest rank
    tp_t = 0.0
    if job.tp > 1:
        link = axis_link("tp", job, cluster, eff)
        S = b * s_loc * m.d_model * act_b
        n_ar = 4 + (2 if job.recompute == "full" else 0)
        per = n_ar * ring_all_reduce_time(link, S, job.tp)
        if job.sequence_parallel and job.recompute == "selective":
            per += ring_all_gather_time(link, S, job.tp)
        tp_t = per * (n_dense + n_moe) * M
    parts["tp"] = tp_t

    # expert parallelism: the all-to-alls of every MoE layer of the busiest rank
    ep_t, hidden = 0.0, 0.0                # hidden: communication overlapped with compute, seconds
    if job.ep > 1 and n_moe:
        a2a = moe_all_to_all_seconds(m, job, cluster, eff)
        exposed = max(0.0, a2a - per_layer[True]) if job.overlap_ep else a2a
        ep_t = exposed * n_moe * M
        hidden += (a2a - exposed) * n_moe * M
    parts["ep"] = ep_t

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
        kv = 2 * b * m.seq_len * m.kv_heads * m.head_dim / job.tp * act_b
        cp_t = 2 * ring_all_gather_time(link, kv, job.cp) * (n_dense + n_moe) * M
    parts["cp"] = cp_t

    # data parallelism (over dp × cp replicas; the experts' over dp × cp / ep)
    N = job.dp * job.cp
    dp_t = 0.0
    if N > 1:
        dense_link = axis_link("dp", job, cluster, eff) if job.dp > 1 else axis_link("cp", job, cluster, eff)
        edp_link = axis_link("edp", job, cluster, eff)
        per_mb_compute = makespan / M
        worst, worst_hidden = 0.0, 0.0
        for r in range(job.pp):
            dense, expert = rank_params(m, job, r)
            if job.zero == 3:
                comm_mb = 3 * (ring_all_gather_time(dense_link, dense * rc.params, N)
                               + (ring_all_gather_time(edp_link, expert * rc.params, N // job.ep) if expert else 0))
                t = M * max(0.0, comm_mb - per_mb_compute)
                h = M * comm_mb - t
            else:
                comm = (ring_all_reduce_time(dense_link, dense * rc.reduce, N)
                        + (ring_all_reduce_time(edp_link, expert * rc.reduce, N // job.ep) if expert else 0))
                t = max(0.0, comm - per_mb_compute * 2 / 3) if job.overlap_dp else comm
                h = comm - t
            if t > worst or (t == worst and h > worst_hidden):
                worst, worst_hidden = t, h
        dp_t = worst
        hidden += worst_hidden
    parts["dp"] = dp_t

    # the optimizer step: the bytes Adam reads and writes for this device's shard at the memory bandwidth
    opt_t = 0.0
    if cluster.memory_bandwidth and not job.offload:
        per_param = rc.grads + 2 * (rc.master or rc.params) + 2 * rc.optimizer + (rc.params if rc.master else 0)
        shard = 0.0
        for r in range(job.pp):
            dense, expert = rank_params(m, job, r)
            shard = max(shard, dense / (N if job.zero >= 1 else 1) + expert / (N // job.ep if job.zero >= 1 else 1))
        opt_t = per_param * shard / cluster.memory_bandwidth
    parts["optimizer"] = opt_t

    # compute slowed while communication it overlaps holds the device's SMs (where the cluster states the share)
    parts["overlap"] = cluster.comm_sm_share * hidden

    # optimizer offload: the weights go down and the gradients up the host link each step (ZeRO-Offload, §6)
    off_t = 0.0
    if job.offload:
        from ..memopt.memory_fit import Machine, zero_offload_step_time  # torch only where offload is asked for
        mach = Machine()
        shard = max(sum(rank_params(m, job, r)) for r in range(job.pp)) // (N if job.zero >= 1 else 1)
        cpu = shard / (mach.adam_per_core * mach.host_cores)
        off = zero_offload_step_time(0.0, 0.0, cpu, shard, link=mach.pcie, dpu=False)
        off_t = off["total"]
    parts["offload"] = off_t

    total = sum(parts.values())
    world_flops = job.world * cluster.peak_flops
    return {"parts": parts, "total": total, "stage_times": times, "busiest_rank": busy,
            "mfu": fl["model"] * tokens / (total * world_flops), "hfu": fl["hardware"] * tokens / (total * world_flops),
            "tokens_per_s": tokens / total, "flops_per_token": fl, "params": param_count(m)}


__all__ = ["Efficiency", "IDEAL", "layer_forward_flops", "layer_score_map_bytes", "score_map_bytes",
           "score_map_seconds", "layer_weight_flops", "forward_flops_per_token", "flops_per_token", "narayanan_flops",
           "pipeline_time", "pipeline_factor", "axis_link", "all_to_all_time", "moe_all_to_all_seconds", "layer_gemms",
           "gemm_seconds", "stage_times", "step_time"]
