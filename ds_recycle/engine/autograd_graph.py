"""Where, in one micro-batch's autograd graph, W may start for each parameter: its nearest dominating edge.

B (:mod:`ds_recycle.engine.backward`) keeps the gradient that flows through each *marked* edge (the outputs and
inputs of every module with parameters of its own). An edge *dominates* a parameter when every path from the
stage output to the parameter's ``AccumulateGrad`` node goes through it. Then the parameter's gradient is a
function of that edge's gradient alone: an autograd pass seeded there, ``inputs=`` the parameter, gives bit for
bit what the fused backward accumulates (every node between the edge and the parameter receives its gradient
only from paths through the edge, so in the same amounts and the same order). The nearest such edge is the
cheapest start: a ``Linear``'s weight starts at its output (the weight-gradient matmul alone), a layer scale
used before a child ``Linear`` at that child's input (one multiply), a parameter a tied head reads outside its
module at the stage output (the loss's nodes, nothing deeper).

:func:`dominators` finds it for every parameter in one topological sweep over the nodes the stage output
reaches: a *must* bit set per node, the marked edges on every path to it (intersection over incoming edges,
Python integers as bit sets). A parameter's dominating edges lie on one chain, each computed in the forward from
the next nearer one, so the nearest is the one whose node autograd created first (lowest ``sequence_nr``).
Nesting, reuse, sharing, frozen parts and in-place changes need no rule of their own: they are all just graphs.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

__all__ = ["Dominators", "dominators"]

ROOT = -1
"""No marked edge dominates the parameter: W starts at the stage output."""


@dataclass(frozen=True)
class Dominators:
    """The sweep's verdict."""

    start: tuple[int | None, ...]
    """Per parameter: the index of its nearest dominating marked edge, :data:`ROOT`, or None (out of reach)."""
    nodes: int
    """Nodes visited (the sweep's cost)."""
    functions: bool
    """A custom autograd Function (``torch.autograd.Function``) is among them."""


def _edges(node: Node) -> Iterable[tuple[Node, int]]:
    return ((n, k) for n, k in node.next_functions if n is not None)


def dominators(roots: Sequence[GradientEdge], marked: Sequence[GradientEdge], params: Sequence[Node]) -> Dominators:
    """For each parameter (its ``AccumulateGrad`` node), the nearest marked edge that dominates it."""
    bits: dict[tuple[Node, int], int] = {}
    for i, edge in enumerate(marked):
        key = (edge.node, edge.output_nr)
        bits[key] = bits.get(key, 0) | (1 << i)
    indegree: dict[Node, int] = {}
    stack = [e.node for e in roots]
    for node in stack:
        indegree[node] = indegree.get(node, 0) + 1
    seen = set(stack)
    while stack:
        for child, _ in _edges(stack.pop()):
            indegree[child] = indegree.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    everything = (1 << len(marked)) - 1
    must: dict[Node, int] = {}

    def enter(node: Node, output_nr: int, above: int) -> None:
        must[node] = must.get(node, everything) & (above | bits.get((node, output_nr), 0))

    ready: list[Node] = []
    for edge in roots:
        enter(edge.node, edge.output_nr, 0)
        indegree[edge.node] -= 1
        if indegree[edge.node] == 0:
            ready.append(edge.node)
    while ready:
        node = ready.pop()
        for child, output_nr in _edges(node):
            enter(child, output_nr, must[node])
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
    order = [edge.node._sequence_nr() for edge in marked]
    start: list[int | None] = []
    for acc in params:
        if acc not in must:
            start.append(None)
            continue
        dominating = must[acc]
        best, best_order = ROOT, None
        while dominating:
            low = dominating & -dominating
            i = low.bit_length() - 1
            if best_order is None or order[i] < best_order:
                best, best_order = i, order[i]
            dominating ^= low
        start.append(best)
    functions = any(isinstance(node, BackwardCFunction) for node in seen)
    return Dominators(start=tuple(start), nodes=len(seen), functions=functions)
