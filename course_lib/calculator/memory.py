"""Memory per device, by category, for a decoder run as a `Job` on a `Cluster` (formulas §15.1–15.2).

Model states are ZeRO's (`parallel.zero.model_state_bytes`, Rajbhandari et al. SC'20 §5): with b_w, b_g, b_o bytes
per parameter for weights, gradients and optimizer state (`config.PRECISIONS`; mixed-precision Adam 2 + 2 + 12),
a device holding Ψ_d parameters keeps b_w·Ψ_d (÷N at stage 3), b_g·Ψ_d (÷N at stage ≥ 2), b_o·Ψ_d (÷N at stage ≥ 1),
N = dp·cp the replicas that share them.

Activations per layer are Korthikanti et al.'s (MLSys'23 §4, Table 2), built term by term so that every row of
their Table 2 falls out (16-bit activations, 1-byte dropout masks, s tokens, b sequences, h width, a heads, t = tp):

    replicated by TP (÷t only with SP)   LayerNorm inputs 4sbh, attention and MLP inputs 2sbh + 2sbh,
                                         two dropout masks sbh + sbh                                     = 10sbh
    split by TP (÷t)                     Q, K, V 6sbh, attention output 2sbh, MLP 16sbh                   = 24sbh/t
    score maps (÷t)                      softmax 2as²b, its dropout mask as²b and output 2as²b             = 5as²b/t
    selective recomputation drops the score maps; full recomputation keeps only the layer input 2sbh

With GQA, a gated MLP, MoE (top_k routed copies of the MLP terms), flash attention (no score maps) or CP (each rank
holds s/cp tokens) the same terms are scaled; with no dropout the masks go. A pipeline stage holds its layers'
activations for every micro-batch in flight (`parallel.pipeline.schedules.in_flight`: 1F1B's first stage holds
pp, GPipe all M).
"""
from __future__ import annotations

from functools import lru_cache

from ..parallel.pipeline.schedules import in_flight, make_schedule
from ..parallel.zero import model_state_bytes
from .config import PRECISIONS, Cluster, Decoder, Job

ACT = 2          # bytes of a 16-bit activation


# ============================================================================================ parameters
def layer_params(m: Decoder) -> dict:
    """Parameters of one block: attention (Q, O: d×d; K, V: d×d_kv), MLP (2 or 3 matrices of d×d_ff, × n_expert),
    router, and the small ones (biases and LayerNorms; Megatron-style models have biases, `learned_positions`
    stands for that family)."""
    d, dkv, f = m.d_model, m.kv_heads * m.head_dim, m.ffn
    mats = 3 if m.gated_mlp else 2
    experts = max(1, m.n_expert)
    small = (2 * d + 2 * dkv + f + d if m.learned_positions else 0) + 4 * d
    return {"attention": 2 * d * d + 2 * d * dkv, "mlp": experts * mats * d * f,
            "router": d * m.n_expert, "small": small}


def param_count(m: Decoder) -> int:
    """All parameters: L blocks, the token (and position) embedding, the final norm and the LM head (if untied)."""
    emb = m.vocab * m.d_model + (m.seq_len * m.d_model if m.learned_positions else 0)
    head = 0 if m.tied_embeddings else m.vocab * m.d_model
    return m.n_layer * sum(layer_params(m).values()) + emb + head + 2 * m.d_model


def device_params(m: Decoder, job: Job) -> int:
    """Parameters on the busiest device: its pp stage's blocks ÷ tp (experts ÷ ep), plus the embedding on the first
    stage or the head on the last (÷ tp, vocab-parallel); the larger of the two ends."""
    lp = layer_params(m)
    per_layer = (lp["attention"] + lp["mlp"] / job.ep) / job.tp + lp["router"] + lp["small"]
    layers = m.n_layer / job.pp
    emb = (m.vocab * m.d_model) / job.tp + (m.seq_len * m.d_model if m.learned_positions else 0)
    head = 0 if (m.tied_embeddings and job.pp == 1) else m.vocab * m.d_model / job.tp
    ends = emb + head if job.pp == 1 else max(emb, head)
    return int(layers * per_layer + ends)


def model_states(psi: int, shards: int, zero: int, precision: str = "bf16") -> dict:
    """ZeRO's model states per device in bytes, by category (`parallel.zero.model_state_bytes` with the recipe's
    bytes per parameter)."""
    w, g, o = PRECISIONS[precision]
    return model_state_bytes(int(psi), shards, zero, param=w, grad=g, optim=o)


# ============================================================================================ activations
def layer_activation_terms(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False, recompute=None,
                           kv_ratio: float = 1.0, ffn_ratio: float = 4.0, gated: bool = False, top_k: int = 1,
                           dropout: bool = True, flash: bool = False) -> dict:
    """Bytes one transformer layer keeps for backward on one device, term by term (module docstring)."""
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


def layer_activation_bytes(m: Decoder, job: Job) -> float:
    """One layer's activations on one device, for this model and job (s = seq_len/cp tokens per rank)."""
    s = m.seq_len // job.cp
    terms = layer_activation_terms(
        s, job.micro_batch, m.d_model, m.n_head, job.tp, sp=job.sequence_parallel, recompute=job.recompute,
        kv_ratio=m.kv_heads / m.n_head, ffn_ratio=m.ffn / m.d_model, gated=m.gated_mlp,
        top_k=m.top_k if m.n_expert else 1, dropout=m.dropout, flash=job.flash_attention)
    if job.cp > 1 and "score maps" in terms:       # each rank's s/cp queries attend over all s keys
        terms["score maps"] *= job.cp
    return sum(terms.values())


@lru_cache(maxsize=4096)
def _in_flight(schedule: str, S: int, M: int, v: int) -> int:
    """Micro-batch × chunk activations the busiest rank holds (notebook 05's schedule, `in_flight`)."""
    if S == 1:
        return 1
    if S * M * v <= 256:
        return max(in_flight(make_schedule(schedule, S, M, v)))
    # closed forms of the same generators (checked against in_flight in tests/unit/test_calculator_memory.py)
    if schedule == "gpipe":
        return M
    if schedule == "interleaved":
        return min(M * v, (v - 1) * S + 2 * (S - 1) + 1)
    return min(S, M)


def in_flight_microbatches(job: Job) -> float:
    """How many micro-batches' worth of one stage's activations the first stage holds at its peak."""
    S, M, v = job.pp, job.microbatches, job.chunks
    return _in_flight(job.schedule if S > 1 else "1f1b", S, M, v) / v


def activation_bytes(m: Decoder, job: Job) -> float:
    """Activations on the first pipeline stage (the busiest): in-flight micro-batches × its layers × per layer, plus
    the embedding output (or, with pp = 1, the logits in fp32 for the loss: 4·s·b·V/t)."""
    layers = m.n_layer / job.pp
    s, b = m.seq_len // job.cp, job.micro_batch
    embedding_out = ACT * s * b * m.d_model / (job.tp if job.sequence_parallel else 1)
    per_mb = layers * layer_activation_bytes(m, job) + embedding_out
    if job.pp == 1:
        per_mb += 4 * s * b * m.vocab / job.tp
    return in_flight_microbatches(job) * per_mb


# ============================================================================================ the whole device
def memory_per_device(m: Decoder, job: Job, cluster: Cluster | None = None) -> dict:
    """Bytes per device by category on the device, what offload keeps on the host, the total and whether it fits
    the cluster's device memory."""
    psi = device_params(m, job)
    states = model_states(psi, job.dp * job.cp, job.zero, job.precision)
    host = {}
    if job.offload:                                   # ZeRO-Offload: fp32 master + Adam state live on the host
        host["optimizer"] = states.pop("optimizer")
        states["optimizer"] = 0
        if job.offload == "optimizer+params":         # only one layer's weights at a time on the device
            host["parameters"] = states["parameters"]
            states["parameters"] = int(states["parameters"] * job.pp / m.n_layer)
    out = dict(states, activations=activation_bytes(m, job))
    total = sum(out.values())
    res = {"device": out, "host": host, "total": total, "params_per_device": psi}
    if cluster is not None:
        res["capacity"] = cluster.device_memory
        res["fits"] = total <= cluster.device_memory
    return res


def checkpoint_bytes(m: Decoder, job: Job) -> int:
    """Bytes of one full checkpoint (all ranks together): the weights in the compute dtype plus the optimizer state
    (fp32 master and Adam moments), i.e. (b_w + b_o)·Ψ — 14Ψ for mixed-precision Adam, 12Ψ for fp32 Adam;
    gradients are not saved."""
    w, _, o = PRECISIONS[job.precision]             # fp32: 4 + 8 (the weights are their own master copy)
    return int((w + o) * param_count(m))


__all__ = ["layer_params", "param_count", "device_params", "model_states", "layer_activation_terms",
           "layer_activation_bytes", "in_flight_microbatches", "activation_bytes", "memory_per_device",
           "checkpoint_bytes"]
