"""A tokenizer and a corpus for torchtitan runs, generated from a seed instead of shipped.

torchtitan's wheel ships neither (its repository's ``tests/assets`` are not
packaged), and shipping licensed text is what this avoids: the corpus is
seeded random sentences over a small fixed word list, and the tokenizer a
byte-level BPE trained on it with the ``tokenizers`` package (a torchtitan
dependency). The same seed writes byte-identical files.

How torchtitan 0.3.0 finds them (flags of ``torchtitan.train``):

* ``--hf-assets-path DIR/tokenizer``: the directory holding ``tokenizer.json``
  and ``tokenizer_config.json`` (torchtitan's ``HuggingFaceTokenizer`` reads
  BOS/EOS from the config's ``bos_token``/``eos_token`` and whether to add
  them from ``add_bos_token``/``add_eos_token``);
* ``--dataloader.dataset c4_test --dataloader.dataset-path DIR/c4_test``: the
  ``c4_test`` loader is ``datasets.load_dataset(path, split="train")`` over a
  directory of JSON lines, each sample's ``"text"`` field tokenized.

The vocabulary (at most :data:`VOCAB_SIZE` ids) fits the llama3 debug
model's 2,048 embeddings.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
VOCAB_SIZE = 512
_WORD_LIST = (
    "a the data model step batch sample worker node quorum lighthouse gradient loss train global once exactly "
    "failure tolerant replica group shard parity overlap heal join leave commit round epoch token layer "
    "attention weight optimizer schedule checkpoint restart signal process rank world reduce gather scatter"
)
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class TorchtitanAssets:
    """Where :func:`write_assets` put the tokenizer and the corpus, and the flags that point torchtitan at them."""

    tokenizer_dir: Path
    dataset_dir: Path
    documents: int

    def flags(self) -> list[str]:
        """torchtitan command-line flags selecting this tokenizer and the corpus as the ``c4_test`` dataset."""
        return [
            "--hf-assets-path",
            str(self.tokenizer_dir),
            "--dataloader.dataset",
            "c4_test",
            "--dataloader.dataset-path",
            str(self.dataset_dir),
        ]


def corpus(documents: int, seed: int = 0, words_per_document: tuple[int, int] = (40, 120)) -> list[str]:
    """``documents`` texts of seeded random sentences over :data:`WORDS` (the same seed, the same texts)."""
    if isinstance(documents, bool) or not isinstance(documents, int) or documents < 1:
        raise ValueError(f"documents must be a positive int, got {documents!r}")
    low, high = words_per_document
    if not 1 <= low <= high:
        raise ValueError(f"words_per_document must be (low, high) with 1 <= low <= high, got {words_per_document!r}")
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        sentences, left = [], rng.randint(low, high)
        while left > 0:
            length = min(left, rng.randint(4, 12))
            sentence = " ".join(rng.choice(WORDS) for _ in range(length))
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?"))
            left -= length
        texts.append(" ".join(sentences))
    return texts


def write_assets(directory: Path, documents: int = 2000, seed: int = 0) -> TorchtitanAssets:
    """Write ``tokenizer/`` (``tokenizer.json``, ``tokenizer_config.json``) and ``c4_test/data.json`` under
    ``directory``; the same ``documents`` and ``seed`` give the same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    texts = corpus(documents, seed)
    dataset_dir = directory / "c4_test"
    dataset_dir.mkdir(parents=True, exist_ok=True)
    (dataset_dir / "data.json").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer_dir = directory / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return TorchtitanAssets(tokenizer_dir=tokenizer_dir, dataset_dir=dataset_dir, documents=documents)
