"""Reference models with the imbalance real models have, for every experiment in the lab.

Each model is an ``nn.Sequential`` of named layers (the units a pipeline cuts between),
built in pure torch on any device, and comes with a synthetic batch and a loss so that
profiling, partitioning and real runs need no downloads:

* :func:`gpt` — token+position embedding, pre-LN transformer blocks (Radford et al.,
  *Language Models are Unsupervised Multitask Learners*, 2019), and a final norm plus
  LM head whose vocabulary projection makes it the heaviest layer;
* :func:`vit` — patch embedding, the same blocks, and a pooled classifier head
  (Dosovitskiy et al., *An Image is Worth 16x16 Words*, ICLR 2021);
* :func:`mlp` — a stack of linear layers for quick tests.

:func:`reference` bundles a model with its batch and loss as a :class:`ReferenceSetup`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .core.checks import check_choice, check_int

__all__ = [
    "BLOCK_TP_PLAN",
    "GPT_TP_PLAN",
    "REFERENCE_MODELS",
    "ClassifierHead",
    "LMHead",
    "PatchEmbedding",
    "ReferenceSetup",
    "TokenPositionEmbedding",
    "TransformerBlock",
    "classification_loss",
    "gpt",
    "gpt_batch",
    "lm_loss",
    "mlp",
    "mlp_batch",
    "mse_loss",
    "reference",
    "vit",
    "vit_batch",
]

#: The names :func:`reference` knows.
REFERENCE_MODELS: tuple[str, ...] = ("gpt", "vit", "mlp")

_Device = torch.device | str | None


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``; input and output ``(B, T, d)``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, causal: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads, self.causal = n_heads, causal
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.ln_mlp(x))


class TokenPositionEmbedding(nn.Module):
    """Token ids ``(B, T)`` to hidden states ``(B, T, d)``: token plus learned position embedding."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


class LMHead(nn.Module):
    """Final LayerNorm and the vocabulary projection: ``(B, T, d)`` to logits ``(B, T, vocab)``."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class PatchEmbedding(nn.Module):
    """Images ``(B, C, H, W)`` to patch tokens ``(B, N, d)`` with learned positions."""

    def __init__(self, image_size: int, patch_size: int, channels: int, d_model: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be divisible by patch_size={patch_size}")
        self.conv = nn.Conv2d(channels, d_model, kernel_size=patch_size, stride=patch_size)
        self.position = nn.Parameter(torch.zeros(1, (image_size // patch_size) ** 2, d_model))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images).flatten(2).transpose(1, 2) + self.position


class ClassifierHead(nn.Module):
    """LayerNorm, mean over tokens, linear classifier: ``(B, N, d)`` to logits ``(B, classes)``."""

    def __init__(self, d_model: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


#: The tensor-parallel plan of the blocks (``{module glob: style}``, :mod:`pipeswift_lab.core.tp_plan`): the fused
#: ``qkv`` projection is cut by columns and gathered (a plain column cut would give a rank pieces of q, k and v), the
#: attention projection takes the whole input and splits it; the MLP is Megatron's column-then-row pair.
BLOCK_TP_PLAN: dict[str, str] = {
    "block_*.qkv": "colwise_gather_output",
    "block_*.proj": "rowwise_split_input",
    "block_*.mlp.0": "colwise",
    "block_*.mlp.2": "rowwise",
}
#: :func:`gpt`'s plan: the blocks', the token embedding cut by vocabulary and the LM head by columns, gathered.
GPT_TP_PLAN: dict[str, str] = {
    "embed.token": "embedding_rowwise",
    **BLOCK_TP_PLAN,
    "head.proj": "colwise_gather_output",
}


def _build(
    layers: Sequence[tuple[str, nn.Module]],
    device: _Device,
    dtype: torch.dtype | None,
    tp_plan: dict[str, str] | None = None,
) -> nn.Sequential:
    model = nn.Sequential(OrderedDict(layers)).to(device=device, dtype=dtype)
    if tp_plan is not None:
        # read by run(..., tp=) and profile(), as a Hugging Face model's tp_plan
        object.__setattr__(model, "tp_plan", dict(tp_plan))
    return model


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Build under ``torch.manual_seed(seed)`` (unless None) and restore the caller's RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def gpt(
    vocab_size: int = 8192,
    seq_len: int = 64,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    mlp_ratio: int = 4,
    device: _Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Sequential:
    """A GPT-style language model as ``nn.Sequential``: ``embed``, ``block_0`` … ``block_{n-1}``, ``head``; its
    ``tp_plan`` is :data:`GPT_TP_PLAN`.

    Input: token ids ``(B, seq_len)``; output: logits ``(B, seq_len, vocab_size)``.
    With the default vocabulary the head holds ~1M parameters against ~200k per block,
    so it is the heaviest layer, as an LM head is in real models.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("mlp_ratio", mlp_ratio),
    ):
        check_int(name, value, minimum=1)
    with _seeded(seed):
        layers: list[tuple[str, nn.Module]] = [("embed", TokenPositionEmbedding(vocab_size, seq_len, d_model))]
        layers += [(f"block_{i}", TransformerBlock(d_model, n_heads, mlp_ratio, causal=True)) for i in range(n_layers)]
        layers.append(("head", LMHead(d_model, vocab_size)))
        return _build(layers, device, dtype, GPT_TP_PLAN)


def vit(
    image_size: int = 32,
    patch_size: int = 4,
    channels: int = 3,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    mlp_ratio: int = 4,
    num_classes: int = 100,
    device: _Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Sequential:
    """A vision transformer as ``nn.Sequential``: ``patch_embed``, ``block_0`` … ``block_{n-1}``, ``head``; its
    ``tp_plan`` is :data:`BLOCK_TP_PLAN`.

    Input: images ``(B, channels, image_size, image_size)``; output: logits ``(B, num_classes)``.
    """
    for name, value in (
        ("image_size", image_size),
        ("patch_size", patch_size),
        ("channels", channels),
        ("d_model", d_model),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("num_classes", num_classes),
    ):
        check_int(name, value, minimum=1)
    with _seeded(seed):
        layers: list[tuple[str, nn.Module]] = [
            ("patch_embed", PatchEmbedding(image_size, patch_size, channels, d_model))
        ]
        layers += [(f"block_{i}", TransformerBlock(d_model, n_heads, mlp_ratio, causal=False)) for i in range(n_layers)]
        layers.append(("head", ClassifierHead(d_model, num_classes)))
        return _build(layers, device, dtype, BLOCK_TP_PLAN)


def mlp(
    widths: Sequence[int] = (64, 256, 256, 256, 10),
    device: _Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Sequential:
    """A stack of ``Linear`` layers, ReLU between them: ``layer_0`` … ``layer_{k-1}`` for ``k = len(widths)-1``.

    ``widths`` lists the feature sizes from input to output.
    """
    widths = list(widths)
    if len(widths) < 2:
        raise ValueError(f"widths={widths} needs at least 2 entries (input and output features)")
    for i, w in enumerate(widths):
        check_int(f"widths[{i}]", w, minimum=1)
    with _seeded(seed):
        layers: list[tuple[str, nn.Module]] = []
        for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
            last = i == len(widths) - 2
            layer: nn.Module = nn.Linear(n_in, n_out) if last else nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())
            layers.append((f"layer_{i}", layer))
        return _build(layers, device, dtype)


def gpt_batch(
    batch_size: int = 8, seq_len: int = 64, vocab_size: int = 8192, device: _Device = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data: ``(tokens, targets)``, both ``(batch_size, seq_len)`` int64, targets shifted by
    one."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    return stream[:, :-1].to(device), stream[:, 1:].to(device)


def vit_batch(
    batch_size: int = 8,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 100,
    device: _Device = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images ``(batch_size, channels, image_size, image_size)`` and int64 labels ``(batch_size,)``."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, channels, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    return images.to(device), labels.to(device)


def mlp_batch(
    batch_size: int = 8, widths: Sequence[int] = (64, 256, 256, 256, 10), device: _Device = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data: inputs ``(batch_size, widths[0])`` and targets ``(batch_size, widths[-1])``."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, widths[0], generator=g)
    targets = torch.randn(batch_size, widths[-1], generator=g)
    return inputs.to(device), targets.to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits ``(B, T, V)`` against targets ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``(B, C)`` against labels ``(B,)``."""
    return F.cross_entropy(logits, labels)


def mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(outputs, targets)


@dataclass(frozen=True)
class ReferenceSetup:
    """A reference model with a matching batch and loss: ``loss_fn(model(inputs), targets)`` trains it."""

    name: str
    model: nn.Sequential
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def reference(
    name: str = "gpt", batch_size: int = 8, device: _Device = None, seed: int = 0, **model_kwargs: Any
) -> ReferenceSetup:
    """Return a :class:`ReferenceSetup` for ``name`` in :data:`REFERENCE_MODELS` (``"gpt"``, ``"vit"``, ``"mlp"``).

    ``model_kwargs`` go to the model builder; the batch is shaped to match them.
    """
    check_int("batch_size", batch_size, minimum=1)
    name = check_choice("name", name, REFERENCE_MODELS, noun="reference models")
    if name == "gpt":
        model = gpt(device=device, seed=seed, **model_kwargs)
        emb = cast(TokenPositionEmbedding, model.embed)
        inputs, targets = gpt_batch(batch_size, emb.position.num_embeddings, emb.token.num_embeddings, device, seed)
        return ReferenceSetup(name, model, inputs, targets, lm_loss)
    if name == "vit":
        model = vit(device=device, seed=seed, **model_kwargs)
        patches = cast(PatchEmbedding, model.patch_embed)
        head = cast(ClassifierHead, model.head)
        kernel = cast(tuple[int, int], patches.conv.kernel_size)
        image_size = int(round(patches.position.shape[1] ** 0.5)) * kernel[0]
        inputs, targets = vit_batch(
            batch_size, image_size, patches.conv.in_channels, head.fc.out_features, device, seed
        )
        return ReferenceSetup(name, model, inputs, targets, classification_loss)
    model = mlp(device=device, seed=seed, **model_kwargs)
    widths = model_kwargs.get("widths", (64, 256, 256, 256, 10))
    inputs, targets = mlp_batch(batch_size, widths, device, seed)
    return ReferenceSetup(name, model, inputs, targets, mse_loss)
