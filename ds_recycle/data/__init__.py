"""Training data: the addressable data contract, a real-text byte corpus and a deterministic micro-batch sampler."""
from ds_recycle.data.addressable import AddressableData, DeepSpeedOrder, NotAddressableError, as_addressable
from ds_recycle.data.corpus import Corpus, load_corpus
from ds_recycle.data.sampler import MicroBatchSource

__all__ = ["AddressableData", "Corpus", "DeepSpeedOrder", "MicroBatchSource", "NotAddressableError",
           "as_addressable", "load_corpus"]
