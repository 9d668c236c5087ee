"""The training text: the Python language reference that ships with every CPython.

CPython installs the text of its language reference, one entry per topic, as the dict
``pydoc_data.topics.topics`` (about 0.7 MB of English prose with code examples; it is what
``help("if")`` prints). It is real text, it is on every machine that has Python, and building the
corpus from it is deterministic: topics are joined in sorted order. Its licence is the PSF licence
of the interpreter it ships with; nothing is copied into this repository.

Tokens are bytes (a vocabulary of 256), so no tokenizer has to be trained or downloaded.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["Corpus", "load_corpus"]


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into a training part and a held-out tail."""

    tokens: np.ndarray
    """All bytes of the text, ``uint8``."""
    train_end: int
    """Tokens ``[0, train_end)`` are for training, the rest is held out."""
    sha256: str
    """Digest of the text, recorded in the run's metadata so runs on different machines can be compared."""
    name: str

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.train_end]

    @property
    def holdout(self) -> np.ndarray:
        return self.tokens[self.train_end :]


@lru_cache(maxsize=4)
def load_corpus(name: str = "python-reference", holdout_fraction: float = 0.05) -> Corpus:
    """Build the corpus ``name`` (only ``"python-reference"`` exists)."""
    if name != "python-reference":
        raise ValueError(f"unknown corpus {name!r}; the only corpus is 'python-reference'")
    from pydoc_data.topics import topics  # the stdlib's language reference text

    text = "\n\n".join(topics[key].strip() for key in sorted(topics)).encode("utf-8")
    tokens = np.frombuffer(text, dtype=np.uint8)
    train_end = int(len(tokens) * (1.0 - holdout_fraction))
    digest = hashlib.sha256(text).hexdigest()
    logger.debug("corpus %s: %d bytes, sha256 %s", name, len(tokens), digest[:12])
    return Corpus(tokens=tokens, train_end=train_end, sha256=digest, name=name)
