"""A decoder-only transformer written for DeepSpeed's pipeline partitioner.

The model is ``[Embedding, Block x n_layer, Head]``: token and position embeddings, pre-norm blocks
of causal self-attention and an MLP, a final LayerNorm and the LM head (with ``tie_embeddings``:
``[Embedding, Block x n_layer, LayerNorm, Embedding]``, the last computing the logits from the token table
it shares with the first, as a ``TiedLayerSpec``). Each entry is a
``LayerSpec``, so only the layers of a worker's own stage are ever built. Partitioning with
``"type:Block"`` balances the blocks over the stages; the embedding joins the first stage and the
head the last.

Parameter names are the pipeline module's (``"<layer index>.<name>"``), identical under DeepSpeed's
engine and ds_recycle's, so final parameter files can be compared by name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ds_recycle.config import GPTConfig

__all__ = ["Block", "Embedding", "Head", "build_pipeline_module", "gpt_layer_specs", "gpt_loss_fn"]


class Embedding(nn.Module):
    """Token ids ``[b, t]`` -> residual stream ``[b, t, d_model]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)[None]


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.proj, self.out):  # residual projections scaled down with depth, as in GPT-2
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v)]
        q, k, v = heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the LM head: ``[b, t, d_model]`` -> logits ``[b, t, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _tied_logits(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The LM head of a tied model: logits from the token embedding's own table."""
    return F.linear(x, embedding.tok.weight)


def gpt_layer_specs(cfg: GPTConfig) -> list[LayerSpec]:
    """The model as DeepSpeed layer specs, in order. With ``tie_embeddings`` the first and the last layer are
    ``TiedLayerSpec("embed", Embedding)`` (the last computing the logits from its token table) and the final
    LayerNorm is a layer of its own before it."""
    blocks = [LayerSpec(Block, cfg) for _ in range(cfg.n_layer)]
    if not cfg.tie_embeddings:
        return [LayerSpec(Embedding, cfg), *blocks, LayerSpec(Head, cfg)]
    return [TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tok.weight"), *blocks,
            LayerSpec(nn.LayerNorm, cfg.d_model),
            TiedLayerSpec("embed", Embedding, cfg, forward_fn=_tied_logits, tied_weight_attr="tok.weight")]


def _seed_layer(seed: int) -> None:
    """DeepSpeed's ``seed_fn``: it runs at each layer's build and before each layer's forward.

    With an accelerator this is ``torch.manual_seed`` (every device's generator). Without one, only the CPU
    generator: ``torch.manual_seed`` would also queue a seed for each accelerator backend that is not initialised,
    formatting a stack trace each time (a millisecond or more from a worker's deep stack, against a microsecond),
    for devices that never start. Same CPU generator state either way. (DeepSpeed passes a numpy integer.)
    """
    value = int(seed)
    if torch.cuda.is_available():
        torch.manual_seed(value)
    else:
        torch.default_generator.manual_seed(value)


def build_pipeline_module(cfg: GPTConfig, num_stages: int, **kwargs: object) -> PipelineModule:
    """DeepSpeed's ``PipelineModule`` over the GPT (needs an initialised process group).

    Each layer is seeded with ``cfg.init_seed + layer index``, so a layer's initial weights do not
    depend on the partition, the rank or the engine.
    """
    return PipelineModule(layers=gpt_layer_specs(cfg), num_stages=num_stages, loss_fn=gpt_loss_fn,
                          partition_method="type:Block", seed_layers=True, seed_fn=_seed_layer,
                          base_seed=cfg.init_seed,
                          **kwargs)
