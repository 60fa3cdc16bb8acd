"""What the calculator is asked about: a decoder shape, a cluster, and one way to run the model on it.

    Decoder   layers, width, heads (and key/value heads), vocabulary, sequence, MLP width and kind, dense or MoE
              (routed and shared experts, their width, top-k, capacity factor, leading dense layers)
    Cluster   device memory, peak FLOP/s and memory bandwidth, devices per node, the intra- and inter-node links
    Job       global batch and micro-batch, precision recipe, ZeRO stage, dp/tp/pp/cp/ep, schedule, the layers of
              each pipeline stage (even, first and last lighter, or given), recomputation, offload — the names of
              `ParallelPlan`, which the course's real runs use
    RECIPES   precision recipes as data: bytes per parameter of weights, gradients, fp32 master and optimizer
              state, and the dtype gradients are reduced in

`validate(model, cluster, job, world)` is the one check every entry point goes through (`memory_per_device`,
`step_time`, the planner, notebook 13's widget): a bad input raises `CalculatorError` (a ValueError) with one line
naming what to change (formulas §15.6). The dataclasses check their own fields when made; `validate` checks that
they fit together. Nothing here computes a cost; `memory`, `step_time`, `planner` and `cost` do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..core.costmodel import Link, get_link

# The techniques' own names (parallel.pipeline.schedules.GENERATORS, memopt.recompute.POLICIES, memopt.precision
# RECIPES): the calculator imports without torch, so it cannot import them; tests/unit/test_vocabulary.py ties these.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")
RECOMPUTE = (None, "selective", "full")
OFFLOAD = (None, "optimizer", "optimizer+params")


@dataclass(frozen=True)
class Recipe:
    """A precision recipe: bytes per parameter of the compute weights, the gradients (as accumulated), the fp32
    master copy (0 where the weights are their own master) and the optimizer state; `reduce` the bytes per gradient
    element the data-parallel reduction sends; `activation` bytes per stored activation element."""
    params: int
    grads: int
    master: int
    optimizer: int
    reduce: int
    activation: int
    source: str
    gemm_speed: float = 1.0     # the layers' weight GEMMs run at this × the bf16 peak (FP8 on Hopper: 2)
    stored: int = 2             # bytes per activation element kept for backward (FP8 caching: 1)
    dispatch: int = 2           # bytes per element of the tokens an all-to-all dispatches to the experts
    gemm_bytes: int = 2         # bytes per element a weight GEMM reads and writes (FP8: 1)


RECIPES = {
    # Micikevicius et al., ICLR 2018 with Adam (Rajbhandari et al. SC'20 §3.1: 2 + 2 + (4 + 4 + 4) = 16 bytes)
    "bf16": Recipe(2, 2, 4, 8, 2, 2, "mixed precision: bf16 weights and gradients, fp32 master, Adam m and v"),
    "fp16": Recipe(2, 2, 4, 8, 2, 2, "as bf16, with loss scaling (Micikevicius et al. 2018)"),
    # Llama 3 §3.3.2: 'we accumulate gradients in FP32 … and reduce-scatter gradients in FP32'
    "bf16+fp32grads": Recipe(2, 4, 4, 8, 4, 2, "Llama 3 (arXiv 2407.21783 §3.3.2): bf16 weights, fp32 gradient "
                                               "accumulation and reduce-scatter, fp32 master, fp32 Adam"),
    # DeepSeek-V3 §3.3: FP8 GEMMs; master weights and gradients fp32 (accumulated), AdamW moments in bf16
    "fp8-deepseek": Recipe(2, 4, 4, 4, 4, 2, "DeepSeek-V3 (arXiv 2412.19437 §3.3): FP8 GEMMs in the layers, bf16 "
                                             "weights, fp32 gradients and master, bf16 AdamW moments; activations "
                                             "cached and tokens dispatched in FP8 (§3.3.3, §3.3.4)", gemm_speed=2.0,
                           stored=1, dispatch=1, gemm_bytes=1),
    "fp32": Recipe(4, 4, 0, 8, 4, 4, "fp32 Adam: the weights are their own master copy", stored=4, dispatch=4,
                   gemm_bytes=4),
}
PRECISIONS = {k: (r.params, r.grads, r.master + r.optimizer) for k, r in RECIPES.items()}  # ZeRO's three categories


class CalculatorError(ValueError):
    """An input the calculator cannot use; the message names the field and what to change."""


def _number_ok(v, integer: bool) -> bool:
    if isinstance(v, bool):
        return False
    if integer:
        return isinstance(v, int) and v > 0
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _positive(obj, *names, integer=True):
    for n in names:
        v = getattr(obj, n)
        if not _number_ok(v, integer):
            kind = "a positive integer" if integer else "a positive finite number"
            raise CalculatorError(f"{type(obj).__name__}.{n} must be {kind}, got {v!r}")


def _optional_positive(obj, *names, integer=True):
    for n in names:
        v = getattr(obj, n)
        if v is not None and not _number_ok(v, integer):
            kind = "a positive integer" if integer else "a positive finite number"
            raise CalculatorError(f"{type(obj).__name__}.{n} must be {kind} or None (the default), got {v!r}")


@dataclass(frozen=True)
class Decoder:
    """A decoder-only transformer. Defaults are GPT's: d_ff = 4·d_model, a GELU MLP (2 matrices), learned positions,
    biases, untied embeddings, n_kv_head = n_head. `gated_mlp` is SwiGLU (3 matrices). `n_expert` > 0 makes the MLP
    of every layer after the first `dense_layers` a mixture of `n_expert` routed experts of width `expert_ff`
    (default d_ff), `top_k` of which run per token, plus `shared_experts` that every token runs; tokens are
    dispatched with room for `capacity` × their fair share per expert, and, with `max_nodes`, to experts on at
    most that many nodes (DeepSeek-V3's node-limited routing: 4). `attention_params` states a layer's
    attention weights where they are not GQA's (e.g. DeepSeek's multi-head latent attention), `attention_width` the
    heads × mean of the query/key and value head widths that QKᵀ and A·V multiply over (default d_model)."""
    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    n_kv_head: int | None = None
    d_ff: int | None = None
    gated_mlp: bool = False
    n_expert: int = 0
    top_k: int = 1
    expert_ff: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    capacity: float = 1.0
    max_nodes: int | None = None
    attention_params: int | None = None
    attention_width: int | None = None
    learned_positions: bool = True
    tied_embeddings: bool = False
    dropout: bool = True               # Korthikanti's tables keep 1-byte dropout masks; Llama-style models have none

    def __post_init__(self):
        _positive(self, "n_layer", "d_model", "n_head", "vocab", "seq_len", "top_k")
        _optional_positive(self, "n_kv_head", "d_ff", "expert_ff", "attention_params", "attention_width", "max_nodes")
        _positive(self, "capacity", integer=False)
        for n in ("n_expert", "shared_experts", "dense_layers"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CalculatorError(f"Decoder {self.name}: {n} must be an integer ≥ 0, got {v!r}")
        if self.d_model % self.n_head:
            raise CalculatorError(f"Decoder {self.name}: d_model={self.d_model} is not a multiple of "
                                  f"n_head={self.n_head}; choose heads that divide the width")
        if self.n_head % self.kv_heads:
            raise CalculatorError(f"Decoder {self.name}: n_kv_head={self.kv_heads} must divide n_head={self.n_head}")
        if self.n_expert and self.top_k > self.n_expert:
            raise CalculatorError(f"Decoder {self.name}: top_k={self.top_k} > n_expert={self.n_expert}; route each "
                                  f"token to at most n_expert experts")
        if self.dense_layers > self.n_layer or (self.dense_layers or self.shared_experts) and not self.n_expert:
            raise CalculatorError(f"Decoder {self.name}: dense_layers and shared_experts describe a MoE model "
                                  f"(n_expert > 0) and dense_layers ≤ n_layer")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def expert_width(self) -> int:
        return self.expert_ff or self.ffn

    @property
    def score_width(self) -> int:
        return self.attention_width or self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def moe_layers(self) -> int:
        return self.n_layer - self.dense_layers if self.n_expert else 0

    def replace(self, **changes) -> Decoder:
        return replace(self, **changes)


def _check_link(owner: str, link: Link) -> None:
    for n in ("alpha", "bandwidth"):
        v = getattr(link, n)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (n == "bandwidth" and v == 0):
            raise CalculatorError(f"{owner}: link {link.name!r} needs a finite {n} "
                                  f"{'> 0 bytes/s' if n == 'bandwidth' else '≥ 0 s'}, got {v!r}")


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind: memory and peak FLOP/s per device, `devices_per_node` joined by `intra`, nodes joined by
    `inter` (one NIC's worth per device, as on Selene and Meta's H100 clusters). Links are `costmodel.Link` objects
    or names of `costmodel.PRESETS`; everything computed from them is *modeled*."""
    name: str
    device_memory: float
    peak_flops: float
    devices_per_node: int
    intra: Link | str
    inter: Link | str
    num_devices: int = 1 << 30         # how many there are (the planner stays within it)
    watts: float | None = None
    memory_bandwidth: float | None = None   # device memory (HBM) bytes/s; None: memory-bound ops not modelled
    comm_sm_share: float = 0.0              # share of the device's SMs a communication kernel takes while it
                                            # overlaps compute (DeepSeek-V3 §3.5.1: 20 of 132); 0: not stated

    def __post_init__(self):
        _positive(self, "devices_per_node", "num_devices")
        _positive(self, "device_memory", "peak_flops", integer=False)
        _optional_positive(self, "watts", "memory_bandwidth", integer=False)
        v = self.comm_sm_share
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise CalculatorError(f"Cluster {self.name}: comm_sm_share is a fraction of the SMs in [0, 1), got {v!r}")
        object.__setattr__(self, "intra", get_link(self.intra))
        object.__setattr__(self, "inter", get_link(self.inter))
        _check_link(f"Cluster {self.name}", self.intra)
        _check_link(f"Cluster {self.name}", self.inter)


@dataclass(frozen=True)
class Job:
    """One way to run a step: `batch` sequences per optimizer step over dp × cp data-parallel replicas, each split into
    micro-batches of `micro_batch` sequences; tp/pp/cp/ep as in `ParallelPlan` (ep inside dp). `chunks` is the
    interleaved schedule's virtual stages per rank. `stage_layers`: the layers of each of the pp × chunks (virtual)
    stages in pipeline order — None for an even split, "ends" for the first and last stage lighter (Llama 3 §3.3.2:
    'we reduce one Transformer layer each from the first and the last stages'; `ends_split`), or a tuple.
    `offload`: 'optimizer' moves the fp32 master and Adam state to the host (ZeRO-Offload), 'optimizer+params' also
    the parameters between uses (ZeRO-Infinity style). `overlap_ep`: the all-to-alls hide behind the other
    micro-batch's compute (DeepSeek's DualPipe) except where they are longer."""
    batch: int
    micro_batch: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    stage_layers: tuple | str | None = None
    sequence_parallel: bool = False
    recompute: str | None = None
    precision: str = "bf16"
    offload: str | None = None
    flash_attention: bool = False      # True: the s×s score maps are never stored (recomputed in backward)
    overlap_dp: bool = True            # False: gradients are reduced after the backward pass (Megatron-LM of 2021)
    overlap_ep: bool = False

    def __post_init__(self):
        _positive(self, "batch", "micro_batch", "dp", "tp", "pp", "cp", "ep", "chunks")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise CalculatorError(f"Job.zero is the ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE), ("offload", OFFLOAD),
                              ("precision", tuple(RECIPES))):
            if getattr(self, name) not in allowed:
                raise CalculatorError(f"Job.{name}={getattr(self, name)!r}: use one of {allowed}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise CalculatorError(f"Job.chunks={self.chunks} needs schedule='interleaved'; or use chunks=1")
        if self.dp % self.ep:
            raise CalculatorError(f"Job: ep={self.ep} must divide dp={self.dp} (experts spread over dp ranks)")
        sl = self.stage_layers
        if isinstance(sl, list):
            object.__setattr__(self, "stage_layers", sl := tuple(sl))
        if not (sl is None or sl == "ends" or isinstance(sl, tuple) and len(sl) == self.pp * self.chunks
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sl)):
            raise CalculatorError(f"Job.stage_layers={sl!r}: use None (even), 'ends' (first and last lighter) or "
                                  f"pp × chunks = {self.pp * self.chunks} layer counts ≥ 1")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel replica runs per step."""
        return self.batch // (self.dp * self.micro_batch)

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.precision]

    def describe(self) -> str:
        d = Job(batch=self.batch)
        parts = [f"dp{self.dp}·tp{self.tp}·pp{self.pp}" + (f"·cp{self.cp}" if self.cp > 1 else "")
                 + (f"·ep{self.ep}" if self.ep > 1 else ""), f"mb{self.micro_batch}"]
        parts += [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                  if f.name in ("zero", "schedule", "chunks", "stage_layers", "sequence_parallel", "recompute",
                                "offload", "precision") and getattr(self, f.name) != getattr(d, f.name)]
        return " ".join(parts)

    def replace(self, **changes) -> Job:
        return replace(self, **changes)


def ends_split(n_layer: int, stages: int) -> tuple:
    """`n_layer` layers on `stages` (virtual) stages, the first and last lighter: every stage gets ⌈L/S⌉ and the
    shortfall is taken one layer at a time from the ends inward (first, last, second, second-to-last, …) — Llama 3's
    126 = 32·4 − 2 gives (3, 4, …, 4, 3). Raises if a stage would be left empty."""
    base = -(-n_layer // stages)
    short = base * stages - n_layer
    out = [base] * stages
    order = [i for pair in zip(range(stages), range(stages - 1, -1, -1)) for i in pair]
    for i in order[:short]:
        out[i] -= 1
    if min(out) < 1 or sum(out) != n_layer:
        raise CalculatorError(f"{n_layer} layers cannot fill {stages} stages with the ends lighter; use fewer stages")
    return tuple(out)


def stage_layers(model: Decoder, job: Job) -> tuple:
    """The layers of each (virtual) stage in pipeline order: stage k runs on pipeline rank k mod pp."""
    S = job.pp * job.chunks
    sl = job.stage_layers
    if isinstance(sl, tuple):
        return sl
    if sl == "ends":
        return ends_split(model.n_layer, S)
    return (model.n_layer // S,) * S


def validate(model: Decoder, cluster: Cluster | None, job: Job, world: int | None = None) -> Job:
    """The one check of a (model, cluster, job): raise CalculatorError with one line saying what to change unless
    `job` can run `model` on `cluster` with `world` devices (default: job.world, which must fit in the cluster;
    cluster None: the model and the job only).
    Returns the job. `step_time`, `memory_per_device`, the planner and notebook 13's widget all call it."""
    for obj, cls in ((model, Decoder), (cluster, Cluster), (job, Job)):
        if not isinstance(obj, cls) and not (cls is Cluster and obj is None):
            raise CalculatorError(f"expected a {cls.__name__}, got {type(obj).__name__}: build one with "
                                  f"{cls.__name__}(...)")
    world = job.world if world is None else world
    if job.world != world:
        raise CalculatorError(f"dp × tp × pp × cp = {job.dp} × {job.tp} × {job.pp} × {job.cp} = {job.world}, but the "
                              f"world has {world} devices; choose sizes whose product is {world}")
    if cluster is not None and world > cluster.num_devices:
        raise CalculatorError(f"the job needs {world} devices but {cluster.name} has {cluster.num_devices}; use "
                              f"fewer, or a larger cluster")
    if model.n_head % job.tp or model.kv_heads % job.tp and job.tp % model.kv_heads:
        raise CalculatorError(f"tp={job.tp} does not divide the {model.n_head} heads (and {model.kv_heads} key/value "
                              f"heads) of {model.name}; use a tp that divides the heads")
    if model.ffn % job.tp or model.vocab % job.tp or model.n_expert and model.expert_width % job.tp:
        raise CalculatorError(f"tp={job.tp} must divide d_ff={model.ffn}, the experts' width {model.expert_width} "
                              f"and vocab={model.vocab} of {model.name}")
    S = job.pp * job.chunks
    if isinstance(job.stage_layers, tuple):
        if sum(job.stage_layers) != model.n_layer:
            raise CalculatorError(f"stage_layers add up to {sum(job.stage_layers)}, but {model.name} has "
                                  f"{model.n_layer} layers; give pp × chunks counts that sum to {model.n_layer}")
    elif job.stage_layers == "ends":
        ends_split(model.n_layer, S)
    elif model.n_layer % S:
        raise CalculatorError(f"pp × chunks = {job.pp} × {job.chunks} does not divide the {model.n_layer} layers of "
                              f"{model.name}; use stage_layers='ends' (first and last stage lighter), a tuple of "
                              f"layers per stage, or a pipeline depth that divides the layers")
    if model.seq_len % (job.cp * (2 if job.cp > 1 else 1)):
        raise CalculatorError(f"cp={job.cp}: the sequence of {model.seq_len} tokens must split into 2·cp zig-zag "
                              f"chunks; use a cp with seq_len % (2·cp) == 0")
    if job.ep > 1 and (not model.n_expert or model.n_expert % job.ep):
        raise CalculatorError(f"ep={job.ep} needs a MoE model whose n_expert ({model.n_expert}) it divides; use an "
                              f"ep that divides the routed experts")
    if job.sequence_parallel and job.tp == 1:
        raise CalculatorError("sequence_parallel splits the LayerNorm regions over tp, but tp=1; use tp ≥ 2")
    if job.batch % (job.dp * job.micro_batch):
        raise CalculatorError(f"the batch of {job.batch} sequences does not split into dp × micro_batch = "
                              f"{job.dp} × {job.micro_batch}; use a batch that is a multiple of "
                              f"{job.dp * job.micro_batch}")
    if job.pp > 1 and job.schedule == "interleaved" and job.microbatches % job.pp:
        raise CalculatorError(f"interleaved 1F1B runs micro-batches in rounds of pp={job.pp}: {job.microbatches} "
                              f"micro-batches per replica is not a multiple; change batch or micro_batch")
    if job.zero == 3 and job.pp > 1:
        raise CalculatorError("zero=3 inside a pipeline gathers every stage's parameters once per micro-batch; use "
                              "zero ≤ 2 with pp > 1 (as Megatron-LM and DeepSpeed do)")
    if job.offload and job.zero == 0 and job.dp > 1:
        raise CalculatorError("offload moves each rank's optimizer shard: use zero ≥ 1 with dp > 1")
    return job


check_job = validate            # the name notebooks and lab 13 have used


__all__ = ["Decoder", "Cluster", "Job", "Recipe", "RECIPES", "CalculatorError", "validate", "check_job", "ends_split",
           "stage_layers", "PRECISIONS", "SCHEDULES", "RECOMPUTE", "OFFLOAD"]
