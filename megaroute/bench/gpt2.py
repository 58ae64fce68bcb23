"""An independent speed baseline for bench.step: nanoGPT's model architecture, written plainly.

GPT-2 blocks as nanoGPT builds them (no biases, no dropout): pre-LayerNorm, one qkv projection,
torch's causal SDPA, a 4x GELU MLP, learned absolute positions, an LM head tied to the token
embedding, F.cross_entropy on the logits. At megaroute's default SwiGLU width (8/3 d) the two
models do the same matmul FLOPs per step (FlopCounterMode, tests/unit/bench/test_bench.py), so
their step times compare the implementations, not the architectures' arithmetic.

Not a training model: it exists so `python -m megaroute.bench.step` can time megaroute's dense
step against a plain PyTorch GPT in the same run (issue 19's target: dense <= 0.9x this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..config import ModelConfig


@dataclass
class Output:
    loss: torch.Tensor


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc_out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.wte.weight = self.head.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> Output:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return Output(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def optimizer(model: GPT2, lr: float = 1e-4, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """nanoGPT's AdamW: decay on matrices only; torch's fused kernel on CUDA, its default elsewhere."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=cuda or None)


def train_flops(model: nn.Module, seq_len: int, vocab_size: int) -> int:
    """FLOPs of one forward + backward of one sequence, counted by torch's FlopCounterMode."""
    tokens = torch.randint(0, vocab_size, (1, seq_len + 1), device=next(model.parameters()).device)
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()
