"""Emulated accelerators: pipeline layers whose F, B and W take the wall-clock time of a cost profile.

On a CPU machine with fewer cores than workers, real compute cannot show a pipeline's bubbles (a worker that
waits lends its core to another). The layers of :mod:`.layers` *sleep* for their operation's time instead, so
a worker waiting in a bubble is idle exactly as an accelerator would be, while the runtime (engine dispatch,
transport, failure checks, optimizer, all-reduce) runs for real. Nothing here is part of ds_recycle: the
emulated model is a user's ``PipelineModule`` run through ``deepspeed.initialize`` or ``ds_recycle.initialize``.

- :mod:`.layers`: :class:`~.layers.EmulatedLayer`, whose forward sleeps F, whose input-gradient path
  sleeps B and whose weight-gradient path sleeps W (a fused backward pays both);
- :mod:`.profiles`: per-stage F/B/W of real models on real accelerators from published figures, scaled;
- :mod:`.model`: the emulated GPT (a tiny real embedding and head around one emulated layer per stage);
- ``train.py``: the user-style DeepSpeed script that trains it (``benchmarks/emulated_figure.py`` runs it).
"""
