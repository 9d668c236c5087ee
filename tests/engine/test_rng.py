"""Per-micro-batch RNG: masks depend on (seed, step, pipeline, index, stage) only, and the outer stream is kept."""
from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from itertools import product

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from ds_recycle.engine.rng import micro_batch_rng, micro_batch_seed

Key = tuple[int, int, int, int]  # (step, pipeline, index, stage)
SEED = 1234


def dropout_mask(key: Key, seed: int = SEED, p: float = 0.5, n: int = 256) -> torch.Tensor:
    """The mask ``nn.Dropout`` (train mode) draws for ``key``."""
    drop = torch.nn.Dropout(p).train()
    with micro_batch_rng(seed, *key, device="cpu"):
        return drop(torch.ones(n)) != 0


KEYS: list[Key] = list(product(range(3), range(2), range(3), range(2)))


def test_masks_do_not_depend_on_order_or_on_what_ran_before() -> None:
    torch.manual_seed(0)
    reference = {key: dropout_mask(key) for key in KEYS}
    shuffled = KEYS[::-1] + random.Random(5).sample(KEYS, len(KEYS))
    torch.manual_seed(99)
    for key in shuffled:
        torch.rand(int(torch.randint(1, 50, ()).item()))  # the worker's own draws in between
        assert torch.equal(dropout_mask(key), reference[key]), key


def test_each_coordinate_and_the_seed_change_the_masks() -> None:
    masks = {(SEED, *key): dropout_mask(key) for key in KEYS}
    masks.update({(SEED + 1, *key): dropout_mask(key, seed=SEED + 1) for key in KEYS[:6]})
    items = list(masks.items())
    for a, (ka, ma) in enumerate(items):
        for kb, mb in items[a + 1:]:
            assert not torch.equal(ma, mb), (ka, kb)


def test_seeds_are_mixed_not_summed() -> None:
    seeds = {micro_batch_seed(SEED, *key) for key in product(range(40), range(8), range(16), range(4))}
    assert len(seeds) == 40 * 8 * 16 * 4
    assert all(0 <= s < 2**64 for s in seeds)
    # Swapping or shifting coordinates gives other seeds, and the low 32 bits (all the CPU generator keeps) differ.
    pairs = [((1, 0, 0, 0), (0, 1, 0, 0)), ((0, 0, 1, 0), (0, 0, 0, 1)), ((2, 1, 0, 0), (1, 2, 0, 0))]
    for a, b in pairs:
        assert (micro_batch_seed(SEED, *a) ^ micro_batch_seed(SEED, *b)) & 0xFFFFFFFF, (a, b)
    low = {micro_batch_seed(0, t, 0, 0, 0) & 0xFFFFFFFF for t in range(1000)}
    assert len(low) == 1000
    with pytest.raises(ValueError, match="index=-1 must be non-negative"):
        micro_batch_seed(0, 0, 0, -1, 0)


def test_outer_stream_is_unchanged_by_the_body() -> None:
    torch.manual_seed(7)
    expected = torch.rand(10)
    torch.manual_seed(7)
    first = torch.rand(4)
    with micro_batch_rng(SEED, 3, 1, 2, 0, device="cpu"):
        torch.rand(1000)
        with micro_batch_rng(SEED, 3, 1, 3, 0, device="cpu"):  # nested contexts restore in turn
            inner = torch.rand(3)
        after_inner = torch.rand(3)
    assert torch.equal(torch.cat([first, torch.rand(6)]), expected)
    with micro_batch_rng(SEED, 3, 1, 3, 0, device="cpu"):
        assert torch.equal(torch.rand(3), inner)
    with micro_batch_rng(SEED, 3, 1, 2, 0, device="cpu"):
        torch.rand(1000)
        assert torch.equal(torch.rand(3), after_inner)


def test_outer_stream_is_restored_when_the_body_raises() -> None:
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError, match="boom"), micro_batch_rng(SEED, 0, 0, 0, 0, device="cpu"):
        torch.rand(17)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(5), expected)


def test_dropout_in_train_mode_masks_and_in_eval_mode_does_not() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(32, 2))
    x = torch.randn(5, 8)

    def run(key: Key) -> torch.Tensor:
        with micro_batch_rng(SEED, *key, device="cpu"):
            return model(x)

    model.train()
    a, b, c = run((4, 1, 0, 1)), run((4, 1, 0, 1)), run((4, 1, 1, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    model.eval()
    assert torch.equal(run((4, 1, 0, 1)), model(x)) and not torch.equal(a, model(x))


def test_default_device_reseeds_the_cpu_generator() -> None:
    with micro_batch_rng(SEED, 1, 0, 0, 0) as seed:
        drawn = torch.rand(4)
    assert seed == micro_batch_seed(SEED, 1, 0, 0, 0)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(seed)))


def test_refuses_other_accelerators() -> None:
    with pytest.raises(ValueError, match="neither cpu nor cuda"), micro_batch_rng(0, 0, 0, 0, 0, device="meta"):
        pass


Checkpoint = Callable[..., torch.Tensor]


@pytest.mark.parametrize("checkpoint", [ds_checkpointing.checkpoint,
                                        partial(torch_checkpoint.checkpoint, use_reentrant=True),
                                        partial(torch_checkpoint.checkpoint, use_reentrant=False)],
                         ids=["deepspeed", "torch-reentrant", "torch-non-reentrant"])
def test_activation_checkpointing_recomputes_the_micro_batch_masks(checkpoint: Checkpoint) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)).train()
    x = torch.randn(4, 6)

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        layer.zero_grad()
        inputs = x.clone().requires_grad_(True)
        with micro_batch_rng(SEED, 2, 1, 0, 1, device="cpu"):
            out = checkpoint(layer, inputs) if checkpointed else layer(inputs)
        torch.rand(123)  # backward runs later, after other draws, outside the context
        out.square().sum().backward()
        return [inputs.grad.clone()] + [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]

    reference = grads(checkpointed=False)
    for got, want in zip(grads(checkpointed=True), reference):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator_is_reseeded_and_restored() -> None:
    torch.cuda.manual_seed(5)
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(5)
    with micro_batch_rng(SEED, 1, 2, 3, 0) as seed:
        a = torch.nn.functional.dropout(torch.ones(512, device="cuda"), 0.5)
    with micro_batch_rng(SEED, 1, 2, 3, 0, device=torch.cuda.current_device()):
        b = torch.nn.functional.dropout(torch.ones(512, device="cuda"), 0.5)
    with micro_batch_rng(SEED, 1, 2, 4, 0, device="cuda"):
        c = torch.nn.functional.dropout(torch.ones(512, device="cuda"), 0.5)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with micro_batch_rng(SEED, 1, 2, 3, 0):
        drawn = torch.rand(8, device="cuda")
    assert torch.equal(drawn, torch.rand(8, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))


def test_layer_streams_follow_the_layer_to_any_stage() -> None:
    """Four dropout layers run as one stage [0, 4) or as two stages [0, 1) + [1, 4): with per-layer streams each
    layer draws the same mask either way; with the stage's one stream the masks of layers 1-3 change."""
    from torch import nn

    from ds_recycle.engine.rng import LayerSeeds, micro_batch_rng

    torch.manual_seed(0)
    layers = {i: nn.Dropout(0.5) for i in range(4)}
    x = torch.ones(64)

    def run(stages: list[list[int]], per_layer: bool) -> torch.Tensor:
        out = x
        for s, held in enumerate(stages):
            seeds = LayerSeeds(7)
            seeds.attach({i: layers[i] for i in held} if per_layer else {})
            with micro_batch_rng(7, step=3, pipeline=1, index=2, stage=s), seeds.micro_batch(3, 1, 2):
                for i in held:
                    out = layers[i](out)
            seeds.attach({})
        return out

    assert torch.equal(run([[0, 1, 2, 3]], True), run([[0], [1, 2, 3]], True))
    assert not torch.equal(run([[0, 1, 2, 3]], False), run([[0], [1, 2, 3]], False))
