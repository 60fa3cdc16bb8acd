"""Memory per device, by category, for a decoder run as a `Job` on a `Cluster` (formulas §15.1–15.2).

Model states are ZeRO's (Rajbhandari et al. SC'20 §5; the same formula as `parallel.zero.zero_state_bytes`, which
the tests check this against, written here over a precision recipe so that the calculator imports no torch): with
b_w, b_g bytes per parameter for weights and gradients and b_o for the fp32 master plus the optimizer state
(`config.RECIPES`; mixed-precision Adam 2 + 2 + (4 + 8)), a device holding Ψ_d parameters keeps b_w·Ψ_d (÷N at
stage 3), b_g·Ψ_d (÷N at stage ≥ 2), b_o·Ψ_d (÷N at stage ≥ 1). N = dp·cp replicas share the dense weights; an
expert's weights are replicated only over the expert-data-parallel group, N/ep (ep inside dp).

Activations per layer are Korthikanti et al.'s (MLSys'23 §4, Table 2), built term by term so that every row of
their Table 2 falls out (16-bit activations, 1-byte dropout masks, s tokens, b sequences, h width, a heads, t = tp):

    replicated by TP (÷t only with SP)   LayerNorm inputs 4sbh, attention and MLP inputs 2sbh + 2sbh,
                                         two dropout masks sbh + sbh                                     = 10sbh
    split by TP (÷t)                     Q, K, V 6sbh, attention output 2sbh, MLP 16sbh                   = 24sbh/t
    score maps (÷t)                      softmax 2as²b, its dropout mask as²b and output 2as²b             = 5as²b/t
    selective recomputation drops the score maps; full recomputation keeps only the layer input 2sbh

With GQA, a gated MLP, MoE (top_k × capacity routed copies plus the shared experts' of the MLP terms, at the
experts' width), flash attention (no score maps) or CP (each rank holds s/cp tokens) the same terms are scaled;
with no dropout the masks go; a recipe that caches activations in FP8 (`Recipe.stored` = 1) halves them all.

Pipeline stages may be uneven (`config.stage_layers`): every pipeline rank is counted — its layers (dense and MoE),
the embedding on the first, the LM head and the logits on the last — and the busiest rank is reported. A rank holds
its layers' activations for every micro-batch in flight (closed forms of notebook 05's schedules, checked against
`parallel.pipeline.schedules.in_flight` rank by rank in the tests):

    GPipe  M      1F1B, ZB-H1  min(S − r, M)      interleaved  min(M·v, (v − 1)·S + 2·(S − r − 1) + 1) chunks
"""
from __future__ import annotations

from functools import lru_cache

from .config import RECIPES, Cluster, Decoder, Job, stage_layers, validate

ACT = 2          # bytes of a 16-bit activation


# ============================================================================================ parameters
def layer_params(m: Decoder, moe: bool | None = None) -> dict:
    """Parameters of one block: attention (Q, O: d×d; K, V: d×d_kv, or `attention_params`), MLP (2 or 3 matrices of
    d×d_ff; in a MoE layer, n_expert routed experts of width expert_ff), shared experts, router, and the small ones
    (biases and LayerNorms; Megatron-style models have biases, `learned_positions` stands for that family).
    `moe`: a MoE layer (default: whether the model has experts)."""
    moe = bool(m.n_expert) if moe is None else moe
    d, dkv = m.d_model, m.kv_heads * m.head_dim
    mats = 3 if m.gated_mlp else 2
    f = m.expert_width if moe else m.ffn
    small = (2 * d + 2 * dkv + f + d if m.learned_positions else 0) + 4 * d
    return {"attention": m.attention_params or 2 * d * d + 2 * d * dkv,
            "mlp": (m.n_expert if moe else 1) * mats * d * f,
            "shared": (m.shared_experts * mats * d * f) if moe else 0,
            "router": d * m.n_expert if moe else 0, "small": small}


def param_count(m: Decoder) -> int:
    """All parameters: L blocks, the token (and position) embedding, the final norm and the LM head (if untied)."""
    emb = m.vocab * m.d_model + (m.seq_len * m.d_model if m.learned_positions else 0)
    head = 0 if m.tied_embeddings else m.vocab * m.d_model
    dense, moe = m.n_layer - m.moe_layers, m.moe_layers
    return (dense * sum(layer_params(m, False).values()) + moe * sum(layer_params(m, True).values())
            + emb + head + 2 * m.d_model)


@lru_cache(maxsize=8192)
def ranks(m: Decoder, job: Job) -> tuple:
    """Per pipeline rank r: (dense layers, MoE layers, holds the embedding, holds the LM head). Virtual stage k runs
    on rank k mod pp; layers 0 … dense_layers−1 are the dense ones."""
    out = [[0, 0, r == 0, r == job.pp - 1] for r in range(job.pp)]
    first = 0
    for k, n in enumerate(stage_layers(m, job)):
        dense = max(0, min(first + n, m.dense_layers) - first) if m.n_expert else n
        out[k % job.pp][0] += dense
        out[k % job.pp][1] += n - dense
        first += n
    return tuple(tuple(r) for r in out)


def rank_params(m: Decoder, job: Job, r: int) -> tuple[float, float]:
    """(dense, expert) parameters on a device of pipeline rank r: its blocks ÷ tp (routed experts ÷ ep·tp), the
    embedding on the first rank and the head on the last (÷ tp, vocab-parallel; with pp > 1 a tied head is a copy)."""
    n_dense, n_moe, emb_here, head_here = ranks(m, job)[r]
    t = job.tp
    dense = n_dense * _dense_part(layer_params(m, False), t)
    expert = 0.0
    if n_moe:
        lp = layer_params(m, True)
        dense += n_moe * _dense_part(lp, t)
        expert = n_moe * lp["mlp"] / (job.ep * t)
    if emb_here:
        dense += m.vocab * m.d_model / t + (m.seq_len * m.d_model if m.learned_positions else 0)
    if head_here and not (m.tied_embeddings and job.pp == 1):
        dense += m.vocab * m.d_model / t
    return dense, expert


def _dense_part(lp: dict, t: int) -> float:
    moe = lp["router"] > 0
    return (lp["attention"] + lp["shared"] + (0 if moe else lp["mlp"])) / t + lp["router"] + lp["small"]


def device_params(m: Decoder, job: Job) -> int:
    """Parameters on the device of the rank holding the most."""
    return int(max(sum(rank_params(m, job, r)) for r in range(job.pp)))


def model_states(psi: float, shards: int, zero: int, precision: str = "bf16", expert_psi: float = 0,
                 expert_shards: int = 1) -> dict:
    """ZeRO's model states per device in bytes, by category (module docstring): `psi` dense parameters shared by
    `shards` replicas, `expert_psi` expert parameters shared by `expert_shards`."""
    rc = RECIPES[precision]
    out = {}
    for name, b, from_stage in (("parameters", rc.params, 3), ("gradients", rc.grads, 2),
                                ("optimizer", rc.master + rc.optimizer, 1)):
        n, ne = (shards, expert_shards) if zero >= from_stage else (1, 1)
        out[name] = int(b * psi) // n + int(b * expert_psi) // ne
    return out


# ============================================================================================ activations
def layer_activation_terms(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False, recompute=None,
                           kv_ratio: float = 1.0, ffn_ratio: float = 4.0, gated: bool = False, top_k: float = 1,
                           dropout: bool = True, flash: bool = False) -> dict:
    """Bytes one transformer layer keeps for backward on one device, term by term (module docstring); `top_k`: the
    copies of the MLP's tensors a token makes (routed × capacity + shared in a MoE layer)."""
    sbh = s * b * h
    rep = 1 / t if sp else 1                              # what SP splits: the LayerNorm/dropout regions
    if recompute == "full":
        return {"layer input": 2 * sbh * rep}
    mlp_wide = ffn_ratio * (3 if gated else 2) * ACT * top_k      # fc_in output and activation output (GELU: 8 + 8)
    out = {
        "LayerNorm inputs": 4 * sbh * rep,
        "attention/MLP inputs": (2 + 2 * top_k) * sbh * rep,
        "dropout masks": (1 + top_k) * sbh * rep if dropout else 0,
        "Q, K, V": (2 + 4 * kv_ratio) * sbh / t,
        "attention output": 2 * sbh / t,
        "MLP": mlp_wide * sbh / t,
        "score maps": 0 if (recompute == "selective" or flash) else (5 if dropout else 2) * a * s * s * b / t,
    }
    return out


def layer_activation_bytes(m: Decoder, job: Job, moe: bool | None = None) -> float:
    """One layer's activations on one device, for this model and job (s = seq_len/cp tokens per rank)."""
    moe = bool(m.n_expert) if moe is None else moe
    s = m.seq_len // job.cp
    copies = m.top_k * m.capacity + m.shared_experts if moe else 1
    width = m.expert_width if moe else m.ffn
    terms = layer_activation_terms(
        s, job.micro_batch, m.d_model, m.n_head, job.tp, sp=job.sequence_parallel, recompute=job.recompute,
        kv_ratio=m.kv_heads / m.n_head, ffn_ratio=width / m.d_model, gated=m.gated_mlp, top_k=copies,
        dropout=m.dropout, flash=job.flash_attention)
    if job.cp > 1 and "score maps" in terms:       # each rank's s/cp queries attend over all s keys
        terms["score maps"] *= job.cp
    return sum(terms.values()) * RECIPES[job.precision].stored / ACT     # the terms are counted at 16 bits


def in_flight_chunks(schedule: str, S: int, M: int, v: int, r: int) -> int:
    """Micro-batch × chunk activations pipeline rank r holds at its peak (module docstring's closed forms)."""
    if S == 1:
        return 1
    if schedule == "gpipe":
        return M
    if schedule == "interleaved":
        return min(M * v, (v - 1) * S + 2 * (S - r - 1) + 1)
    return min(S - r, M)


def in_flight_microbatches(job: Job, r: int = 0) -> float:
    """How many micro-batches' worth of its layers' activations pipeline rank r holds at its peak."""
    return in_flight_chunks(job.schedule, job.pp, job.num_microbatches, job.chunks, r) / job.chunks


def rank_activation_bytes(m: Decoder, job: Job, r: int) -> float:
    """Activations on pipeline rank r: in-flight micro-batches × (its layers' activations, + the embedding output on
    the first rank, + the fp32 logits for the loss on the last: 4·s·b·V/t). With interleaving a rank's chunks are
    counted at their mean size."""
    n_dense, n_moe, emb_here, head_here = ranks(m, job)[r]
    s, b = m.seq_len // job.cp, job.micro_batch
    per_mb = n_dense * layer_activation_bytes(m, job, False) if n_dense else 0.0
    if n_moe:
        per_mb += n_moe * layer_activation_bytes(m, job, True)
    if emb_here:
        per_mb += ACT * s * b * m.d_model / (job.tp if job.sequence_parallel else 1)
    held = in_flight_microbatches(job, r) * per_mb
    if head_here:
        held += 4 * s * b * m.vocab / job.tp          # one micro-batch's logits at a time
    return held


def activation_bytes(m: Decoder, job: Job) -> float:
    """Activations on the rank that holds the most."""
    return max(rank_activation_bytes(m, job, r) for r in range(job.pp))


# ============================================================================================ the whole device
def rank_memory(m: Decoder, job: Job, r: int) -> dict:
    """Bytes on a device of pipeline rank r by category, and what offload keeps on the host."""
    dense, expert = rank_params(m, job, r)
    N = job.dp * job.cp
    states = model_states(dense, N, job.zero, job.precision, expert, N // job.ep)
    host = {}
    if job.offload:                                   # ZeRO-Offload: fp32 master + Adam state live on the host
        host["optimizer"] = states.pop("optimizer")
        states["optimizer"] = 0
        if job.offload == "optimizer+params":         # only one layer's weights at a time on the device
            layers = max(1, sum(ranks(m, job)[r][:2]))
            host["parameters"] = states["parameters"]
            states["parameters"] = int(states["parameters"] / layers)
    device = dict(states, activations=rank_activation_bytes(m, job, r))
    return {"device": device, "host": host, "total": sum(device.values()), "params_per_device": int(dense + expert)}


def memory_per_device(m: Decoder, job: Job, cluster: Cluster | None = None) -> dict:
    """Bytes per device by category on the busiest pipeline rank (`stage`), what offload keeps on the host, the
    total, every rank's total (`per_stage`) and whether it fits the cluster's device memory. Goes through
    `config.validate`."""
    validate(m, cluster, job)
    per = [rank_memory(m, job, r) for r in range(job.pp)]
    r = max(range(job.pp), key=lambda i: per[i]["total"])
    res = dict(per[r], stage=r, per_stage=[p["total"] for p in per])
    if cluster is not None:
        res["capacity"] = cluster.device_memory
        res["fits"] = res["total"] <= cluster.device_memory
    return res


def checkpoint_bytes(m: Decoder, job: Job) -> int:
    """Bytes of one full checkpoint (all ranks together): the weights in the compute dtype plus the fp32 master and
    the optimizer state — 14Ψ for mixed-precision Adam, 12Ψ for fp32 Adam; gradients are not saved."""
    rc = RECIPES[job.precision]
    return int((rc.params + rc.master + rc.optimizer) * param_count(m))


__all__ = ["layer_params", "param_count", "ranks", "rank_params", "device_params", "model_states",
           "layer_activation_terms", "layer_activation_bytes", "in_flight_chunks", "in_flight_microbatches",
           "rank_activation_bytes", "activation_bytes", "rank_memory", "memory_per_device", "checkpoint_bytes"]
