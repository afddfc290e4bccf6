"""The PyTorch peer of benchmarks.peers: the same ViT as an nn.Module
(F.scaled_dot_product_attention, bf16 autocast for bf16, fused AdamW on CUDA), run eager
or with its forward + loss under torch.compile. Read it beside vit_pure/model.py.

The driver runs it in a process of its own (`python -m benchmarks.peers.pytorch --child
JOB`), and only where torch is installed; it imports neither JAX nor the kit.
"""
from __future__ import annotations

import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import harness
from benchmarks.peers.common import BETAS, CLIP, LABEL_SMOOTHING, LR, WEIGHT_DECAY, child


def make_torch_vit(cfg: dict):
    """The same ViT as a torch nn.Module (weights std 0.02 truncated normal)."""
    E, H, M = cfg["width"], cfg["heads"], cfg["mlp_dim"]
    S, p = cfg["image_size"], cfg["patch_size"]
    T = (S // p) ** 2 + 1

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.ln2 = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
            self.fc1, self.fc2 = nn.Linear(E, M), nn.Linear(M, E)
            self.drop = nn.Dropout(cfg["dropout"])

        def forward(self, x):  # (B, T, E)
            B = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D)
            x = x + self.drop(self.out(a.transpose(1, 2).reshape(B, T, E)))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Linear(p * p * cfg["channels"], E)
            self.cls = nn.Parameter(torch.zeros(1, 1, E))
            self.pos = nn.Parameter(torch.zeros(1, T, E))
            self.drop = nn.Dropout(cfg["dropout"])
            self.blocks = nn.Sequential(*[Block() for _ in range(cfg["depth"])])
            self.final_ln = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.head = nn.Linear(E, cfg["num_classes"])
            for name, w in self.named_parameters():
                if (name.endswith("weight") and w.ndim == 2) or name == "pos":
                    nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04)
                elif name.endswith("bias"):
                    nn.init.zeros_(w)

        def forward(self, images):  # (B, H, W, C) float32, normalised
            B, C = images.shape[0], images.shape[-1]
            x = images.reshape(B, S // p, p, S // p, p, C).permute(0, 1, 3, 2, 4, 5)
            x = self.patch(x.reshape(B, T - 1, p * p * C))
            x = torch.cat([self.cls.expand(B, -1, -1).to(x.dtype), x], 1) + self.pos
            x = self.blocks(self.drop(x))
            return self.head(self.final_ln(x[:, 0]))

    return ViT()


def run_torch(job: dict) -> dict:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:  # float32 matmuls: TF32 unless --matmul-precision highest
        tf32 = job["precision"] == "default"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    model = make_torch_vit(job["cfg"]).to(dev).train()
    named = list(model.named_parameters())
    decay = [w for n, w in named if n.endswith("weight") and w.ndim == 2]
    rest = [w for n, w in named if not (n.endswith("weight") and w.ndim == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, fused=cuda)
    mean = torch.tensor(job["mean"], device=dev)
    std = torch.tensor(job["std"], device=dev)
    bf16 = job["dtype"] == "bf16"

    def loss_fn(images_u8, labels):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model((images_u8.float() / 255.0 - mean) / std)
        return F.cross_entropy(logits.float(), labels, label_smoothing=LABEL_SMOOTHING)

    if job["entry"] == "torch-compile":
        loss_fn = torch.compile(loss_fn, mode=job["compile_mode"])
    batches = [(torch.from_numpy(x), torch.from_numpy(y).long())
               for x, y in harness.host_batches(job["batch"])]
    if cuda:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        torch.cuda.reset_peak_memory_stats()

    def dispatch(i):
        images, labels = (t.to(dev, non_blocking=True) for t in batches[i % len(batches)])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(images, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    first = dispatch(0).item()  # compilation, cuBLAS / autotuning set-up
    compile_s = time.perf_counter() - t0
    losses = []
    step_s = harness.time_steps(dispatch, lambda t: losses.append(t.item()), job["warmup"],
                                job["steps"]).wall
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    return {"device": f"{name} ({dev.type}, torch {torch.__version__})", "step_s": step_s,
            "compile_s": compile_s, "loss": losses[-1] if losses else first,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "params": sum(w.numel() for w in model.parameters())}


if __name__ == "__main__":
    sys.exit(child(run_torch, sys.argv))
