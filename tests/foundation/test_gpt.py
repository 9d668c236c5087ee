"""The GPT is causal, sized from the config, and its layers are partition-independent."""
from __future__ import annotations

import torch
from torch import nn

from ds_recycle.config import GPTConfig, load_config
from ds_recycle.model import Block, gpt_layer_specs, gpt_loss_fn


def build(cfg: GPTConfig, seed: int = 0) -> nn.Sequential:
    layers = []
    for i, spec in enumerate(gpt_layer_specs(cfg)):
        torch.manual_seed(cfg.init_seed + i)
        layers.append(spec.build())
    return nn.Sequential(*layers)


def test_default_config_is_a_few_million_parameters(repo) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(repo / "configs" / "gpt_cpu_2x2.json").recycle.model
    n = sum(p.numel() for p in build(cfg).parameters())
    assert 1_000_000 < n < 10_000_000, n
    specs = gpt_layer_specs(cfg)
    assert sum(s.typename is Block for s in specs) == cfg.n_layer and len(specs) == cfg.n_layer + 2


def test_forward_is_causal_and_loss_is_near_uniform_at_init() -> None:
    cfg = GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4)
    model = build(cfg)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    logits2 = model(x2)
    assert torch.allclose(logits[:, :10], logits2[:, :10], atol=1e-6)  # the past ignores the future
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])
    loss = gpt_loss_fn(logits, torch.randint(0, 256, (2, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_layer_init_depends_only_on_seed_and_index() -> None:
    cfg = GPTConfig(seq_len=8, n_layer=2, d_model=16, n_head=2)
    a, b = build(cfg), build(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a[1].qkv.weight, a[2].qkv.weight)  # different layers, different seeds


def test_tied_embeddings_share_the_token_table_between_first_and_last_layer() -> None:
    from deepspeed.pipe import TiedLayerSpec

    from ds_recycle.model.gpt import Embedding, _tied_logits

    cfg = GPTConfig(seq_len=8, n_layer=2, d_model=16, n_head=2, tie_embeddings=True)
    specs = gpt_layer_specs(cfg)
    assert [type(s).__name__ for s in specs] == ["TiedLayerSpec", "LayerSpec", "LayerSpec", "LayerSpec",
                                                 "TiedLayerSpec"]
    first, last = specs[0], specs[-1]
    assert isinstance(first, TiedLayerSpec) and isinstance(last, TiedLayerSpec)
    assert first.key == last.key == "embed" and first.tied_weight_attr == ["tok.weight"]
    embedding = first.build()
    assert isinstance(embedding, Embedding)
    x = torch.randn(2, 8, 16)
    assert torch.equal(_tied_logits(embedding, x), x @ embedding.tok.weight.T)
