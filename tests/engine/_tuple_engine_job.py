"""A 2 x 2 job whose stages pass ``(hidden, bool mask, int64 positions)``: vanilla DeepSpeed or the ReCycle engine.

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_tuple_engine_job.py MODE OUT

``MODE`` is ``vanilla`` (DeepSpeed's ``PipelineEngine``) or a ReCycle plan schedule (``1f1b``: fused backward;
``zb-h1``: B and W apart). Rank 0 writes the final parameters (layer-indexed names) to ``OUT`` (and, for
vanilla, the initial ones to ``OUT.init``); test_tuple_engine.py compares them.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

STEPS, MICRO, BATCH, SEQ, VOCAB, WIDTH = 6, 4, 2, 8, 16, 16
CONFIG = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO, "gradient_clipping": 1.0,
          "steps_per_print": 10**9}


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()  # DeepSpeed sends it as it is
        return self.tokens(tokens), tokens != 0, positions


class MaskedMix(nn.Module):
    """Mixes each position with the masked mean of the sequence; passes the mask and positions along."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pos = nn.Linear(WIDTH, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, mask, positions = inputs
        keep = mask.unsqueeze(-1).to(x.dtype)
        mean = (x * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)
        return x + torch.tanh(self.lin(x + mean) + self.pos(positions)), mask, positions


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.proj(inputs[0])


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class Source:
    """Micro-batch ``index`` of ``pipeline`` at ``iteration``: tokens (zeros are masked out) and labels."""

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * iteration + 10 * pipeline + index)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return tokens, (tokens * 3 + 1) % VOCAB


def layers() -> list:
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(Embed), LayerSpec(MaskedMix), LayerSpec(MaskedMix), LayerSpec(MaskedMix),
            LayerSpec(MaskedMix), LayerSpec(Head)]


def vanilla_stream(pipeline: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for t in range(STEPS):
        for i in range(MICRO):
            yield Source().micro_batch(t, pipeline, i)


def save(engine: object, path: str) -> None:
    """Pipeline 0's stages gather their parameters on rank 0, which writes them."""
    from ds_recycle.engine.state import gather_state_dict

    grid = engine.grid  # type: ignore[attr-defined]
    state = gather_state_dict(engine.module, contributes=grid.get_data_parallel_id() == 0, dst=0)  # type: ignore[attr-defined]
    if state is not None:
        torch.save(state, path)


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    if mode == "vanilla":
        from deepspeed.pipe import PipelineModule

        module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=module, config=CONFIG,
                                          optimizer=torch.optim.Adam(module.parameters(), lr=1e-2))
        save(engine, out + ".init")
        stream = vanilla_stream(engine.grid.data_parallel_id)
        for _ in range(STEPS):
            engine.train_batch(data_iter=stream)
    else:
        from deepspeed.pipe import PipelineModule

        import ds_recycle

        module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
        engine, *_ = ds_recycle.initialize(model=module, training_data=Source(),
                                           config={**CONFIG, "recycle": {"schedule": mode,
                                                                         "optimizer_step": "synchronous"}},
                                           optimizer=torch.optim.Adam(module.parameters(), lr=1e-2))
        for _ in range(STEPS):
            engine.train_batch()
        engine.finish()
    save(engine, out)
    dist.barrier()
    dist.destroy_process_group()
    print(f"DONE {os.environ['RANK']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
