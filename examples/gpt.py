"""A small GPT trained with stalwart: examples/gpt_ddp.py with its DDP lines changed (the README shows the diff).

    stalwart lighthouse --port 29510 --min-replicas 2 & export STALWART_LIGHTHOUSE=http://127.0.0.1:29510
    STALWART_MEMBER=w0 python examples/gpt.py & STALWART_MEMBER=w1 python examples/gpt.py

AdamW over weight-decay groups, cosine learning rate with warm-up, gradient
accumulation to a fixed global batch, autocast (bf16 on CPU, fp16 with a
GradScaler on CUDA), clipping at 1.0, validation loss and logging on rank 0,
and rank 0 saves the final model. The corpus is generated locally
(``stalwart.launch.gpt``). ``GPT_STEPS``, ``GPT_GLOBAL_BATCH``,
``GPT_MICRO_BATCH``, ``GPT_EVAL_EVERY`` and ``GPT_OUTPUT`` override the
constants below.
"""

import os
from dataclasses import asdict

import torch

from stalwart import ElasticLoader, EpochPlan, Manager
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


manager = Manager(model, optimizer, max_microbatch=MICRO_BATCH, plan=EpochPlan(len(train), GLOBAL_BATCH))
manager.register_state("scheduler", scheduler)  # healed with the model and optimizer
manager.register_state("scaler", scaler)

for step in manager.steps(ElasticLoader(train), max_steps=MAX_STEPS):
    for inputs, targets in step:  # this worker's share of the step, in micro-batches of at most MICRO_BATCH
        with torch.autocast(device.type, dtype=AMP_DTYPE):
            _, loss = model(inputs.to(device), targets.to(device))
        step.backward(loss, scaler=scaler)  # the step's gradient: the mean over its samples
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if (step.number + 1) % EVAL_EVERY == 0:  # the others go on and wait before the next all-reduce
        manager.on_leader(log, step.number + 1)
if manager.is_leader:
    os.makedirs(os.path.dirname(OUTPUT) or ".", exist_ok=True)
    torch.save({"config": asdict(config), "model": model.state_dict()}, OUTPUT)
manager.close()
