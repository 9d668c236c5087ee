"""Two ranks exchange tuple and single-tensor payloads through a channel; prints ``OK <rank>`` (test_p2p_tuples.py).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_tuple_p2p_job.py peer|bounded|misordered|mixed

``peer``: :class:`~ds_recycle.engine.p2p.PeerChannel` over ``torch.distributed``'s WORLD group; ``bounded``: over
:class:`~ds_recycle.resilience.transport.EpochTransport`, an epoch's groups over a store hosted by rank 0.
Rank 0 plays the earlier stage: it sends activations of 4 micro-batches (2 pipelines x 2) and receives their
gradients; rank 1 receives the activations in the order they were sent (messages match per pair in posting
order, no tags) and sends gradients made from them in the reverse order, then one bare bf16 tensor the other way.
``misordered``: bounded, every message named (order checked); rank 0 posts two activations and rank 1 asks for
the second first: it prints the refusal. ``mixed``: the same with only rank 0 naming its messages: rank 1 refuses
the first header.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_recycle.engine.p2p import Channel, PeerChannel
from ds_recycle.engine.transport import DistTransport

MICRO_BATCHES = [(0, 0), (0, 1), (1, 0), (1, 1)]


def activation(mb: tuple[int, int], iteration: int) -> tuple[torch.Tensor, ...]:
    """A Megatron-like boundary: hidden (fp32), a bf16 side tensor, a bool mask, int64 positions."""
    g = torch.Generator().manual_seed(100 * iteration + 10 * mb[0] + mb[1])
    hidden = torch.randn(2, 3, 4, generator=g)
    side = torch.randn(2, 4, generator=g).to(torch.bfloat16)
    mask = torch.rand(2, 3, generator=g) > 0.5
    positions = torch.randint(0, 100, (2, 3), generator=g)
    return hidden, side, mask, positions


def bare() -> torch.Tensor:
    return torch.arange(6.0).view(2, 3).to(torch.bfloat16)


def grads_of(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(2 * t for t in payload if t.is_floating_point())


def misordered(ch: PeerChannel, rank: int) -> None:
    if rank == 0:
        for mb in MICRO_BATCHES[:2]:
            ch.send(activation(mb, 0), 1, Channel.ACTIVATION, 0, mb)
        time.sleep(1.0)  # posted, not waited for: rank 1 takes the first message only
        return
    try:
        ch.recv_activation(0, 0, MICRO_BATCHES[1])
    except RuntimeError as e:
        print(f"REFUSED {e}", flush=True)


def channel(mode: str, rank: int) -> PeerChannel:
    if mode == "peer":
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        return PeerChannel(DistTransport())
    from ds_recycle.resilience.transport import EpochComm, EpochTransport
    from tests.harness import QuietDetector as Quiet  # no failure happens here

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0,
                          timeout=timedelta(seconds=60))
    comm = EpochComm.build(store, 0, [0, 1], [0, 1], rank, timeout_s=60.0, detector=Quiet())
    return PeerChannel(EpochTransport(comm, rank), check_order=mode == "misordered" or (mode == "mixed" and rank == 0))


def sender(ch: PeerChannel) -> None:
    for iteration in range(2):
        for mb in MICRO_BATCHES:
            ch.send(activation(mb, iteration), 1, Channel.ACTIVATION, iteration, mb)
        for mb in reversed(MICRO_BATCHES):
            want = grads_of(activation(mb, iteration))
            got = ch.recv_like(tuple(torch.empty_like(t) for t in want), 1, Channel.GRAD, iteration, mb)
            assert isinstance(got, tuple) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
        ch.wait_sends()
    got = ch.recv_activation(1, 2, (1, 0))  # the other direction has its own header: a bare bf16 tensor
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and torch.equal(got, bare())


def receiver(ch: PeerChannel) -> None:
    for iteration in range(2):
        received = []
        for mb in MICRO_BATCHES:
            got = ch.recv_activation(0, iteration, mb)
            want = activation(mb, iteration)
            assert isinstance(got, tuple) and len(got) == len(want)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (mb, a, b)
            received.append((mb, got))
        for mb, got in reversed(received):
            ch.send(grads_of(got), 0, Channel.GRAD, iteration, mb)
        ch.wait_sends()


def main() -> int:
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    ch = channel(mode, rank)
    if mode in ("misordered", "mixed"):
        misordered(ch, rank)
    elif rank == 0:
        sender(ch)
    else:
        receiver(ch)
        ch.send(bare(), 0, Channel.ACTIVATION, 2, (1, 0))
        ch.wait_sends()
    print(f"OK {rank}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
