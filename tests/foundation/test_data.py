"""The corpus is real text and the sampler is a pure function of (iteration, pipeline, index)."""
from __future__ import annotations

import torch

from ds_recycle.config import load_config
from ds_recycle.data import MicroBatchSource, load_corpus


def cfg():  # type: ignore[no-untyped-def]
    return load_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
                        "recycle": {"model": {"seq_len": 32}}})


def test_corpus_is_real_english_text() -> None:
    corpus = load_corpus()
    assert len(corpus.tokens) > 300_000
    text = bytes(corpus.train[:200_000]).decode("utf-8", errors="ignore")
    for word in (" the ", " of ", " and ", "function", "statement"):
        assert text.count(word) > 20, word
    assert 0 < corpus.train_end < len(corpus.tokens)


def test_micro_batches_are_deterministic_and_distinct() -> None:
    a, b = MicroBatchSource(cfg()), MicroBatchSource(cfg())
    x1, y1 = a.micro_batch(5, 1, 0)
    x2, y2 = b.micro_batch(5, 1, 0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (3, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # labels are the inputs shifted by one
    ids = [(it, d, i) for it in range(3) for d in range(2) for i in range(2)]
    batches = {k: a.micro_batch(*k)[0] for k in ids}
    for k1 in ids:
        for k2 in ids:
            if k1 < k2:
                assert not torch.equal(batches[k1], batches[k2]), (k1, k2)


def test_iteration_serves_the_owned_micro_batches_in_order() -> None:
    src = MicroBatchSource(cfg())
    served = list(src.iteration(7, 1))
    assert len(served) == 2
    for i, (x, _) in enumerate(served):
        assert torch.equal(x, src.micro_batch(7, 1, i)[0])
