"""The generated torchtitan tokenizer and corpus: the same seed writes the same bytes, and the tokenizer loads the
way torchtitan's Hugging Face wrapper reads it (BOS added, EOS on request, ids within the debug model's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.testing.torchtitan_assets import BOS, EOS, VOCAB_SIZE, WORDS, corpus, write_assets


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_text(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the torchtitan extra installs it)")
    first, _, _ = (
        write_assets(tmp_path / name, documents=50, seed=seed) for name, seed in (("a", 1), ("b", 1), ("c", 2))
    )
    for name in ("c4_test/data.json", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a/c4_test/data.json").read_bytes() != (tmp_path / "c/c4_test/data.json").read_bytes()
    lines = (first.dataset_dir / "data.json").read_text().splitlines()
    assert len(lines) == 50 and all(set(json.loads(line)) == {"text"} for line in lines)
    assert first.flags()[first.flags().index("--dataloader.dataset-path") + 1] == str(first.dataset_dir)


def test_the_tokenizer_loads_in_torchtitan_with_its_special_tokens(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assets = write_assets(tmp_path, documents=50)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(assets.tokenizer_dir))
    text = "The lighthouse heals a replica group."
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS, EOS)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and ids.count(tokenizer.bos_id) == 1
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE <= 2048  # the llama3 debug model's embeddings


@given(documents=st.integers(1, 30), seed=st.integers(0, 2**32), low=st.integers(1, 20), extra=st.integers(0, 20))
def test_corpus_has_the_asked_documents_of_the_word_list(documents: int, seed: int, low: int, extra: int) -> None:
    texts = corpus(documents, seed, (low, low + extra))
    assert len(texts) == documents and texts == corpus(documents, seed, (low, low + extra))
    for text in texts:
        words = [word.strip(".!?").lower() for word in text.split()]
        assert low <= len(words) <= low + extra
        assert set(words) <= set(WORDS)


@pytest.mark.parametrize(
    ("documents", "words", "match"),
    [
        (0, (1, 2), "documents"),
        (True, (1, 2), "documents"),
        (3, (0, 2), "words_per_document"),
        (3, (5, 2), "words_per_document"),
    ],
)
def test_corpus_refuses_bad_sizes(documents: int, words: tuple[int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        corpus(documents, 0, words)
