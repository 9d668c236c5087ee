"""Small pipeline models written the way DeepSpeed users write them, each with a deterministic dataset.

Every model is a stock ``deepspeed.pipe.PipelineModule`` (layer list, ``LayerSpec``/``TiedLayerSpec``,
``loss_fn``) fed through ``deepspeed.initialize(training_data=...)`` by a map-style ``Dataset`` whose item
``i`` is a pure function of ``(seed, i)``:

- ``alexnet``: a small AlexNet-style convnet over 3x16x16 images of 4 classes (plain module instances and a
  function in the layer list, as DeepSpeed's own AlexNet pipe does it);
- ``gpt``: a GPT written as ``LayerSpec``s, the token embedding and the output head tied by ``TiedLayerSpec``
  (first and last stage share the weight);
- ``tuple``: a GPT whose layers pass ``(hidden, attention_mask)`` between them, as Megatron-DeepSpeed's
  ``GPTModelPipe`` does; the mask is a ``bool`` tensor that needs no gradient; the inputs are the tuple
  ``(tokens, mask)`` of padded sequences;
- ``mlp``: an MLP with dropout (randomness inside the forward);
- ``fuzzed``: an MLP whose hidden layers are random blocks of ``fuzz_modules`` (nested owners, reuse, shared and
  frozen parameters, checkpoints, custom Functions, in-place changes);
- ``vit``: a small ViT over the images whose modules own parameters beside their children, as timm's do: the
  patch embedding holds ``cls_token`` and ``pos_embed`` around its ``Conv2d``, each block an input scale used
  before its first ``Linear`` and layer scales after its branches.

``build(name, num_stages, seed)`` returns ``(PipelineModule, Dataset)``; call it after
``deepspeed.init_distributed()``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.data import Dataset

__all__ = ["MODELS", "build", "ImageDataset", "TokenDataset", "PaddedTokenDataset", "VectorDataset"]

VOCAB = 32
SEQ = 16
WIDTH = 32
HEADS = 2
SAMPLES = 256


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


# ---------------------------------------------------------------------------------------------- data
class ImageDataset(Dataset):
    """``(image 3x16x16, label)``: a fixed per-class pattern plus noise, so a convnet can learn it."""

    def __init__(self, seed: int, size: int = SAMPLES, classes: int = 4) -> None:
        self.seed, self.size, self.classes = seed, size, classes
        self.patterns = torch.randn(classes, 3, 16, 16, generator=_generator(seed, -1))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, index)
        label = int(torch.randint(self.classes, (), generator=g))
        image = self.patterns[label] + 0.8 * torch.randn(3, 16, 16, generator=g)
        return image, torch.tensor(label)


def _progression(g: torch.Generator, length: int) -> torch.Tensor:
    start = int(torch.randint(VOCAB, (), generator=g))
    step = int(torch.randint(1, 4, (), generator=g))
    return (start + step * torch.arange(length)) % VOCAB


class TokenDataset(Dataset):
    """``(tokens[SEQ], next tokens[SEQ])`` of arithmetic progressions modulo the vocabulary."""

    def __init__(self, seed: int, size: int = SAMPLES) -> None:
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = _progression(_generator(self.seed, index), SEQ + 1)
        return seq[:-1], seq[1:]


class PaddedTokenDataset(Dataset):
    """``((tokens, mask), labels)``: progressions of random length padded at the end.

    ``mask`` is True at real tokens; the labels of padding positions are -100 (ignored by the loss).
    """

    def __init__(self, seed: int, size: int = SAMPLES) -> None:
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        g = _generator(self.seed, index)
        length = int(torch.randint(SEQ // 2, SEQ + 1, (), generator=g))
        seq = _progression(g, SEQ + 1)
        mask = torch.arange(SEQ) < length
        tokens = torch.where(mask, seq[:-1], torch.zeros_like(seq[:-1]))
        labels = torch.where(mask, seq[1:], torch.full_like(seq[1:], -100))
        return (tokens, mask), labels


class VectorDataset(Dataset):
    """``(x[16], y[4])`` with ``y`` a fixed random nonlinear function of ``x`` plus noise."""

    def __init__(self, seed: int, size: int = SAMPLES) -> None:
        self.seed, self.size = seed, size
        self.weight = torch.randn(16, 4, generator=_generator(seed, -1)) / 4

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, index)
        x = torch.randn(16, generator=g)
        return x, torch.tanh(x @ self.weight) + 0.05 * torch.randn(4, generator=g)


# ---------------------------------------------------------------------------------------------- layers
def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1)


class TokenEmbedding(nn.Module):
    """The token table; tied between the input embedding (first stage) and the output head (last stage)."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


def _tied_logits(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ embedding.weight.t()


class Positions(nn.Module):
    """Adds a learned position embedding."""

    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(length, width) * 0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.table[: hidden.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block; ``mask`` (batch x keys, True = attend) is combined with causality."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No qkv bias: the key bias's gradient is exactly zero (softmax ignores a per-row shift), so Adam turns its
        # rounding noise into full-size steps and two exact engines would disagree there by up to the learning rate.
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def attend(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal if mask is None else causal & mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x, None)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MaskedEmbedding(nn.Module):
    """``(tokens, mask) -> (hidden, mask)``: token and position embeddings, the mask passed along."""

    def __init__(self, vocab: int, length: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(length, width) * 0.1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = inputs
        return self.tokens(tokens) + self.positions[: tokens.shape[1]], mask


class MaskedBlock(Block):
    """``(hidden, mask) -> (hidden, mask)``: a block that honours the padding mask."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, mask = inputs
        x = self.attend(x, mask)
        return x + self.out(F.gelu(self.fc(self.ln2(x)))), mask


class MaskedHead(nn.Module):
    """``(hidden, mask) -> logits``: final norm and projection (the mask ends here)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = inputs
        return self.proj(self.ln(hidden))


class PatchEmbed(nn.Module):
    """Image -> ``[cls] + patches`` tokens: a parameter of its own (``cls_token``, ``pos_embed``) around a child."""

    def __init__(self, width: int, patch: int = 4, size: int = 16) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, width) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(len(images), -1, -1), patches], dim=1) + self.pos_embed


class ScaledBlock(Block):
    """A transformer block with an input scale used before its first ``Linear`` and a layer scale per branch."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(width, heads)
        self.input_scale = nn.Parameter(torch.ones(width))
        self.gamma1, self.gamma2 = nn.Parameter(torch.full((width,), 0.5)), nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x) * self.input_scale).chunk(3, dim=-1))
        x = x + self.gamma1 * self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
        return x + self.gamma2 * self.out(F.gelu(self.fc(self.ln2(x))))


class ClassHead(nn.Module):
    """The ``cls`` token's logits."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(hidden[:, 0]))


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------------------------------------- models
def alexnet(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """AlexNet-style convnet: conv/ReLU/pool twice, then two linear layers."""
    layers: list[nn.Module | Callable[[torch.Tensor], torch.Tensor]] = [
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        _flatten, nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 4),
    ]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=num_stages,
                         partition_method="parameters")
    return net, ImageDataset(seed)


def gpt(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """GPT as ``LayerSpec``s; the embedding and the output head share one tied table."""
    layers = [TiedLayerSpec("embed", TokenEmbedding, VOCAB, WIDTH, tied_weight_attr="weight"),
              LayerSpec(Positions, SEQ, WIDTH),
              *[LayerSpec(Block, WIDTH, HEADS) for _ in range(2 * num_stages)],
              LayerSpec(nn.LayerNorm, WIDTH),
              TiedLayerSpec("embed", TokenEmbedding, VOCAB, WIDTH, forward_fn=_tied_logits, tied_weight_attr="weight")]
    net = PipelineModule(layers=layers, loss_fn=_token_loss, num_stages=num_stages, partition_method="type:Block")
    return net, TokenDataset(seed)


def tuple_gpt(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """GPT whose layers pass ``(hidden, bool mask)`` tuples, also across the stage boundaries."""
    layers = [LayerSpec(MaskedEmbedding, VOCAB, SEQ, WIDTH),
              *[LayerSpec(MaskedBlock, WIDTH, HEADS) for _ in range(2 * num_stages)],
              LayerSpec(MaskedHead, WIDTH, VOCAB)]
    net = PipelineModule(layers=layers, loss_fn=_token_loss, num_stages=num_stages,
                         partition_method="type:MaskedBlock")
    return net, PaddedTokenDataset(seed)


def mlp(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """MLP with dropout after each hidden layer."""
    width = 64
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(2 * num_stages - 1):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
    layers.append(nn.Linear(width, 4))
    net = PipelineModule(layers=layers, loss_fn=nn.MSELoss(), num_stages=num_stages, partition_method="uniform")
    return net, VectorDataset(seed)


def fuzzed(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """Random blocks of ``fuzz_modules`` between an input and an output ``Linear`` (the same for every ``seed``)."""
    from fuzz_modules import random_blocks

    width = 8
    layers: list[nn.Module] = [nn.Linear(16, width), *random_blocks(range(4 * num_stages), width), nn.Linear(width, 4)]
    net = PipelineModule(layers=layers, loss_fn=nn.MSELoss(), num_stages=num_stages, partition_method="uniform")
    return net, VectorDataset(seed)


def vit(num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """ViT with nested parameter owners (see the module docstring)."""
    layers = [LayerSpec(PatchEmbed, WIDTH), *[LayerSpec(ScaledBlock, WIDTH, HEADS) for _ in range(2 * num_stages)],
              LayerSpec(ClassHead, WIDTH, 4)]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=num_stages,
                         partition_method="type:ScaledBlock")
    return net, ImageDataset(seed)


MODELS: dict[str, Callable[[int, int], tuple[PipelineModule, Dataset]]] = {
    "alexnet": alexnet, "gpt": gpt, "tuple": tuple_gpt, "mlp": mlp, "vit": vit, "fuzzed": fuzzed}


def build(name: str, num_stages: int, seed: int) -> tuple[PipelineModule, Dataset]:
    """The ``PipelineModule`` and its training ``Dataset`` of model ``name`` (one of :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](num_stages, seed)
