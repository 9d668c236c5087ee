"""Hardware and model profiles, and the per-stage cost model they imply. Every number has a source.

Units: seconds, bytes, FLOP. A *node* is `gpus_per_node` GPUs; one pipeline stage runs on one node,
tensor parallel inside it (so a worker of the plan is a node).

Costs per micro-batch of `b` sequences of `s` tokens, per transformer layer of hidden size `h`
(the FLOP counts of "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, section 5.1: forward `24 b s h^2 + 4 b s^2 h`, backward twice that):

- F = `24 b s h^2 + 4 b s^2 h`;
- B (input gradient) = `24 b s h^2 + 8 b s^2 h`: the activation-gradient half of every weight matmul
  plus both attention matmuls, which have no weights;
- W (weight gradient) = `24 b s h^2`: the weight half of every matmul. B + W = 2 F, and W is cheaper
  than B, as in the profiles of "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241);
- the language-model head (last stage) adds `2 b s h V` to F, to B and to W (V = vocabulary).

A FLOP count becomes time at `peak_tflops * mfu` per GPU times `gpus_per_node`. `comm` moves one
activation (`2 b s h` bytes, bf16) between nodes at `inter_node_gbs`. `O` all-reduces a stage's bf16
gradients over D replicas (ring: `2 (D-1)/D` times the bytes) and runs Adam over the stage's
parameters (reads and writes 16 bytes a parameter at HBM bandwidth). Model state is 16 bytes a
parameter (fp16 weights and gradients, fp32 master weights and two Adam moments: "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054, section 3.1).

Layers are split into contiguous stages that minimise the most expensive stage (the language-model
head counts towards the last stage), so a stage count that does not divide the layer count gives
unequal stages, as real partitions do.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ds_recycle.plan import CostModel
from ds_recycle.plan.partition import LayerCosts, Partition

__all__ = ["Hardware", "ModelProfile", "A100_NODE", "MODELS", "model_names", "get_model",
           "stage_layers", "stage_costs", "layer_costs", "base_partition", "BYTES_PER_PARAM"]

#: Mixed-precision Adam model state per parameter (ZeRO, arXiv 1910.02054, section 3.1).
BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class Hardware:
    """One node type of the cluster."""

    name: str
    gpus_per_node: int
    """GPUs in a node; a stage is tensor parallel over them."""
    peak_tflops: float
    """Dense bf16 peak per GPU (A100: 312 TFLOP/s, NVIDIA A100 Tensor Core GPU datasheet)."""
    mfu: float
    """Fraction of peak reached by F, B and W. Megatron-LM reaches 44-52% on A100 at scale
    (138-163 TFLOP/s per GPU, arXiv 2104.04473, Table 1); we take 0.45."""
    hbm_gbs: float
    """HBM bandwidth per GPU in GB/s (A100 80GB: 2039 GB/s, datasheet); bounds the optimizer step."""
    node_memory_gb: float
    """GPU memory of a node (8 x 80 GB)."""
    inter_node_gbs: float
    """Usable node-to-node bandwidth in GB/s: half of a DGX A100's 8 x 200 Gb/s HDR InfiniBand
    (200 GB/s, DGX A100 datasheet), a common efficiency for p2p and ring all-reduce."""
    storage_gbs: float
    """Checkpoint write/read bandwidth per node in GB/s to remote persistent storage: 20 Gb/s as
    measured for cloud storage in "GEMINI: Fast Failure Recovery in Distributed Training with
    In-Memory Checkpoints" (SOSP 2023), i.e. 2.5 GB/s."""
    node_start_s: float
    """From a trace 'add' to a node ready to work: 45 s, the spot-instance creation time of Oobleck's
    public simulator (SymbioticLab/Oobleck, tools/simulator, sosp23-artifact)."""


A100_NODE = Hardware(name="8xA100-80GB", gpus_per_node=8, peak_tflops=312.0, mfu=0.45,
                     hbm_gbs=2039.0, node_memory_gb=640.0, inter_node_gbs=100.0,
                     storage_gbs=2.5, node_start_s=45.0)


@dataclass(frozen=True)
class ModelProfile:
    """A GPT-3-style model (shapes from "Language Models are Few-Shot Learners", arXiv 2005.14165,
    Table 2.1) and the per-model recovery times that Oobleck's public simulator uses."""

    name: str
    layers: int
    hidden: int
    seq_len: int
    vocab: int
    global_batch: int
    """Sequences per iteration (GPT-3 Table 2.1 batch in tokens / 2048)."""
    reconfigure_s: float
    """Re-forming groups among survivors without a restart: Oobleck's simulator's 'local rendezvous'
    time for this model (3 s, 6 s, 10 s); used for Oobleck, ReCycle and replica dropping."""
    restart_s: float
    """Tearing down and restarting the job (launch, group init, load): the 'local rendezvous' time
    of the Bamboo/Varuna simulator in the same repository (100 s, 230 s, 450 s)."""

    @property
    def params(self) -> int:
        """Parameters: 12 h^2 per layer plus the token embedding (tied to the head)."""
        return 12 * self.layers * self.hidden ** 2 + self.vocab * self.hidden


MODELS: dict[str, ModelProfile] = {
    m.name: m for m in (
        ModelProfile("gpt3-medium", 24, 1024, 2048, 50257, 256, reconfigure_s=3.0, restart_s=100.0),
        ModelProfile("gpt3-2.7b", 32, 2560, 2048, 50257, 512, reconfigure_s=6.0, restart_s=230.0),
        ModelProfile("gpt3-6.7b", 32, 4096, 2048, 50257, 1024, reconfigure_s=10.0, restart_s=450.0),
    )
}


def model_names() -> list[str]:
    return sorted(MODELS)


def get_model(name: str) -> ModelProfile:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"--model {name!r} is unknown. Fix: one of {', '.join(model_names())}, "
                         "or --costs-file FILE") from None


def _layer_flops(m: ModelProfile, b: int) -> tuple[float, float, float]:
    s, h = m.seq_len, m.hidden
    return (24 * b * s * h * h + 4 * b * s * s * h,
            24 * b * s * h * h + 8 * b * s * s * h,
            24 * b * s * h * h)


def _head_flops(m: ModelProfile, b: int) -> float:
    return 2.0 * b * m.seq_len * m.hidden * m.vocab


@cache
def stage_layers(layers: int, stages: int, head_weight: float) -> tuple[int, ...]:
    """Layers per stage: contiguous, minimising the heaviest stage, the head weighing `head_weight`
    layers on the last stage. Raises ValueError if there are more stages than layers."""
    if not 1 <= stages <= layers:
        raise ValueError(f"stages={stages} for a {layers}-layer model. Fix: 1 <= stages <= {layers}")
    best: tuple[float, tuple[int, ...]] | None = None
    base = layers // stages
    # Moving layers off the last stage is the only freedom that matters with one heavy end.
    for last in range(1, base + 2):
        rest = layers - last
        if rest < stages - 1 or (stages == 1 and rest):
            continue
        split = [rest // (stages - 1) + (1 if i < rest % (stages - 1) else 0)
                 for i in range(stages - 1)] if stages > 1 else []
        loads = [float(x) for x in split] + [last + head_weight]
        cand = (max(loads), tuple(split + [last]))
        if best is None or cand[0] < best[0]:
            best = cand
    assert best is not None
    return best[1]


def stage_costs(m: ModelProfile, hw: Hardware, stages: int, pipelines: int,
                micro_batch: int) -> CostModel:
    """The planner's cost model of `m` split over `stages` nodes, `pipelines` replicas a stage."""
    rate = hw.peak_tflops * 1e12 * hw.mfu * hw.gpus_per_node
    f1, b1, w1 = _layer_flops(m, micro_batch)
    head = _head_flops(m, micro_batch)
    split = stage_layers(m.layers, stages, head / f1)
    fs, bs, ws, os_ = [], [], [], []
    for i, n in enumerate(split):
        extra = head if i == stages - 1 else 0.0
        fs.append((n * f1 + extra) / rate)
        bs.append((n * b1 + extra) / rate)
        ws.append((n * w1 + extra) / rate)
        params = n * 12 * m.hidden ** 2 + (m.vocab * m.hidden if i in (0, stages - 1) else 0)
        grad_bytes = 2.0 * params
        ring = 2.0 * (pipelines - 1) / pipelines * grad_bytes / (hw.inter_node_gbs * 1e9)
        step = 2.0 * BYTES_PER_PARAM * params / (hw.hbm_gbs * 1e9 * hw.gpus_per_node)
        os_.append(ring + step)
    comm = 2.0 * micro_batch * m.seq_len * m.hidden / (hw.inter_node_gbs * 1e9)
    return CostModel(F=tuple(fs), B=tuple(bs), W=tuple(ws), O=tuple(os_), comm=comm)


def layer_costs(m: ModelProfile, hw: Hardware, pipelines: int, micro_batch: int) -> LayerCosts:
    """Per-layer costs as a ``PipelineModule`` lists them: the token embedding (parameters, no compute
    counted), every transformer layer, the language-model head (its compute; its weights tied to the embedding,
    so a copy lives on the last stage as DeepSpeed's ``TiedLayerSpec`` keeps it). ``O`` and the moved state
    follow each layer's parameters as :func:`stage_costs` counts them; a move runs at ``inter_node_gbs``."""
    rate = hw.peak_tflops * 1e12 * hw.mfu * hw.gpus_per_node
    f1, b1, w1 = (x / rate for x in _layer_flops(m, micro_batch))
    head = _head_flops(m, micro_batch) / rate
    block, edge = 12 * m.hidden ** 2, m.vocab * m.hidden

    def o(params: int) -> float:
        ring = 2.0 * (pipelines - 1) / pipelines * 2.0 * params / (hw.inter_node_gbs * 1e9)
        return ring + 2.0 * BYTES_PER_PARAM * params / (hw.hbm_gbs * 1e9 * hw.gpus_per_node)

    n = m.layers
    return LayerCosts(F=(0.0, *[f1] * n, head), B=(0.0, *[b1] * n, head), W=(0.0, *[w1] * n, head),
                      O=(o(edge), *[o(block)] * n, o(edge)),
                      state_bytes=(float(BYTES_PER_PARAM * edge), *[float(BYTES_PER_PARAM * block)] * n,
                                   float(BYTES_PER_PARAM * edge)),
                      bandwidth=hw.inter_node_gbs * 1e9,
                      comm=2.0 * micro_batch * m.seq_len * m.hidden / (hw.inter_node_gbs * 1e9))


def base_partition(m: ModelProfile, stages: int, micro_batch: int) -> Partition:
    """The partition :func:`stage_costs` assumes, over :func:`layer_costs`' layers (embedding first, head last)."""
    f1 = _layer_flops(m, micro_batch)[0]
    split = stage_layers(m.layers, stages, _head_flops(m, micro_batch) / f1)
    parts = [0, 1 + split[0]]
    for n in split[1:]:
        parts.append(parts[-1] + n)
    parts[-1] += 1
    return tuple(parts)
