"""A small GPT trained with plain PyTorch DDP: the script a user has before stalwart.

    torchrun --nproc-per-node 2 examples/gpt_ddp.py

AdamW over weight-decay groups, cosine learning rate with warm-up, gradient
accumulation to a fixed global batch, autocast (bf16 on CPU, fp16 with a
GradScaler on CUDA), clipping at 1.0, validation loss and logging on rank 0,
and rank 0 saves the final model. The corpus is generated locally
(``stalwart.launch.gpt``). ``GPT_STEPS``, ``GPT_GLOBAL_BATCH``,
``GPT_MICRO_BATCH``, ``GPT_EVAL_EVERY`` and ``GPT_OUTPUT`` override the
constants below.
"""

import contextlib
import itertools
import os
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from stalwart.launch.gpt import GPT, GPTConfig, cosine_schedule, evaluate, optimizer_groups, text_datasets

MAX_STEPS = int(os.environ.get("GPT_STEPS", "300"))
GLOBAL_BATCH = int(os.environ.get("GPT_GLOBAL_BATCH", "32"))  # windows per optimizer step, over all ranks
MICRO_BATCH = int(os.environ.get("GPT_MICRO_BATCH", "8"))  # windows per forward/backward
EVAL_EVERY = int(os.environ.get("GPT_EVAL_EVERY", "50"))
EVAL_BATCHES = int(os.environ.get("GPT_EVAL_BATCHES", "20"))
OUTPUT = os.environ.get("GPT_OUTPUT", "out/gpt.pt")
LR, WEIGHT_DECAY, WARMUP_STEPS, MIN_LR_RATIO, SEED = 3e-3, 0.1, MAX_STEPS // 10, 0.1, 0

device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
AMP_DTYPE = torch.float16 if device.type == "cuda" else torch.bfloat16
config = GPTConfig()
train, val = text_datasets(config.block_size)
torch.manual_seed(SEED)
model = GPT(config).to(device)
optimizer = torch.optim.AdamW(optimizer_groups(model, WEIGHT_DECAY), lr=LR, betas=(0.9, 0.95))
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(WARMUP_STEPS, MAX_STEPS, MIN_LR_RATIO))
scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")  # fp16 needs loss scaling, bf16 not


def log(step):
    """The validation loss after ``step`` steps, and the learning rate."""
    val_loss = evaluate(model, val, EVAL_BATCHES, MICRO_BATCH, device)
    print(f"step {step}: val loss {val_loss:.4f}, lr {scheduler.get_last_lr()[0]:.2e}", flush=True)


dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
is_leader = dist.get_rank() == 0
ddp_model = DistributedDataParallel(model)
assert GLOBAL_BATCH % (MICRO_BATCH * dist.get_world_size()) == 0, "GLOBAL_BATCH: a multiple of MICRO_BATCH x world"
ACCUMULATION = GLOBAL_BATCH // (MICRO_BATCH * dist.get_world_size())  # micro-batches per rank and step
sampler = DistributedSampler(train, shuffle=True, seed=SEED, drop_last=True)
loader = DataLoader(train, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)


def step_batches():
    """Each step's ACCUMULATION micro-batches on this rank, epoch after epoch (set_epoch reshuffles)."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // ACCUMULATION):
            yield [next(batches) for _ in range(ACCUMULATION)]


def synced_on_last(micro_batches):
    """A step's micro-batches; DDP all-reduces the accumulated gradients in the last one's backward only."""
    for number, batch in enumerate(micro_batches, start=1):
        with contextlib.nullcontext() if number == len(micro_batches) else ddp_model.no_sync():
            yield batch


for step, micro_batches in enumerate(itertools.islice(step_batches(), MAX_STEPS), start=1):
    for inputs, targets in synced_on_last(micro_batches):
        with torch.autocast(device.type, dtype=AMP_DTYPE):
            _, loss = ddp_model(inputs.to(device), targets.to(device))
        scaler.scale(loss / ACCUMULATION).backward()  # the step's gradient: the mean over its micro-batches
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if step % EVAL_EVERY == 0 and is_leader:
        log(step)
if is_leader:
    os.makedirs(os.path.dirname(OUTPUT) or ".", exist_ok=True)
    torch.save({"config": asdict(config), "model": model.state_dict()}, OUTPUT)
dist.destroy_process_group()
