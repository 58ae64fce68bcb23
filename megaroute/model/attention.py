"""Causal self-attention over a (possibly gathered) token sequence.

Under tensor parallelism each rank owns n_heads / tp heads: qkv is column-parallel (split per
q/k/v block), the output projection row-parallel (its all-reduce returns a replicated result).

`fused` (default True) splits qkv and applies RoPE in one autograd function in the compute dtype
(rope.split_qkv_rotary; plain ops that inductor fuses when torch.compile traces it) and, on CPU,
runs float32 causal attention through a fused kernel (kernels/cpu.py) and bf16 as explicit
matmuls (`causal_attention`), both as opaque registered ops under torch.compile (inference, float32
and bf16: the float32 kernel on the projection, CausalSelfAttention._attend_in_place);
`fused = False` keeps the reference math (float32 RoPE, torch's SDPA kernel),
which tests/unit/model/test_fused.py holds the fused path to.

`forward_varlen` attends within each of several sequences laid end to end (the ragged routed path,
routing/ragged.py): a varlen kernel on CUDA; on CPU the fused varlen kernel at inference, a few
length-sorted padded buckets with autograd.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from ..kernels import cpu, functions
from ..kernels.backend import aten_required, op_registered
from ..parallel import ColumnParallelLinear, RowParallelLinear, tp_size
from ..parallel.mappings import Group
from .hooks import forward_observed
from .rope import Positions, apply_rotary, split_qkv_rotary

EAGER_MAX_LEN = 1024
# CPU bf16 attention (_CausalAttention: training, or inference where the fused kernels did not build):
# queries per block for sequences longer than one block. Against one block at [8, 6, T, 64]: forward +
# backward (2 threads, AMX) T 512 0.57x, 256 0.77x, 192 1.00x, 128 1.02x; on a Zen 5 (1-2 threads)
# T 128-224 0.87-1.03x, a forward alone (1 thread) T 128-210 0.68-0.75x; fewer probabilities saved.
QUERY_BLOCK = 64
VARLEN_BUCKETS = 2  # CPU varlen attention: padded groups of sequences (BucketLayout)
# Cached decoding's SDPA (a boolean mask, a key length that grows every step): not cuDNN's, which
# builds an execution plan for each new key length (4.9 ms of host time per call, 16-layer model,
# H100, torch 2.11: sampling ran at 74 tokens/s).
CACHED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def query_blocks(T: int) -> list[tuple[int, int]]:
    """The query rows [a, b) of each block _CausalAttention computes (keys [0, b) each)."""
    step = QUERY_BLOCK if T > QUERY_BLOCK else max(T, 1)
    return [(a, min(T, a + step)) for a in range(0, T, step)]


def saved_probability_elements(T: int) -> int:
    """Per head: the softmax probabilities _CausalAttention keeps for backward (each block's rows x keys)."""
    return sum((b - a) * b for a, b in query_blocks(T))


def _blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """_CausalAttention's forward math: -> (out, q scaled, each query block's probabilities)."""
    B, H, T, Dh = q.shape
    scale = Dh ** -0.5
    qs, k3, v3 = (q * scale).reshape(B * H, T, Dh), k.reshape(B * H, T, Dh), v.reshape(B * H, T, Dh)
    out = cpu.attention_output(q)
    probs = []
    for a, b in query_blocks(T):
        scores = torch.bmm(qs[:, a:b], k3[:, :b].transpose(1, 2))
        future = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu_(1)
        scores[:, :, a:].masked_fill_(future, float("-inf"))
        probs.append(torch.softmax(scores, dim=-1))
        out[:, :, a:b] = torch.bmm(probs[-1], v3[:, :b]).view(B, H, b - a, Dh)
    return out, qs, probs


def _blocked_attention_backward(grad: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                probs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_CausalAttention's backward math (qs: q scaled, [B * H, T, Dh]) -> (grad q, k, v) [B, H, T, Dh]."""
    BH, T, Dh = qs.shape
    k3, v3, g3 = k.reshape(BH, T, Dh), v.reshape(BH, T, Dh), grad.reshape(BH, T, Dh)
    grad_q, grad_k, grad_v = torch.empty_like(qs), torch.zeros_like(k3), torch.zeros_like(v3)
    for (a, b), p in zip(query_blocks(T), probs):
        g = g3[:, a:b]
        grad_v[:, :b].baddbmm_(p.transpose(1, 2), g)
        grad_scores = torch._softmax_backward_data(torch.bmm(g, v3[:, :b].transpose(1, 2)), p, -1, p.dtype)
        torch.bmm(grad_scores, k3[:, :b], out=grad_q[:, a:b])
        grad_k[:, :b].baddbmm_(grad_scores.transpose(1, 2), qs[:, a:b])
    shape = grad.shape
    return grad_q.mul_(Dh ** -0.5).view(shape), grad_k.view(shape), grad_v.view(shape)


class _CausalAttention(torch.autograd.Function):
    """Causal attention over [B, H, T, Dh] as explicit matmuls (bf16 on CPU, `causal_attention`).

    Beyond QUERY_BLOCK tokens, queries go in blocks of QUERY_BLOCK rows, each against the keys up to
    its own last row, so the scores above the diagonal blocks are never computed (at T 256, 62.5% of
    the T x T work is); only the diagonal block is masked. The scale goes on q before the scores (on
    T x Dh, not T x T, elements; exact for power-of-two scales such as Dh 64's 1/8), the softmax
    accumulates in float32 and is saved in q's dtype (scores rounded like eager HF attention's), and
    backward is written out: softmax's own backward already gives masked scores a zero gradient
    (their probability is 0), so no backward pass of the masking or of the scale runs over the scores.
    Under torch.compile the same math runs as registered opaque ops (_register_traceable_blocked_attention).
    """

    @staticmethod
    def forward(ctx, q, k, v):
        out, qs, probs = _blocked_attention(q, k, v)
        ctx.save_for_backward(qs, k, v, *probs)
        return out

    @staticmethod
    def backward(ctx, grad):
        qs, k, v, *probs = ctx.saved_tensors
        return _blocked_attention_backward(grad, qs, k, v, probs)


def _register_traceable_blocked_attention() -> None:
    """torch.ops.megaroute.blocked_attention(q, k, v) -> (out, probabilities) and its backward op:
    _CausalAttention's math as ops torch.compile keeps opaque, with autograd. Traced, inductor
    computed every block's full T x T scores: forward + backward at [8, 6, 256, 64] bf16 took 15.7 ms
    compiled against 9.4 eager (2 threads), which cancelled what compiling gained elsewhere in a bf16
    step. Registered once per process: a converted model's remote code carries its own copy of this
    module (hf/bundle.py), whose registration finds the ops there already."""
    if op_registered("blocked_attention"):
        return

    @torch.library.custom_op("megaroute::blocked_attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor[])")
    def attention(q, k, v):
        out, _, probs = _blocked_attention(q, k, v)
        return out, probs

    @attention.register_fake
    def _(q, k, v):
        B, H, T, Dh = q.shape
        return cpu.attention_output(q), [q.new_empty(B * H, b - a, b) for a, b in query_blocks(T)]

    @torch.library.custom_op("megaroute::blocked_attention_backward", mutates_args=(),
                             schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor[] probs) -> (Tensor, Tensor, Tensor)")
    def attention_backward(grad, q, k, v, probs):
        B, H, T, Dh = q.shape
        return _blocked_attention_backward(grad, (q * Dh ** -0.5).reshape(B * H, T, Dh), k, v, probs)

    @attention_backward.register_fake
    def _(grad, q, k, v, probs):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    def save(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1])

    def backward(ctx, grad, _grad_probs):
        q, k, v, *probs = ctx.saved_tensors
        return tuple(torch.ops.megaroute.blocked_attention_backward(grad, q, k, v, probs))

    attention.register_autograd(backward, setup_context=save)


_register_traceable_blocked_attention()


class _CausalAttentionF32(torch.autograd.Function):
    """float32 causal attention on CPU through the fused kernel (kernels/cpu.py): per head, queries in
    blocks of 64 against the keys up to their last row, the softmax's logsumexp saved and the
    probabilities recomputed in backward; it saves what torch's flash kernel saves (q, k, v, out,
    logsumexp). Forward + backward at [8, 6, 256, 64]: 7.3 ms against SDPA's 13.3 (2 threads)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = cpu.load().causal_attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        # the out-projection's backward hands grad over [B, T, H, Dh]-strided: read in place
        return tuple(cpu.load().causal_attention_backward(cpu.rows(grad), q, k, v, out, lse))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over [B, H, T, Dh]. float32 on CPU with the fused kernels: _CausalAttentionF32.
    bf16 on CPU: explicit matmuls (_CausalAttention) with the
    softmax accumulated in float32: forward + backward at [8, 6, 256, 64] took 7.0 ms against 13.2
    ms for torch's CPU flash kernel (and 9.1 ms for the same matmuls under autograd; 2 threads,
    torch 2.13, AMX); under torch.compile the same math as registered opaque ops
    (_register_traceable_blocked_attention). Everything else (fp32 without
    the kernels, where explicit matmuls took 25.2 ms against SDPA's 24.7), and bf16 sequences longer
    than EAGER_MAX_LEN (the [B, H, T, T] scores grow quadratically): torch's SDPA. The two CPU
    functions return [B, H, T, Dh] with rows laid out [B, T, H, Dh], so the output projection's
    y.transpose(1, 2).reshape(B, T, D) is a view, not a copy. Under torch.compile, float32 on CPU runs
    the same kernels as registered opaque ops (kernels/cpu.py; traced, it would be torch's CPU flash
    kernel, 3x their time). Inference on CPU, float32 and bf16, takes the fused kernel before it gets
    here (CausalSelfAttention._attend_in_place)."""
    T = q.shape[-2]
    if q.dtype == torch.float32 and getattr(cpu.usable(q, k, v), "causal_attention_forward", None) is not None:
        return functions.apply(_CausalAttentionF32, q, k, v)
    if q.dtype == torch.float32 and q.device.type == "cpu" and torch.compiler.is_compiling():
        return torch.ops.megaroute.causal_attention_f32(q, k, v)[0]
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or T > EAGER_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if torch.compiler.is_compiling():
        return torch.ops.megaroute.blocked_attention(q, k, v)[0]
    if aten_required():  # a dispatch mode (FlopCounterMode, fake tensors) sees SDPA, as in float32
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return functions.apply(_CausalAttention, q, k, v)


def _length_buckets(lengths: list[int], n_buckets: int) -> list[list[int]]:
    """The non-empty sequences (indices into lengths) sorted longest first and cut into n_buckets runs
    (empty ones last when there are fewer sequences), each to be padded to its first (longest) length:
    cuts are added greedily, each where it removes the most padded score work, sum(size * longest^2)."""
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    sq = [lengths[i] ** 2 for i in order]
    cuts = [0, len(order)]
    while len(cuts) - 1 < n_buckets:
        best, gain = None, 0
        for a, b in zip(cuts, cuts[1:]):  # cutting run [a, b) at c pads rows c.. to sq[c], not sq[a]
            for c in range(a + 1, b):
                if (b - c) * (sq[a] - sq[c]) > gain:
                    best, gain = c, (b - c) * (sq[a] - sq[c])
        if best is None:
            break
        cuts = sorted([*cuts, best])
    runs = [order[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    return runs + [[] for _ in range(n_buckets - len(runs))]


class BucketLayout:
    """Sequences laid end to end ([N, ...] rows, lengths their counts) in n_buckets padded buckets:
    bucket after bucket, each [its sequences, its longest length] row-major (`_length_buckets`; always
    n_buckets of them, empty ones included, so the torch calls do not depend on the data). A padding slot
    repeats its sequence's last real row: padding follows the real rows, so causal attention hides it
    from every real query, and its outputs are dropped (no gradient reaches it)."""

    def __init__(self, lengths: list[int], n_buckets: int, device: torch.device):
        self.buckets = []  # (first slot, sequences, longest)
        base, order, width, S = [0] * len(lengths), [], [], 0
        for seqs in _length_buckets(lengths, n_buckets):
            self.buckets.append((S, len(seqs), lengths[seqs[0]] if seqs else 0))
            for s in seqs:
                base[s], S = S, S + lengths[seqs[0]]
                order.append(s)
                width.append(lengths[seqs[0]])
        starts = list(itertools.accumulate(lengths, initial=0))[:-1]
        base_t, starts_t, len_t = torch.tensor([base, starts, lengths], dtype=torch.long, device=device)
        order_t, width_t = torch.tensor([order, width], dtype=torch.long, device=device).view(2, -1)
        seq = order_t.repeat_interleave(width_t, output_size=S)  # per slot
        j = torch.arange(S, device=device) - base_t[seq]
        self.source = starts_t[seq] + torch.minimum(j, len_t[seq] - 1)  # [S]: the row each slot reads
        row_seq = torch.arange(len(lengths), device=device).repeat_interleave(len_t, output_size=sum(lengths))
        self.slot = base_t[row_seq] + torch.arange(row_seq.shape[0], device=device) - starts_t[row_seq]  # [N]

    def slot_coordinates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per slot [S]: its bucket, its sequence within the bucket and its position in that sequence
        (the indices the fused CPU kernels address [sequences, H, longest, Dh] bucket tensors by)."""
        firsts, sizes, widths = (torch.tensor(v, dtype=torch.long, device=self.source.device)
                                 for v in zip(*((first, n * kmax, max(kmax, 1)) for first, n, kmax in self.buckets)))
        bucket = torch.arange(len(self.buckets), device=self.source.device).repeat_interleave(
            sizes, output_size=self.source.shape[0])
        local = torch.arange(self.source.shape[0], device=self.source.device) - firsts[bucket]
        return bucket, local // widths[bucket], local % widths[bucket]

    def pad(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """[N, *rest] -> per bucket [sequences, longest, *rest]."""
        padded = flat.index_select(0, self.source)
        return [padded.narrow(0, first, n * kmax).view(n, kmax, *flat.shape[1:]) for first, n, kmax in self.buckets]

    def unpad(self, padded: list[torch.Tensor]) -> torch.Tensor:
        """Per bucket [sequences, longest, *rest] -> the N real rows [N, *rest]."""
        return torch.cat([p.reshape(-1, *p.shape[2:]) for p in padded]).index_select(0, self.slot)


def jagged_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Causal attention within each of the sequences laid end to end in q, k, v [N, H, Dh] (lengths:
    their counts, summing to N, zeros allowed) -> [N, H, Dh], as one varlen kernel (cu_seqlens style)
    through a jagged nested tensor: torch's flash / memory-efficient SDPA on CUDA. torch 2.13 has no
    causal jagged SDPA on CPU. On CUDA, tests/cuda/test_model_cuda.py holds it (through hard halting's
    and causal MoD's ragged updates) to the CPU path's logits."""
    nonempty = [n for n in lengths if n]  # the fused kernels reject empty sequences
    offsets = torch.tensor(list(itertools.accumulate(nonempty, initial=0)), device=q.device)
    nested = [torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets, min_seqlen=min(nonempty),
                                                    max_seqlen=max(nonempty)).transpose(1, 2) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*nested, is_causal=True).transpose(1, 2).values()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, tp_group: Group = None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.n_heads = n_heads // tp_size(tp_group)  # local heads
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, group=tp_group, chunks=3)
        self.out = RowParallelLinear(d_model, d_model, group=tp_group)
        self.fused = True  # False: the reference math (see the module docstring)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: Optional[Positions] = None, lengths: Optional[list[int]] = None) -> torch.Tensor:
        """x [B, T, D], tokens in ascending position order, so index order is causal order.

        With `pos.kv` (incremental decoding) the keys/values of pos's real rows are appended to that
        layer cache and the queries attend to everything cached at earlier or equal positions.
        With `lengths`: `forward_varlen` (x [N, D], sequences laid end to end), through the module
        call so hooks (FLOP counters, profilers) see this module.
        """
        if lengths is not None:
            return self.forward_varlen(x, cos, sin, lengths)
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        if pos is None or pos.kv is None:
            y = self._attend_in_place(qkv, cos, sin)
            if y is not None:
                return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if self.fused:
            q, k, v = split_qkv_rotary(qkv, cos, sin)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if pos is None or pos.kv is None:
            y = causal_attention(q, k, v) if self.fused else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask, causal = pos.kv.append(k, v, pos.positions, pos.valid, pos.start)
            # CACHED_BACKENDS: Transformer.forward selects them around its layers when it decodes
            y = F.scaled_dot_product_attention(q, pos.kv.k, pos.kv.v, attn_mask=mask, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # T may be 0

    def _attend_in_place(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
        """Causal attention of qkv [B, T, 3, H, Dh] -> [B, H, T, Dh] (rows laid out [B, T, H, Dh], in
        qkv's dtype) for inference on CPU (no autograd, the fused kernels built; else None): RoPE in
        place on float32 rows of the projection (_float32_rows) and the attention kernel reading q, k
        and v as strided views of them, as forward_varlen does: no q, k, v buffers written and read
        back. float32: a dense forward took 0.2-1.2% less at nanoGPT's shape (8 x 256, d 384: 298.6 ->
        297.9 and 295.3 -> 291.9 ms) and 2-4% less at the char shape (16 x 128, d 128: 39.7 -> 38.8,
        38.8 -> 37.2 ms; two runs each, 1 thread, interleaved in one process), the values the fused
        training path's, bit for bit. bf16: the kernel on a float32 copy, the output rounded to bf16,
        against the bf16 matmuls (`causal_attention`) at nanoGPT's shape (forward, [8, 6, 256, 64], 1
        thread) 3.5-4.1 ms against 4.5-4.8, and more exact."""
        B, T, _, H, Dh = qkv.shape
        if not (self.fused and T > 0 and cos.shape == sin.shape == (B, 1, T, Dh // 2)) or (
                torch.is_grad_enabled() and qkv.requires_grad):
            return None
        kernels = cpu.usable(qkv)
        rows = self._float32_rows(qkv, kernels, "causal_attention_forward")
        if rows is None:
            return None
        tables = (cos.float(), sin.float())
        if cpu.usable(rows, *tables) is None:
            return None
        kernels.rotary_qkv_inplace(rows, *tables)
        q, k, v = (rows.select(2, i).transpose(1, 2) for i in range(3))
        return kernels.causal_attention_forward(q, k, v)[0].to(qkv.dtype)

    def _float32_rows(self, qkv: torch.Tensor, kernels, kernel: str) -> Optional[torch.Tensor]:
        """The projection as float32 rows this call owns, for the fused inference kernel `kernel`, or
        None where it does not run: float32 qkv itself when no forward hook could hold it (RoPE rotates
        it in place), bf16 qkv as a float32 copy (private by construction; the caller rounds the
        attention output back to bf16)."""
        if kernels is None or not hasattr(kernels, kernel):
            return None
        if qkv.dtype == torch.bfloat16:
            return qkv.float()
        return qkv if qkv.dtype == torch.float32 and self._projection_is_private() else None

    def _projection_is_private(self) -> bool:
        """Whether qkv's output belongs to this call alone, so that RoPE may rotate it in place: no
        forward hook, on `qkv` or global, that could have kept it (an activation capture) or returned
        a tensor its caller still holds. With one, the out-of-place path runs."""
        return not forward_observed(self.qkv)

    def _rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, 3, H, Dh], tables [B, 1, T, Dh/2] -> rotated q, k and v, each [B, H, T, Dh]."""
        if self.fused:
            return split_qkv_rotary(qkv, cos, sin)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward_varlen(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                       n_buckets: int = VARLEN_BUCKETS) -> torch.Tensor:
        """`forward` (no KV cache) of sequences laid end to end: x [N, D], each sequence's tokens in
        ascending position order, lengths their counts (python ints, zeros allowed), cos and sin
        [N, 1, 1, Dh/2] (Positions of positions [N, 1]); no token attends across sequences.

        The projections run on the N rows. CUDA (fp16/bf16/fp32): RoPE on the N rows and one varlen
        kernel (`jagged_causal_attention`). Elsewhere the projected rows are gathered
        once into `n_buckets` padded buckets of sequences sorted by length (BucketLayout), RoPE and
        causal attention per bucket: the same torch calls whatever the batch size or the lengths.
        Without autograd (hard halting and causal MoD run at inference) the fused CPU kernels
        (kernels/cpu.py) take over: RoPE in place on float32 projected rows (q, k and v are views of
        them: no copies) and attention per (sequence, head) at its own length
        (`varlen_attention_forward`: no layout, no padding), on the projection itself in float32 and on
        a float32 copy of it in bf16, whose output is rounded to bf16 (hard halting at 80% executed,
        nanoGPT's shape, bf16: 0.90 of dense's forward with the padded buckets, 0.83 so); while a
        forward hook could hold a float32 projection (_projection_is_private), they gather and rotate
        q, k, v straight into the buckets and gather the outputs back in one pass each, instead of an
        index_select, RoPE, a cat and a second index_select.
        """
        N, H, Dh = x.shape[0], self.n_heads, self.head_dim
        if sum(lengths) != N or min(lengths, default=0) < 0:
            raise ValueError(f"forward_varlen: lengths {lengths} must be >= 0 and sum to x's {N} rows")
        qkv = self.qkv(x).view(N, 1, 3, H, Dh)  # each row a length-1 "sequence" for _rotary
        if N and qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16, torch.float32):
            q, k, v = (t.squeeze(2) for t in self._rotary(qkv, cos, sin))
            y = jagged_causal_attention(q, k, v, lengths)
        else:
            attend = causal_attention if self.fused else partial(F.scaled_dot_product_attention, is_causal=True)
            no_grad = not (torch.is_grad_enabled() and qkv.requires_grad)
            kernels = cpu.usable(qkv) if self.fused and no_grad and N else None
            if kernels is not None:
                rows = self._float32_rows(qkv, kernels, "varlen_attention_forward")
                if rows is not None:  # float32 rows of the projection, this call's own: RoPE in place
                    kernels.rotary_qkv_inplace(rows.view(1, N, 3, H, Dh),
                                               *(t.float().reshape(N, Dh // 2).contiguous() for t in (cos, sin)))
                    q, k, v = rows.view(N, 3, H, Dh).unbind(1)
                    offsets = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.long)
                    y = kernels.varlen_attention_forward(q, k, v, offsets).view(N, H * Dh)
                    return self.out(y.to(qkv.dtype))
                cos, sin = (t.to(qkv.dtype).reshape(N, Dh // 2).contiguous() for t in (cos, sin))
            layout = BucketLayout(lengths, n_buckets, x.device)
            if kernels is not None:  # inference: the padding gather + RoPE, and the unpadding, one pass each
                coords = layout.slot_coordinates()
                qs, ks, vs = ([qkv.new_empty(n, H, kmax, Dh) for _, n, kmax in layout.buckets] for _ in range(3))
                kernels.rotary_qkv_scatter(qkv.view(N, 3, H, Dh), cos, sin, layout.source, *coords, qs, ks, vs)
                ys = [attend(q, k, v) for q, k, v in zip(qs, ks, vs)]
                y = kernels.gather_heads(ys, *(c.index_select(0, layout.slot) for c in coords))
                return self.out(y.view(N, H * Dh))
            ys = []
            for qkv_b, cos_b, sin_b in zip(*(layout.pad(t.squeeze(1)) for t in (qkv, cos, sin))):
                q, k, v = self._rotary(qkv_b, cos_b.transpose(1, 2), sin_b.transpose(1, 2))
                ys.append(attend(q, k, v).transpose(1, 2))
            y = layout.unpad(ys)
        return self.out(y.reshape(N, H * Dh))
