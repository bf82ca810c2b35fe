"""Probe: does a 2-layer byte model learn passkey retrieval, and how fast?

Trains one model with the recipe of ``fastweights reproduce infini-passkey`` (its task and
retrieval code) and every 50 steps prints the training losses and the exact-match / per-digit
accuracy of 9 prompts (depths 0, 0.5, 1) at the longest training length. One thread:

    OMP_NUM_THREADS=1 python probe.py MIXER STEPS MIN_LEN MAX_LEN LR KEY_WEIGHT [SEGMENT UPDATE]
"""

import sys
import time

import torch
import torch.nn.functional as F

from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce import infini_passkey_bytes as ip
from fastweights.train.trainer import TrainConfig, lr_factor

mixer, steps, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lr, key_weight = float(sys.argv[5]), float(sys.argv[6])
opts = {"segment_len": int(sys.argv[7]), "update": sys.argv[8]} if mixer == "infini" else {}
cfg = LMConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, mixer=mixer, mixer_options=opts)
torch.manual_seed(0)
model = LanguageModel(cfg).train()
opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
schedule = TrainConfig(steps=steps, lr=lr, warmup=max(1, steps // 10))
gen, t0 = torch.Generator().manual_seed(1), time.time()
for step in range(steps):
    for group in opt.param_groups:
        group["lr"] = lr * lr_factor(step, schedule)
    length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    prompts, answers = ip._batch(ip._n_filler(length), torch.rand(8, generator=gen).tolist(), gen)
    ids = torch.cat([prompts, answers], 1)
    logits, _ = model(ids[:, :-1])
    targets = ids[:, 1:]
    loss_all = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss_key = F.cross_entropy(logits[:, -5:].flatten(0, 1), targets[:, -5:].flatten())
    (loss_all + key_weight * loss_key).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    if step % 50 == 0 or step == steps - 1:
        model.eval()
        with torch.no_grad():
            p, a = ip._batch(ip._n_filler(hi), [0.0, 0.5, 1.0] * 3, torch.Generator().manual_seed(5))
            got = ip.retrieve(model, p, 4096)
        model.train()
        print(f"{step} all {loss_all.item():.3f} key {loss_key.item():.3f} "
              f"acc {(got == a).all(1).float().mean().item():.2f} "
              f"digit {(got == a).float().mean().item():.2f} t {time.time() - t0:.0f}s", flush=True)
