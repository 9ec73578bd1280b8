"""The GPT example's parts (stalwart.launch.gpt) and its plain DDP script (examples/gpt_ddp.py) under torchrun."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.launch.gpt import (
    ALPHABET,
    GPT,
    VOCAB_SIZE,
    GPTConfig,
    TextWindows,
    cosine_schedule,
    decode,
    encode,
    evaluate,
    generate_corpus,
    optimizer_groups,
    text_datasets,
)

SMALL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def seeded_model(config: GPTConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def batch_of(dataset: TextWindows, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = zip(*(dataset[index] for index in indices), strict=True)
    return torch.stack(inputs), torch.stack(targets)


SINGULAR_NOUNS = ["dog", "cat", "bird", "child", "teacher", "farmer", "horse", "fox", "owl", "engineer"]
PLURAL_NOUNS = ["dogs", "cats", "birds", "children", "teachers", "farmers", "horses", "foxes", "owls", "engineers"]
SINGULAR_VERBS = [
    "is", "sees", "likes", "finds", "follows", "watches", "carries", "reads", "builds",
    "runs", "sleeps", "sings", "waits", "laughs", "falls", "works",
]  # fmt: skip
PLURAL_VERBS = [
    "are", "see", "like", "find", "follow", "watch", "carry", "read", "build",
    "run", "sleep", "sing", "wait", "laugh", "fall", "work",
]  # fmt: skip
ADJECTIVES = [
    "small", "big", "old", "young", "quick", "lazy", "red", "green", "quiet", "happy", "empty", "bright", "ancient",
    "curious",
]  # fmt: skip
SUBJECT_AND_VERB = (
    r"(?:^|\. |\n|, [a-z]+ )[A-Za-z]+ (?:(?:" + "|".join(ADJECTIVES) + r") ){0,2}"
    rf"({'|'.join(SINGULAR_NOUNS + PLURAL_NOUNS)}) ({'|'.join(SINGULAR_VERBS + PLURAL_VERBS)})\b"
)
"""A clause's determiner, adjectives, animate noun and verb, in the grammar's words."""


def test_the_corpus_is_a_function_of_its_seed_in_the_vocabulary_and_english_like() -> None:
    text = generate_corpus(20_000, seed=3)
    assert len(text) == 20_000 and text == generate_corpus(20_000, seed=3)
    assert text != generate_corpus(20_000, seed=4)
    assert generate_corpus(50_000, seed=3).startswith(text)
    assert set(text) <= set(ALPHABET) and VOCAB_SIZE == len(ALPHABET) == len(set(ALPHABET))
    assert decode(encode(text)) == text and encode(text).dtype == torch.int64
    sentences = re.split(r"(?<=\.)[ \n]", text)[:-1]
    assert len(sentences) > 300 and all(re.fullmatch(r"[A-Z][a-z]*(,? [A-Za-z][a-z]*)+\.", s) for s in sentences)
    assert set(re.findall(r"(?<=[a-z,] )[A-Z][a-z]*", text)) == {"Alice", "Bob", "Clara", "Daniel", "Emma", "Oscar"}
    assert not re.search(r"\b[Aa] [aeiou]|\b[Aa]n [^aeiou]", text), "'a' before a vowel or 'an' before a consonant"
    subjects = re.findall(SUBJECT_AND_VERB, generate_corpus(100_000, seed=3))
    agreeing = sum((noun in PLURAL_NOUNS) == (verb in PLURAL_VERBS) for noun, verb in subjects)
    assert len(subjects) > 500 and agreeing == len(subjects), "a clause's verb agrees with its subject"


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: generate_corpus(0), "characters must be an int >= 1, got 0"),
        (lambda: generate_corpus(10, seed=-1), "seed must be an int >= 0, got -1"),
        (lambda: encode("naïve"), r"outside the vocabulary: \['ï'\]"),
        (lambda: decode([3, VOCAB_SIZE]), rf"tokens must lie in \[0, {VOCAB_SIZE}\), got \[{VOCAB_SIZE}\]"),
        (lambda: TextWindows(torch.arange(10), 0), "block_size must be an int >= 1, got 0"),
        (lambda: TextWindows(torch.arange(4), 4), "at least block_size \\+ 1 = 5 tokens"),
        (lambda: text_datasets(8, characters=1000, validation_fraction=1.0), "validation_fraction must lie in"),
        (lambda: GPTConfig(n_embd=30, n_head=4), "n_embd must be a multiple of n_head = 4, got 30"),
        (lambda: GPTConfig(n_layer=0), "n_layer must be an int >= 1, got 0"),
        (lambda: cosine_schedule(-1, 10, 0.1), "warmup_steps must be an int >= 0, got -1"),
        (lambda: cosine_schedule(10, 10, 0.1), "max_steps must be an int > warmup_steps = 10, got 10"),
        (lambda: cosine_schedule(1, 10, 1.5), r"min_ratio must lie in \[0, 1\], got 1.5"),
        (lambda: optimizer_groups(seeded_model(), -0.1), "weight_decay must be a number >= 0, got -0.1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_parameter(call, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        call()


@settings(max_examples=60, deadline=None)
@given(
    characters=st.integers(100, 3000),
    block_size=st.integers(1, 40),
    validation_fraction=st.floats(0.2, 0.6),
    seed=st.integers(0, 2**31),
)
def test_windows_are_the_corpus_shifted_by_one_and_train_and_validation_share_no_token(
    characters: int, block_size: int, validation_fraction: float, seed: int
) -> None:
    tokens = encode(generate_corpus(characters, seed))
    split = round(characters * (1 - validation_fraction))
    if min(split, characters - split) < block_size + 1:
        with pytest.raises(ValueError, match=rf"part has \d+ tokens, fewer than block_size \+ 1 = {block_size + 1}"):
            text_datasets(block_size, characters=characters, seed=seed, validation_fraction=validation_fraction)
        return
    train, val = text_datasets(block_size, characters=characters, seed=seed, validation_fraction=validation_fraction)
    assert len(train.tokens) == split
    split = len(train.tokens)
    assert torch.equal(train.tokens, tokens[:split]) and torch.equal(val.tokens, tokens[split:])
    for dataset, offset in ((train, 0), (val, split)):
        assert len(dataset) == (len(dataset.tokens) - 1) // block_size >= 1
        for index in (0, len(dataset) // 2, len(dataset) - 1):
            inputs, targets = dataset[index]
            start = offset + index * block_size
            assert torch.equal(inputs, tokens[start : start + block_size])
            assert torch.equal(targets, tokens[start + 1 : start + block_size + 1])
        assert offset + len(dataset) * block_size + 1 <= offset + len(dataset.tokens)  # inside its own part
        with pytest.raises(IndexError, match=rf"index must lie in \[0, {len(dataset)}\)"):
            dataset[len(dataset)]
    rebuilt, _ = text_datasets(block_size, characters=characters, seed=seed, validation_fraction=validation_fraction)
    last = len(train) - 1
    assert all(torch.equal(a, b) for a, b in zip(rebuilt[last], train[last], strict=True))  # sample i from i alone


def test_forward_gives_logits_per_position_and_the_token_mean_loss() -> None:
    model = seeded_model()
    train, _ = text_datasets(SMALL.block_size, characters=5000)
    inputs, targets = batch_of(train, [0, 1, 2])
    logits, loss = model(inputs, targets)
    assert logits.shape == (3, SMALL.block_size, VOCAB_SIZE) and loss is not None and loss.shape == ()
    summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert torch.allclose(loss, summed / targets.numel())
    _, doubled = model(inputs.repeat(2, 1), targets.repeat(2, 1))
    assert torch.allclose(doubled, loss), "a mean: twice the same samples, the same loss"
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.1, "small initial weights: about uniform predictions"
    short_logits, no_loss = model(inputs[:, :5])
    assert no_loss is None and torch.allclose(short_logits, logits[:, :5], atol=1e-6)
    changed = inputs.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB_SIZE
    changed_logits, _ = model(changed)
    assert torch.equal(changed_logits[:, :9], logits[:, :9]), "causal: no position sees a later token"
    assert not torch.allclose(changed_logits[:, 9:], logits[:, 9:])
    assert model.lm_head.weight is model.token_embedding.weight
    with pytest.raises(ValueError, match=r"idx must be int64 of shape \(batch, length\) with 1 <= length <= 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="targets must be int64 of idx's shape"):
        model(inputs, targets[:, :-1])


def test_the_default_model_has_its_documented_size() -> None:
    model = seeded_model(GPTConfig())
    width, layers, vocab, block = 128, 4, VOCAB_SIZE, 64
    per_block = 4 * width + (3 * width * width + 3 * width) + (width * width + width) + (8 * width * width + 5 * width)
    assert sum(p.numel() for p in model.parameters()) == vocab * width + block * width + layers * per_block + 2 * width
    assert sum(p.numel() for p in model.parameters()) == 808_704


def train_steps(model: GPT, steps: int, batch_size: int = 16) -> list[float]:
    """Plain single-process training on the first windows in a seeded order, as the DDP script trains."""
    train, _ = text_datasets(model.config.block_size, characters=60_000)
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(steps // 10, steps, 0.1))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        _, loss = model(*batch_of(train, order[step * batch_size : (step + 1) * batch_size].tolist()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_the_loss_falls_and_training_is_deterministic() -> None:
    losses = train_steps(seeded_model(), 120)
    assert losses[0] > 3.9 and sum(losses[-10:]) / 10 < 2.6, losses[::10]
    first, second = seeded_model(), seeded_model()
    assert train_steps(first, 4) == train_steps(second, 4)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_weight_decay_groups_hold_each_parameter_once_and_adamw_decays_only_the_first() -> None:
    model = seeded_model()
    decay, no_decay = optimizer_groups(model, 0.25)
    assert decay["weight_decay"] == 0.25 and no_decay["weight_decay"] == 0.0
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    expected = {"token_embedding.weight"} | {
        f"blocks.{layer}.{part}.weight"
        for layer in range(SMALL.n_layer)
        for part in ("attention.qkv", "attention.projection", "mlp.expand", "mlp.projection")
    }
    assert decayed == expected
    assert not decayed & undecayed and decayed | undecayed == set(names.values())
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert {name for name in undecayed if not name.endswith(".bias")} == {
        "position_embedding.weight",
        "final_norm.weight",
        *(f"blocks.{layer}.{norm}.weight" for layer in range(SMALL.n_layer) for norm in ("attention_norm", "mlp_norm")),
    }
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    optimizer = torch.optim.AdamW([decay, no_decay], lr=0.1)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        factor = 1 - 0.1 * 0.25 if name in decayed else 1.0
        assert torch.allclose(parameter, before[name] * factor), name


def test_the_schedule_warms_up_linearly_peaks_then_follows_a_cosine_to_its_floor() -> None:
    factor = cosine_schedule(10, 110, 0.1)
    assert [factor(step) for step in (0, 4, 9)] == pytest.approx([1 / 11, 5 / 11, 10 / 11])
    assert factor(10) == 1.0
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1) and factor(500) == 0.1
    values = [factor(step) for step in range(120)]
    assert values[:11] == sorted(values[:11]) and values[10:] == sorted(values[10:], reverse=True)
    assert cosine_schedule(0, 5, 0.0)(0) == 1.0 and cosine_schedule(0, 5, 0.0)(5) == pytest.approx(0.0)
    model = seeded_model()
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    lrs = []
    for _ in range(111):
        lrs.append(scheduler.get_last_lr())
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx([2e-3 / 11] * 2) and lrs[10] == pytest.approx([2e-3] * 2)
    assert lrs[110] == pytest.approx([2e-4] * 2)


def test_activation_checkpointing_recomputes_the_blocks_and_gives_the_same_gradients() -> None:
    train, _ = text_datasets(SMALL.block_size, characters=5000)
    inputs, targets = batch_of(train, [3, 5, 8, 13])
    results = {}
    for flag in (False, True):
        model = seeded_model(GPTConfig(**{**SMALL.__dict__, "activation_checkpointing": flag}))
        calls = [0]
        model.blocks[0].register_forward_pre_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        _, loss = model(inputs, targets)
        loss.backward()
        results[flag] = (loss.item(), {name: p.grad for name, p in model.named_parameters()}, calls[0])
    assert results[False][2] == 1 and results[True][2] == 2, "checkpointed: the block runs again in backward"
    assert results[True][0] == results[False][0]
    for name, gradient in results[False][1].items():
        assert torch.equal(results[True][1][name], gradient), name


def test_evaluate_is_the_mean_over_the_first_windows_without_gradients_and_restores_the_mode() -> None:
    model = seeded_model()
    _, val = text_datasets(SMALL.block_size, characters=8000)
    expected = sum(model(*batch_of(val, [index]))[1].item() for index in range(12)) / 12
    assert evaluate(model, val, 3, 4, torch.device("cpu")) == pytest.approx(expected, rel=1e-6)
    assert evaluate(model, val, 12, 1, torch.device("cpu")) == pytest.approx(expected, rel=1e-6)
    assert len(val) < 1000
    whole = evaluate(model, val, 1000, 7, torch.device("cpu"))
    everything = sum(model(*batch_of(val, [index]))[1].item() for index in range(len(val))) / len(val)
    assert whole == pytest.approx(everything, rel=1e-6)
    assert model.training and all(p.grad is None for p in model.parameters())
    model.eval()
    evaluate(model, val, 1, 2, torch.device("cpu"))
    assert not model.training
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        evaluate(model, val, 1, 0, torch.device("cpu"))


SCRIPT_SETTINGS = {
    "GPT_STEPS": "12", "GPT_GLOBAL_BATCH": "8", "GPT_MICRO_BATCH": "2", "GPT_EVAL_EVERY": "6", "GPT_EVAL_BATCHES": "1",
}  # fmt: skip
"""The example scripts' runs: 12 steps of 8 windows (2 micro-batches of 2 per process); the validation losses they
print at steps 6 and 12 over one batch (only that they are printed, and by whom, is checked)."""


def validation_loss(model: GPT) -> float:
    """``model``'s loss over the first 20 validation batches of 8 windows of the default corpus."""
    _, val = _validation_set(model.config.block_size)
    return evaluate(model, val, 20, 8, torch.device("cpu"))


@functools.cache
def _validation_set(block_size: int) -> tuple[TextWindows, TextWindows]:
    return text_datasets(block_size)


@functools.cache
def untrained_validation_loss(config: GPTConfig) -> float:
    """The seeded, untrained model's :func:`validation_loss`: what both scripts' trained models must beat."""
    return validation_loss(seeded_model(config))


@pytest.mark.slow
def test_the_ddp_script_trains_under_torchrun_and_rank_0_alone_logs_and_saves(tmp_path: Path) -> None:
    """2 Gloo processes, 12 steps of 8 windows (2 micro-batches of 2 per rank): the saved model's validation
    loss is below the initial model's, and rank 0 alone printed the 2 validation losses."""
    script = Path(__file__).resolve().parents[2] / "examples" / "gpt_ddp.py"
    output = tmp_path / "gpt.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script),
    ]  # fmt: skip
    environment = {**os.environ, **SCRIPT_SETTINGS, "GPT_OUTPUT": str(output), "OMP_NUM_THREADS": "1"}
    environment["GLOO_SOCKET_IFNAME"] = "lo"
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.findall(r"^step (\d+): val loss", result.stdout, re.MULTILINE) == ["6", "12"], result.stdout
    saved = torch.load(output, weights_only=True)
    trained = GPT(GPTConfig(**saved["config"]))
    trained.load_state_dict(saved["model"])
    initial, final = untrained_validation_loss(trained.config), validation_loss(trained)
    assert final < initial - 0.5, (initial, final)


@pytest.mark.slow
def test_the_stalwart_script_trains_two_workers_and_ends_where_the_ddp_script_does(tmp_path: Path) -> None:
    """examples/gpt.py as written: two workers against a lighthouse with no plan of its own (the script's is
    adopted); the leader alone logs the 2 validation losses and saves; its model trains like the DDP twin's."""
    from stalwart.coord.server import Lighthouse

    script = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    output = tmp_path / "gpt.pt"
    with Lighthouse(None, min_replicas=2, start_replicas=2, join_timeout=60.0) as lighthouse:
        environment = {**os.environ, **SCRIPT_SETTINGS, "GPT_OUTPUT": str(output)}
        environment["STALWART_LIGHTHOUSE"] = lighthouse.url
        workers = [
            subprocess.Popen(
                [sys.executable, str(script)],
                env={**environment, "STALWART_MEMBER": f"w{number}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for number in range(2)
        ]
        outputs = [worker.communicate(timeout=240) for worker in workers]
        status = lighthouse.status()
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-4000:]
    printed = [stdout for stdout, _ in outputs if stdout.strip()]
    assert len(printed) == 1 and re.findall(r"^step (\d+): val loss", printed[0], re.MULTILINE) == ["6", "12"]
    assert status["plan"]["global_batch_size"] == 8 and status["ledger"]["step"] == 12
    saved = torch.load(output, weights_only=True)
    trained = GPT(GPTConfig(**saved["config"]))
    trained.load_state_dict(saved["model"])
    initial, final = untrained_validation_loss(trained.config), validation_loss(trained)
    assert final < initial - 0.5, (initial, final)
