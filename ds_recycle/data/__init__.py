"""Training data: a real-text byte corpus and a deterministic micro-batch sampler."""
from ds_recycle.data.corpus import Corpus, load_corpus
from ds_recycle.data.sampler import MicroBatchSource

__all__ = ["Corpus", "MicroBatchSource", "load_corpus"]
