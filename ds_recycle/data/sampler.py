"""Deterministic micro-batches: the basis of exactly-once data when work moves.

Every sample is a pure function of ``(seed, iteration, pipeline, index)``, so whichever worker
processes micro-batch ``index`` of pipeline ``pipeline`` in iteration ``iteration`` (its own
pipeline's worker or a peer that absorbed it after a failure) loads exactly the same tokens, and
resuming at iteration ``k`` continues the very same stream. No iterator state has to move with the work.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ds_recycle.config import TrainConfig
from ds_recycle.data.corpus import Corpus, load_corpus

__all__ = ["MicroBatchSource"]


class MicroBatchSource:
    """Serves micro-batches of ``micro_batch_size`` windows of ``seq_len + 1`` bytes of the corpus."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus | None = None) -> None:
        data = cfg.recycle.data
        self.corpus = corpus or load_corpus(data.corpus, data.holdout_fraction)
        self.seed = data.seed
        self.seq_len = cfg.recycle.model.seq_len
        self.micro_batch_size = cfg.micro_batch_size
        self.micro_batches = cfg.micro_batches
        self._train = torch.from_numpy(self.corpus.train.astype(np.int64))
        self._positions = len(self._train) - self.seq_len - 1
        if self._positions < 1:
            raise ValueError(f"corpus of {len(self._train)} tokens is shorter than seq_len={self.seq_len}")

    def offsets(self, iteration: int, pipeline: int, index: int) -> np.ndarray:
        """Start offsets of the samples of one micro-batch (a pure function of the arguments)."""
        if min(iteration, pipeline, index) < 0:
            raise ValueError(f"negative micro-batch id ({iteration}, {pipeline}, {index})")
        rng = np.random.Generator(np.random.PCG64([self.seed, iteration, pipeline, index]))
        return rng.integers(0, self._positions, size=self.micro_batch_size)

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, both ``int64 [micro_batch_size, seq_len]``; labels are inputs shifted by one."""
        starts = torch.from_numpy(self.offsets(iteration, pipeline, index))
        window = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        tokens = self._train[window]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def iteration(self, iteration: int, pipeline: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches pipeline ``pipeline`` owns in ``iteration``, in index order (DeepSpeed's data_iter)."""
        return (self.micro_batch(iteration, pipeline, i) for i in range(self.micro_batches))
