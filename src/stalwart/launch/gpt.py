"""The GPT example's task: a small decoder-only transformer on a generated English-like corpus.

Nothing is downloaded: :func:`generate_corpus` writes sentences from a seeded
probabilistic grammar (subject-verb agreement, "a"/"an", adjectives,
prepositional phrases, joined clauses), drawn with :mod:`random`'s
``random()``, whose sequence Python keeps the same across versions, so every
worker builds the same text. :func:`encode`/:func:`decode` map it to a fixed
character vocabulary, and :class:`TextWindows` cuts it into map-style
(input, target) windows, sample ``i`` depending only on ``i``.

:class:`GPT` is nanoGPT's model in small: token and position embeddings,
pre-LayerNorm blocks of causal self-attention (``scaled_dot_product_attention``)
and a GELU MLP, a final LayerNorm and an output layer tied to the token
embedding. There is no dropout, so a step is a deterministic function of the
parameters and the batch, as the failure-transparency tests need. Its loss is
the token mean of the cross-entropy, the loss a user's script already has.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

ALPHABET = "\n ,." + string.ascii_lowercase + string.ascii_uppercase
"""Every character the corpus can hold; the tokenizer's vocabulary, in token order."""
VOCAB_SIZE = len(ALPHABET)
_TOKEN_OF = {character: token for token, character in enumerate(ALPHABET)}

DEFAULT_CHARACTERS = 1_000_000
"""The default corpus length: about 14,000 windows of 64 tokens, 440 steps of 32 windows per epoch."""

# The grammar's words with their weights; singular and plural forms side by side.
_NOUNS = {
    ("dog", "dogs"): 5, ("cat", "cats"): 5, ("bird", "birds"): 3, ("child", "children"): 3,
    ("teacher", "teachers"): 2, ("farmer", "farmers"): 2, ("horse", "horses"): 2, ("fox", "foxes"): 2,
    ("owl", "owls"): 1, ("engineer", "engineers"): 1, ("apple", "apples"): 2, ("river", "rivers"): 1,
    ("house", "houses"): 2, ("garden", "gardens"): 2, ("tree", "trees"): 2, ("stone", "stones"): 1,
    ("island", "islands"): 1, ("book", "books"): 2, ("letter", "letters"): 1, ("window", "windows"): 1,
}  # fmt: skip
_ANIMATE = {"dog", "cat", "bird", "child", "teacher", "farmer", "horse", "fox", "owl", "engineer"}
_NAMES = {"Alice": 2, "Bob": 2, "Clara": 1, "Daniel": 1, "Emma": 1, "Oscar": 1}
_ADJECTIVES = {
    "small": 3, "big": 3, "old": 2, "young": 2, "quick": 2, "lazy": 2, "red": 2, "green": 1,
    "quiet": 1, "happy": 2, "empty": 1, "bright": 1, "ancient": 1, "curious": 1,
}  # fmt: skip
_TRANSITIVE = {
    ("sees", "see"): 4, ("likes", "like"): 3, ("finds", "find"): 2, ("follows", "follow"): 2,
    ("watches", "watch"): 2, ("carries", "carry"): 2, ("reads", "read"): 1, ("builds", "build"): 1,
}  # fmt: skip
_INTRANSITIVE = {
    ("runs", "run"): 3, ("sleeps", "sleep"): 3, ("sings", "sing"): 2, ("waits", "wait"): 2,
    ("laughs", "laugh"): 1, ("falls", "fall"): 1, ("works", "work"): 2,
}  # fmt: skip
_ADVERBS = {"quickly": 2, "slowly": 2, "quietly": 1, "again": 1, "today": 2, "often": 1}
_PREPOSITIONS = {"near": 3, "under": 2, "behind": 2, "in": 3, "on": 2, "with": 2}
_SINGULAR_DETERMINERS = {"the": 6, "a": 4, "every": 1, "this": 1, "my": 1}
_PLURAL_DETERMINERS = {"the": 6, "some": 2, "many": 1, "these": 1, "two": 1, "three": 1}
_CONJUNCTIONS = {"and": 3, "but": 2, "because": 1, "while": 1}


class _Choices:
    """Weighted choice over ``weights``' keys from uniform draws in [0, 1)."""

    def __init__(self, weights: dict[Any, int]) -> None:
        self.items = list(weights)
        self.cumulative = list(itertools.accumulate(weights.values()))

    def pick(self, draw: Callable[[], float]) -> Any:
        return self.items[bisect.bisect_right(self.cumulative, draw() * self.cumulative[-1])]


class _Grammar:
    """Sentences of the grammar, drawn from one ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.draw = random.Random(seed).random
        self.nouns = _Choices(_NOUNS)
        self.animate = _Choices({forms: weight for forms, weight in _NOUNS.items() if forms[0] in _ANIMATE})
        self.names = _Choices(_NAMES)
        self.adjectives = _Choices(_ADJECTIVES)
        self.transitive = _Choices(_TRANSITIVE)
        self.intransitive = _Choices(_INTRANSITIVE)
        self.adverbs = _Choices(_ADVERBS)
        self.prepositions = _Choices(_PREPOSITIONS)
        self.determiners = (_Choices(_SINGULAR_DETERMINERS), _Choices(_PLURAL_DETERMINERS))
        self.conjunctions = _Choices(_CONJUNCTIONS)

    def chance(self, probability: float) -> bool:
        return self.draw() < probability

    def noun_phrase(self, plural: bool, animate: bool, depth: int = 0) -> list[str]:
        if animate and not plural and self.chance(0.2):
            return [self.names.pick(self.draw)]
        words = [self.adjectives.pick(self.draw) for _ in range(self.chance(0.5) + self.chance(0.15))]
        words.append((self.animate if animate else self.nouns).pick(self.draw)[plural])
        determiner = self.determiners[plural].pick(self.draw)
        if determiner == "a" and words[0][0] in "aeiou":
            determiner = "an"
        phrase = [determiner, *words]
        if depth == 0 and self.chance(0.25):
            phrase += [self.prepositions.pick(self.draw), *self.noun_phrase(self.chance(0.3), False, depth + 1)]
        return phrase

    def clause(self) -> list[str]:
        plural = self.chance(0.35)
        subject = self.noun_phrase(plural, animate=True)
        kind = self.draw()
        if kind < 0.1:
            return [*subject, "are" if plural else "is", self.adjectives.pick(self.draw)]
        if kind < 0.6:
            verb = self.transitive.pick(self.draw)[plural]
            return [*subject, verb, *self.noun_phrase(self.chance(0.4), self.chance(0.3))]
        adverb = [self.adverbs.pick(self.draw)] if self.chance(0.5) else []
        return [*subject, self.intransitive.pick(self.draw)[plural], *adverb]

    def sentence(self) -> str:
        words = self.clause()
        if self.chance(0.3):
            words[-1] += ","
            words += [self.conjunctions.pick(self.draw), *self.clause()]
        text = " ".join(words) + "."
        return text[0].upper() + text[1:]


def generate_corpus(characters: int = DEFAULT_CHARACTERS, seed: int = 0) -> str:
    """``characters`` characters of the grammar's sentences from ``seed``, paragraphs of 3 to 6 sentences.

    The same arguments give the same text in every process and Python
    version; the text is cut at ``characters``, mid-sentence if need be.
    """
    if isinstance(characters, bool) or not isinstance(characters, int) or characters < 1:
        raise ValueError(f"characters must be an int >= 1, got {characters!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    grammar = _Grammar(seed)
    parts: list[str] = []
    length = 0
    while length < characters:
        paragraph = " ".join(grammar.sentence() for _ in range(3 + int(grammar.draw() * 4))) + "\n"
        parts.append(paragraph)
        length += len(paragraph)
    return "".join(parts)[:characters]


def encode(text: str) -> torch.Tensor:
    """The tokens of ``text`` (one per character, int64)."""
    unknown = set(text) - _TOKEN_OF.keys()
    if unknown:
        raise ValueError(f"text has characters outside the vocabulary: {sorted(unknown)!r}; allowed: {ALPHABET!r}")
    return torch.tensor([_TOKEN_OF[character] for character in text], dtype=torch.int64)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """The text of ``tokens`` (integers in ``[0, VOCAB_SIZE)``)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    bad = [value for value in values if not 0 <= value < VOCAB_SIZE]
    if bad:
        raise ValueError(f"tokens must lie in [0, {VOCAB_SIZE}), got {bad[:5]!r}")
    return "".join(ALPHABET[value] for value in values)


class TextWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``block_size`` tokens: sample ``i`` is ``(tokens[i*B : i*B+B],
    tokens[i*B+1 : i*B+B+1])`` for ``B = block_size``, the targets the inputs shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if tokens.dim() != 1 or tokens.dtype != torch.int64 or len(tokens) < block_size + 1:
            raise ValueError(
                f"tokens must be a 1-D int64 tensor of at least block_size + 1 = {block_size + 1} tokens, got "
                f"shape {tuple(tokens.shape)} of {tokens.dtype}"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = operator.index(index)
        if not 0 <= position < len(self):
            raise IndexError(f"index must lie in [0, {len(self)}), got {index!r}")
        start = position * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def text_datasets(
    block_size: int, *, characters: int = DEFAULT_CHARACTERS, seed: int = 0, validation_fraction: float = 0.1
) -> tuple[TextWindows, TextWindows]:
    """The training and validation windows of one generated corpus: its first ``1 - validation_fraction`` and
    the rest, so no token is in both."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction!r}")
    tokens = encode(generate_corpus(characters, seed))
    split = round(len(tokens) * (1 - validation_fraction))
    for part, length in (("training", split), ("validation", len(tokens) - split)):
        if length < block_size + 1:
            raise ValueError(
                f"the {part} part has {length} tokens, fewer than block_size + 1 = {block_size + 1}: raise "
                f"characters (got {characters}) or change validation_fraction (got {validation_fraction})"
            )
    return TextWindows(tokens[:split], block_size), TextWindows(tokens[split:], block_size)


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes. The default (4 layers of width 128, 0.8M parameters) trains a step of 32 windows of
    64 tokens in about a tenth of a second on one CPU core."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (``torch.utils.checkpoint``): less memory."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be a multiple of n_head = {self.n_head}, got {self.n_embd}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be a bool, got {self.activation_checkpointing!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.projection = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        query, key, value = (
            part.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.projection(attended.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    """Width -> 4 x width -> GELU -> width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.expand = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.projection = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(F.gelu(self.expand(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.n_embd)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer; parameters drawn from torch's global generator (seed it first)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._initialize)
        for name, parameter in self.named_parameters():
            if name.endswith("projection.weight"):  # residual branches scaled down with depth, as in GPT-2
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _initialize(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, length, vocab)`` for tokens ``idx`` ``(batch, length <= block_size)``, and with
        ``targets`` (same shape) the cross-entropy's mean over every token (``None`` without)."""
        if idx.dim() != 2 or idx.dtype != torch.int64 or not 1 <= idx.size(1) <= self.config.block_size:
            raise ValueError(
                f"idx must be int64 of shape (batch, length) with 1 <= length <= {self.config.block_size}, got "
                f"shape {tuple(idx.shape)} of {idx.dtype}"
            )
        if targets is not None and (targets.shape != idx.shape or targets.dtype != torch.int64):
            raise ValueError(
                f"targets must be int64 of idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)} of "
                f"{targets.dtype}"
            )
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def optimizer_groups(model: GPT, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups: ``weight_decay`` on the matrices of the linear layers and on the token
    embedding (it is the output layer's weight too), none on biases, LayerNorm parameters and the position
    embedding (a table added to the input, not a projection). Each parameter is in exactly one group."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT, got {type(model).__name__}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, int | float) or not weight_decay >= 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    undecayed = {id(model.position_embedding.weight)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for parameter in model.parameters():  # a tied tensor once
        (no_decay if parameter.dim() < 2 or id(parameter) in undecayed else decay).append(parameter)
    return [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_schedule(warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """The learning rate's factor after ``step`` scheduler steps, for ``LambdaLR``: a linear rise to 1 at
    ``warmup_steps`` (``(step + 1) / (warmup_steps + 1)`` before), a cosine down to ``min_ratio`` at
    ``max_steps``, then ``min_ratio``."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= warmup_steps:
        raise ValueError(f"max_steps must be an int > warmup_steps = {warmup_steps}, got {max_steps!r}")
    if not 0 <= min_ratio <= 1:
        raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def evaluate(model: nn.Module, dataset: Dataset[Any], batches: int, batch_size: int, device: torch.device) -> float:
    """The mean loss over the first ``batches * batch_size`` samples of ``dataset`` (all, if it has fewer), in
    index order, without gradients and in eval mode (the model's mode is restored)."""
    for name, value in (("batches", batches), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    count = min(batches * batch_size, len(dataset))  # type: ignore[arg-type]
    if count == 0:
        raise ValueError("dataset must not be empty")
    training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                samples = [dataset[index] for index in range(start, min(start + batch_size, count))]
                inputs, targets = (torch.stack(column).to(device) for column in zip(*samples, strict=True))
                _, loss = model(inputs, targets)
                total += float(loss) * len(samples)
    finally:
        model.train(training)
    return total / count
