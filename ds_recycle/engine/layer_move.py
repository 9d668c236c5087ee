"""Moving layers between stages of a running job, at an iteration boundary, from live holders, exactly.

A re-partition (:mod:`ds_recycle.plan.partition`) changes which contiguous layers each stage holds; every pipeline
takes the same new partition, so each stage's replicas still hold the same layers and the data-parallel reduction
stays per layer. :func:`receive_layers`, a barrier, then :func:`install_layers` run on every live worker at once,
between two iterations (no micro-batch in flight, gradients reduced and the step finished; the engine's
``repartition`` runs the three):

1. **Who sends what.** For each moved layer and each live worker of the stage that receives it, the sender is the
   worker of the same pipeline at the stage that held it, or, if that one is absent, the first live worker of that
   stage: every receiver gets the layer from a live holder, never from a checkpoint.
2. **What moves.** The layer's ``state_dict`` (parameters and buffers) and, for each of its parameters in order,
   its optimizer state and parameter-group index, and in bf16 its fp32 master weight (the optimizer steps the
   masters, :mod:`ds_recycle.engine.precision`): the exact bits, serialized with ``torch.save``, through the
   engine's transport. All sends are posted first, then every receive is taken, in one order known to all, so
   nothing waits in a cycle.
3. **The receiver rebuilds the layer from its ``LayerSpec``** (under a forked RNG, so the worker's random stream
   is untouched; each tensor in the dtype the sender's had, as DeepSpeed cast it), loads the state, and puts it in
   the module at its index; layers that left are dropped with their optimizer state. The module's children stay in
   layer order, so ``parameters()`` lists them as a module built on that partition would, and DeepSpeed's
   checkpoint files stay by layer index.

A ``TiedLayerSpec``'s module is shared by every stage that holds one of its layers (its weight summed over them,
:mod:`ds_recycle.engine.tied`): such layers never move (:func:`pinned_layers`; the partition chooser keeps them
where they are, which for a GPT's tied embedding and head, the first and the last layer, costs nothing), and the
other layers move around them. What cannot be moved at all is found before training (:func:`movable_reason`): a
layer given as a built ``nn.Module`` (a receiver cannot rebuild it).

Activation checkpointing moves too: a stage checkpoints segments of its own layers by local position, so a move
changes which layers share a segment (DeepSpeed's list of which segments to checkpoint is computed again for the
new layers), but recomputing a segment gives its forward's values whatever it holds
(:mod:`ds_recycle.engine.recompute`; dropout draws from the layer's own stream, :class:`~ds_recycle.engine.rng.
LayerSeeds`, reseeded by the layer's hook in the recompute too).
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ds_recycle.engine.devices import device_of
from ds_recycle.engine.precision import MasterWeightOptimizer
from ds_recycle.engine.transport import Transport
from ds_recycle.plan.partition import Move, layer_moves
from ds_recycle.runtime.grid import WorkerMap

__all__ = ["movable_reason", "pinned_layers", "PendingMove", "receive_layers", "install_layers", "Transfer", "transfers",
           "held_layers", "spec_parameters"]

def movable_reason(module: Any) -> str | None:
    """Why ``module``'s layers cannot move between stages (None: they can)."""
    specs = getattr(module, "_layer_specs", None)
    if specs is None:
        return "the model is not a DeepSpeed PipelineModule"
    for i, spec in enumerate(specs):
        if isinstance(spec, LayerSpec):
            continue
        if isinstance(spec, nn.Module):
            return (f"layer {i} is a built {type(spec).__name__}, not a LayerSpec: a worker that receives it cannot "
                    f"rebuild it. Fix: give LayerSpec({type(spec).__name__}, ...) in the layer list")
    return None


def pinned_layers(module: Any, parts: Sequence[int]) -> dict[int, int]:
    """The layers that never move (``TiedLayerSpec``), each with its stage under ``parts``."""
    return {i: next(s for s in range(len(parts) - 1) if parts[s] <= i < parts[s + 1])
            for i, spec in enumerate(getattr(module, "_layer_specs", ())) if isinstance(spec, TiedLayerSpec)}


def spec_parameters(spec: Any) -> list[int]:
    """The sizes of a layer's trainable parameters in ``parameters()`` order, without building it for real: a
    ``LayerSpec`` is built on the meta device (no memory, the RNG untouched); a function has none."""
    if isinstance(spec, nn.Module):
        return [p.numel() for p in spec.parameters() if p.requires_grad]
    build = getattr(spec, "build", None)
    if build is None:
        return []
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        return [p.numel() for p in build().parameters() if p.requires_grad]


def held_layers(module: Any) -> dict[int, Any]:
    """The layers this stage holds, by global index (modules and functions)."""
    return {int(module._local_start) + k: f for k, f in enumerate(module.forward_funcs)}


@dataclass(frozen=True)
class Transfer:
    """Layer ``layer`` goes from global rank ``src`` to global rank ``dst``."""

    layer: int
    src: int
    dst: int


def transfers(moves: Sequence[Move], workers: WorkerMap) -> list[Transfer]:
    """Every transfer of a re-partition among ``workers`` (see the module docstring), in a fixed order."""
    out = []
    for mv in moves:
        holders = {d: r for (d, s), r in workers.ranks.items() if s == mv.source}
        if not holders:
            raise RuntimeError(f"layer {mv.layer} has no live holder: every worker of stage {mv.source} is gone")
        first = holders[min(holders)]
        for (d, s), rank in sorted(workers.ranks.items()):
            if s == mv.target:
                out.append(Transfer(mv.layer, holders.get(d, first), rank))
    return out


def _master(optimizer: Any, param: nn.Parameter) -> nn.Parameter:
    """The tensor the optimizer steps for ``param``: its fp32 master in bf16, else itself."""
    return optimizer.master_of(param) if isinstance(optimizer, MasterWeightOptimizer) else param


def _payload(layer: nn.Module, optimizer: Any) -> torch.Tensor:
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    stepped = [_master(optimizer, p) for p in layer.parameters()]
    state = [(group_of.get(id(m), -1), dict(optimizer.state.get(m, {}))) for m in stepped]
    masters = ([m.detach() for m in stepped] if isinstance(optimizer, MasterWeightOptimizer) else None)
    buf = io.BytesIO()
    torch.save({"module": layer.state_dict(), "optimizer": state, "masters": masters}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack(data: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


@dataclass
class PendingMove:
    """A re-partition whose transfers are done on this worker and whose layers are not installed yet: what
    :func:`receive_layers` hands to :func:`install_layers` once every member is known to have received."""

    parts: tuple[int, ...]
    """The partition moved to."""
    transfers: list[Transfer]
    received: dict[int, dict[str, Any]]
    """Global layer index -> its payload, for the layers this worker takes over."""


def receive_layers(module: Any, optimizer: Any, parts: Sequence[int], workers: WorkerMap, rank: int,
                   transport: Transport) -> PendingMove:
    """The transfers of a re-partition to ``parts`` (every live worker calls it at once; see the module docstring):
    this worker's layers sent, its new ones received. Nothing of the module changes yet. The transfers go through the
    engine's ``transport`` (bounded waits under ``ds-recycle launch``: a peer lost during a move is a failure like any
    other). Raises ``ValueError`` before any transfer for a partition that moves a tied layer."""
    old = tuple(module.parts)
    parts = tuple(int(x) for x in parts)
    moves = layer_moves(old, parts)
    tied = [mv.layer for mv in moves if isinstance(module._layer_specs[mv.layer], TiedLayerSpec)]
    if tied:
        raise ValueError(f"partition {list(parts)} moves tied layer(s) {tied} (TiedLayerSpec): they stay on their "
                         f"stages; choose a partition that keeps them (plan.partition.choose_partition(pinned=...))")
    plan = [t for t in transfers(moves, workers)
            if isinstance(module._layer_specs[t.layer], LayerSpec)]  # functions carry no state
    layers = held_layers(module)
    sends = []
    for t in plan:
        if t.src == rank:
            data = _payload(layers[t.layer], optimizer)
            data = data.to(transport.device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=transport.device)
            sends.append((transport.isend(size, t.dst), size, t.dst))
            sends.append((transport.isend(data, t.dst), data, t.dst))
    received: dict[int, dict[str, Any]] = {}
    for t in plan:
        if t.dst == rank:
            size = torch.zeros(1, dtype=torch.int64, device=transport.device)
            transport.recv([size], t.src, f"layer {t.layer}'s size")
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=transport.device)
            transport.recv([data], t.src, f"layer {t.layer}")
            received[t.layer] = _unpack(data)
    for work, _, dst in sends:
        if work is not None:
            transport.wait(work, f"layer transfer to rank {dst}")
    return PendingMove(parts, plan, received)


def install_layers(module: Any, optimizer: Any, stage: int, pending: PendingMove) -> None:
    """This worker holds ``pending``'s partition: its new layers rebuilt and loaded, the ones that left dropped."""
    parts, received = pending.parts, pending.received
    layers = held_layers(module)
    start, stop = parts[stage], parts[stage + 1]
    new: dict[int, Any] = {}
    for i in range(start, stop):
        if i in layers:
            new[i] = layers[i]
            continue
        new[i] = _rebuild(module, i, received.get(i), optimizer)
    for i, layer in layers.items():  # a tied module never leaves (refused by receive_layers)
        if not start <= i < stop and isinstance(layer, nn.Module):
            _forget(layer, optimizer)
    _install(module, new, parts, stage)
    _order_groups(module, optimizer)


def _rebuild(module: Any, index: int, payload: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> Any:
    spec = module._layer_specs[index]
    if not isinstance(spec, LayerSpec):  # a function: nothing to carry
        return spec
    if payload is None:
        raise RuntimeError(f"layer {index} was not received")
    with torch.random.fork_rng(devices=[]):
        layer = spec.build()
    device = device_of(module)
    layer.to(device)
    masters = payload.get("masters")
    _match_dtypes(layer, payload["module"])
    layer.load_state_dict(payload["module"])
    for k, (p, (group, state)) in enumerate(zip(layer.parameters(), payload["optimizer"])):
        stepped = p
        if isinstance(optimizer, MasterWeightOptimizer) and masters is not None and p.requires_grad:
            stepped = optimizer.adopt(p, masters[k].to(device))
        if group >= 0:
            optimizer.param_groups[group]["params"].append(stepped)
        if state:
            optimizer.state[stepped] = {key: v.to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                        for key, v in state.items()}
    return layer


def _match_dtypes(layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Each parameter and buffer of the rebuilt ``layer`` takes the dtype the sender's had (DeepSpeed casts a bf16
    job's parameters, not its buffers), so that ``load_state_dict`` copies the exact bits."""
    tensors: dict[str, torch.Tensor] = dict(layer.named_parameters())
    tensors.update(dict(layer.named_buffers()))
    for name, value in state.items():
        mine = tensors.get(name)
        if mine is not None and mine.dtype != value.dtype:
            mine.data = mine.data.to(value.dtype)


def _forget(layer: nn.Module, optimizer: Any) -> None:
    gone = {id(p) for p in layer.parameters()}
    if isinstance(optimizer, MasterWeightOptimizer):
        gone |= {id(m) for m in (optimizer.drop(p) for p in layer.parameters()) if m is not None}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for p in list(optimizer.state):
        if id(p) in gone:
            del optimizer.state[p]


def _install(module: Any, layers: dict[int, Any], parts: tuple[int, ...], stage: int) -> None:
    """The module holds ``layers`` (global index -> layer), children in layer order, bounds at ``parts``."""
    for name in [n for n in module._modules if n.isdigit()]:
        del module._modules[name]
    module.forward_funcs = []
    module.fwd_map = {}
    for i in sorted(layers):
        layer = layers[i]
        module.forward_funcs.append(layer)
        if isinstance(layer, nn.Module) and not isinstance(module._layer_specs[i], TiedLayerSpec):  # in tied_modules
            module.fwd_map[str(i)] = len(module.forward_funcs) - 1
            module.add_module(str(i), layer)
    module.parts = list(parts)
    module._set_bounds(start=parts[stage], stop=parts[stage + 1])
    if getattr(module, "activation_checkpoint_interval", 0) > 0:  # which segments checkpoint, for these layers
        module.is_checkpointable_results_interval = None  # forward() zips its segments with this list: stale, it
        module._precompute_checkpointable_values()  # would drop the layers past the old count


def _order_groups(module: Any, optimizer: Any) -> None:
    """Each parameter group lists its parameters in module order, as an optimizer built on this partition would."""
    if isinstance(optimizer, MasterWeightOptimizer):
        optimizer.reorder([p for p in module.parameters() if p.requires_grad])
    order = {id(_master(optimizer, p)): k for k, p in enumerate(module.parameters())}
    for group in optimizer.param_groups:
        group["params"].sort(key=lambda p: order.get(id(p), len(order)))
