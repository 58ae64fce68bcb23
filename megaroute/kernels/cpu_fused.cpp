// Fused CPU kernels for a block's work (megaroute/kernels/cpu.py builds and loads them).
//
// Each one is a single pass over its rows, vectorised with ATen's Vectorized (AVX2 / AVX-512, the
// capability cpu.py compiles for) and parallel over rows with at::parallel_for, where the eager
// versions make several passes and allocate temporaries. float32 and bfloat16; arithmetic in float32.
//   swiglu_forward / swiglu_backward    mlp._SwiGLUFunction: act = silu(gate), out = act * up
//   rotary_qkv_forward / _backward       rope._SplitQKVRotary: split qkv, rotate q and k
//   rms_norm_forward / rms_norm_backward norm._RMSNormFunction
//   rotary_qkv_scatter / gather_heads    attention.forward_varlen without autograd: the padding
//                                        gather fused with RoPE, and the unpadding
//   rows_add                             ragged.update_rows without autograd: the update added back
//                                        to the selected rows while x is copied, one pass
//   router_grads                         routing/mod.py _RouteTopkGather's backward: x's three
//                                        gradients and the router weight's in one pass
//   causal_attention_forward / _backward float32 causal attention per head through oneDNN's brgemm
//                                        (attention._CausalAttentionF32; see its section below)
//   varlen_attention_forward             the same forward per (sequence, head) of rows laid end to
//                                        end: attention.forward_varlen in float32 without autograd
//   cross_entropy_rows                   lm_loss._LinearCrossEntropy: per row, the loss and its gradient
//                                        (and the row's argmax, for early exit's labels)
//   row_argmax                           parallel.parallel_argmax on CPU: torch.argmax(-1) in vector passes
//   quantile_update                      routing/calibration.py QuantileCut.update in one call
//   transpose_matrix                     cpu_linear's weight-gradient operands: a float32 matrix's
//                                        transpose, contiguous, over every thread
// Intermediate roundings follow the eager ops (a bf16 product is rounded where eager stores one), so
// RoPE matches them bit for bit; SwiGLU can differ in exp's last bit (eager's scalar tail uses libm).
// Built with -ffp-contract=off: a fused multiply-add would round differently from the eager ops.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<BFloat16>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kStep = 2 * kF;  // elements per step: two float vectors = one bf16 vector

// n (1..kStep) elements as two float vectors; lanes past n are zero.
inline void load(const float* p, int64_t n, fVec& a, fVec& b) {
  if (n >= kStep) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kF);
    return;
  }
  a = fVec::loadu(p, std::min(n, kF));
  b = n > kF ? fVec::loadu(p + kF, n - kF) : fVec(0.f);
}

inline void load(const BFloat16* p, int64_t n, fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_to_float<BFloat16>(n >= kStep ? bVec::loadu(p) : bVec::loadu(p, n));
}

inline void store(float* p, int64_t n, const fVec& a, const fVec& b) {
  if (n >= kStep) {
    a.store(p);
    b.store(p + kF);
    return;
  }
  a.store(p, std::min(n, kF));
  if (n > kF) b.store(p + kF, n - kF);
}

inline void store(BFloat16* p, int64_t n, const fVec& a, const fVec& b) {
  const bVec v = at::vec::convert_from_float<BFloat16>(a, b);
  if (n >= kStep) v.store(p);
  else v.store(p, n);
}

// Rounds to T's precision in place (nothing for float): where the eager ops store a T result.
template <typename T>
inline void round_to(fVec&, fVec&) {}

template <>
inline void round_to<BFloat16>(fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_to_float<BFloat16>(at::vec::convert_from_float<BFloat16>(a, b));
}

// Calls f(T{}) with T the C++ type of dtype (float32 or bfloat16, which check_cpu admits).
template <typename F>
inline void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) f(float{});
  else f(BFloat16{});
}

// Rows per parallel chunk: about 32k elements, so small tensors stay on one thread.
inline int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// A [B, H, S, Dh] tensor addressed through its strides, Dh contiguous: SDPA's CPU gradients, the
// varlen bucket tensors and attention's operands all come with other strides than q's.
template <typename T>
struct Heads {
  T* data;
  int64_t b, h, s;  // s: one row (position) to the next
  explicit Heads(const at::Tensor& t) : data(t.data_ptr<T>()), b(t.stride(0)), h(t.stride(1)), s(t.stride(2)) {}
  T* at(int64_t bb, int64_t hh, int64_t ss) const { return data + bb * b + hh * h + ss * s; }
};

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && (t.stride(3) == 1 || t.numel() == 0), name,
              " must be a CPU [B, H, T, Dh] tensor with its last dimension contiguous");
}

// ----------------------------------------------------------------------------------------- SwiGLU

template <typename T>
void swiglu_forward_kernel(const T* gate_up, T* act, T* out, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, grain(3 * h), [&](int64_t r0, int64_t r1) {
    const fVec one(1.f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * h;
      const T* u = g + h;
      for (int64_t i = 0; i < h; i += kStep) {
        const int64_t n = std::min(kStep, h - i);
        fVec g0, g1, u0, u1;
        load(g + i, n, g0, g1);
        load(u + i, n, u0, u1);
        fVec a0 = g0 / (one + g0.neg().exp()), a1 = g1 / (one + g1.neg().exp());  // F.silu's formula
        round_to<T>(a0, a1);
        store(act + r * h + i, n, a0, a1);
        store(out + r * h + i, n, a0 * u0, a1 * u1);
      }
    }
  });
}

template <typename T>
void swiglu_backward_kernel(const T* grad, const T* gate_up, const T* act, T* grad_gate_up, int64_t rows,
                            int64_t h) {
  at::parallel_for(0, rows, grain(6 * h), [&](int64_t r0, int64_t r1) {
    const fVec one(1.f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * h;
      const T* u = g + h;
      T* dg = grad_gate_up + r * 2 * h;
      T* du = dg + h;
      for (int64_t i = 0; i < h; i += kStep) {
        const int64_t n = std::min(kStep, h - i);
        fVec d0, d1, g0, g1, u0, u1, a0, a1;
        load(grad + r * h + i, n, d0, d1);
        load(g + i, n, g0, g1);
        load(u + i, n, u0, u1);
        load(act + r * h + i, n, a0, a1);
        fVec t0 = d0 * u0, t1 = d1 * u1;  // eager: grad * up, stored in T
        round_to<T>(t0, t1);
        const fVec s0 = one / (one + g0.neg().exp()), s1 = one / (one + g1.neg().exp());
        store(dg + i, n, t0 * s0 * (one + g0 * (one - s0)), t1 * s1 * (one + g1 * (one - s1)));  // silu_backward's
        store(du + i, n, d0 * a0, d1 * a1);
      }
    }
  });
}

std::vector<at::Tensor> swiglu_forward(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  const int64_t h = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * h, "gate_up's last dimension must be even");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = h;
  at::Tensor act = at::empty(shape, gate_up.options()), out = at::empty(shape, gate_up.options());
  const int64_t rows = h ? gate_up.numel() / (2 * h) : 0;
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), out.data_ptr<T>(), rows, h);
  });
  return {act, out};
}

at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& gate_up, const at::Tensor& act) {
  check_cpu(grad, "grad");
  check_cpu(gate_up, "gate_up");
  check_cpu(act, "act");
  TORCH_CHECK(grad.scalar_type() == gate_up.scalar_type() && act.scalar_type() == gate_up.scalar_type(),
              "grad, gate_up and act must share a dtype");
  const int64_t h = act.size(-1);
  TORCH_CHECK(grad.sizes() == act.sizes() && gate_up.numel() == 2 * act.numel(), "shape mismatch");
  at::Tensor grad_gate_up = at::empty_like(gate_up);
  const int64_t rows = h ? act.numel() / h : 0;
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T>(grad.data_ptr<T>(), gate_up.data_ptr<T>(), act.data_ptr<T>(),
                              grad_gate_up.data_ptr<T>(), rows, h);
  });
  return grad_gate_up;
}

// ------------------------------------------------------------------------------------------- RoPE

// dst = rotary(src) over one head (half = Dh / 2): dst1 = x1 c - x2 s, dst2 = x2 c + x1 s, each
// product with cos rounded to T first (eager: mul, then addcmul_ on its result).
template <typename T>
inline void rotate_head(const T* src, T* dst, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += kStep) {
    const int64_t n = std::min(kStep, half - i);
    fVec x10, x11, x20, x21, c0, c1, s0, s1;
    load(src + i, n, x10, x11);
    load(src + half + i, n, x20, x21);
    load(c + i, n, c0, c1);
    load(s + i, n, s0, s1);
    fVec a0 = x10 * c0, a1 = x11 * c1, b0 = x20 * c0, b1 = x21 * c1;
    round_to<T>(a0, a1);
    round_to<T>(b0, b1);
    store(dst + i, n, a0 - x20 * s0, a1 - x21 * s1);
    store(dst + half + i, n, b0 + x10 * s0, b1 + x11 * s1);
  }
}

template <typename T>
void rotary_kernel(T* rows_in, const Heads<T>& q, const Heads<T>& k, const Heads<T>& v, const T* cos, const T* sin,
                   int64_t B, int64_t S, int64_t H, int64_t Dh, bool backward) {
  // rows_in: forward qkv [B, S, 3, H, Dh]; backward the gradient [B, S, 3, H, Dh] is written from q, k,
  // v [B, H, S, Dh]. cos / sin [B * S, Dh / 2] (backward: sin is already negated).
  const int64_t half = Dh / 2;
  at::parallel_for(0, B * S, grain(3 * H * Dh), [&](int64_t r0, int64_t r1) {
    for (int64_t bs = r0; bs < r1; ++bs) {
      const int64_t b = bs / S, t = bs % S;
      const T* c = cos + bs * half;
      const T* s = sin + bs * half;
      for (int64_t hh = 0; hh < H; ++hh) {
        T* packed = rows_in + (bs * 3 * H + hh) * Dh;  // q's head; k at + H * Dh, v at + 2 H Dh
        if (!backward) {
          rotate_head<T>(packed, q.at(b, hh, t), c, s, half);
          rotate_head<T>(packed + H * Dh, k.at(b, hh, t), c, s, half);
          T* src = packed + 2 * H * Dh;
          if (v.at(b, hh, t) != src) std::copy(src, src + Dh, v.at(b, hh, t));  // in place: v stays
        } else {
          rotate_head<T>(q.at(b, hh, t), packed, c, s, half);
          rotate_head<T>(k.at(b, hh, t), packed + H * Dh, c, s, half);
          std::copy(v.at(b, hh, t), v.at(b, hh, t) + Dh, packed + 2 * H * Dh);
        }
      }
    }
  });
}

void check_rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(qkv, "qkv");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  TORCH_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, "qkv must be [B, T, 3, H, Dh]");
  TORCH_CHECK(qkv.size(4) % 2 == 0 && cos.numel() == qkv.size(0) * qkv.size(1) * (qkv.size(4) / 2) &&
                  sin.numel() == cos.numel(),
              "cos and sin must hold [B, T, Dh / 2] values");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be in qkv's dtype");
}

// q and k of qkv [B, T, 3, H, Dh] rotated into q, k [B, H, T, Dh] (any strides, Dh contiguous), v copied.
void rotary_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& q,
                 const at::Tensor& k, const at::Tensor& v) {
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotary_kernel<T>(qkv.data_ptr<T>(), Heads<T>(q), Heads<T>(k), Heads<T>(v), cos.data_ptr<T>(), sin.data_ptr<T>(),
                     qkv.size(0), qkv.size(1), qkv.size(3), qkv.size(4), false);
  });
}

std::vector<at::Tensor> rotary_qkv_forward(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(qkv, cos, sin);
  const auto shape = {qkv.size(0), qkv.size(3), qkv.size(1), qkv.size(4)};  // [B, H, T, Dh]
  const auto opts = qkv.options();
  at::Tensor q = at::empty(shape, opts), k = at::empty(shape, opts), v = at::empty(shape, opts);
  rotary_into(qkv, cos, sin, q, k, v);
  return {q, k, v};
}

// Inference (no autograd): q and k rotated in place in qkv [B, T, 3, H, Dh]; the caller reads q, k and v
// as views of it. No q, k, v buffers, no copy of v. rotate_head reads each element pair before writing it.
void rotary_qkv_inplace(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(qkv, cos, sin);
  const auto heads = [&](int64_t i) { return qkv.select(2, i).permute({0, 2, 1, 3}); };
  rotary_into(qkv, cos, sin, heads(0), heads(1), heads(2));
}

// dq, dk, dv: any strides with Dh contiguous (SDPA's CPU backward returns them [B, T, H, Dh]-strided).
at::Tensor rotary_qkv_backward(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& cos,
                               const at::Tensor& neg_sin) {
  check_heads(dq, "dq");
  check_heads(dk, "dk");
  check_heads(dv, "dv");
  check_cpu(cos, "cos");
  check_cpu(neg_sin, "neg_sin");
  TORCH_CHECK(dk.sizes() == dq.sizes() && dv.sizes() == dq.sizes(), "dq, dk and dv must have one shape");
  TORCH_CHECK(dk.scalar_type() == dq.scalar_type() && dv.scalar_type() == dq.scalar_type() &&
                  cos.scalar_type() == dq.scalar_type() && neg_sin.scalar_type() == dq.scalar_type(),
              "dq, dk, dv, cos and sin must share a dtype");
  const int64_t B = dq.size(0), H = dq.size(1), S = dq.size(2), Dh = dq.size(3);
  TORCH_CHECK(Dh % 2 == 0 && cos.numel() == B * S * (Dh / 2) && neg_sin.numel() == cos.numel(),
              "cos and sin must hold [B, T, Dh / 2] values");
  at::Tensor grad = at::empty({B, S, 3, H, Dh}, dq.options());
  dispatch(dq.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotary_kernel<T>(grad.data_ptr<T>(), Heads<T>(dq), Heads<T>(dk), Heads<T>(dv), cos.data_ptr<T>(),
                     neg_sin.data_ptr<T>(), B, S, H, Dh, true);
  });
  return grad;
}

// Bucketed varlen attention on CPU (attention.forward_varlen without autograd; attention.BucketLayout):
// sequences laid end to end, padded per bucket into [n, H, kmax, Dh]. A slot is (bucket, sequence j
// in it, position t); rows are the N real tokens.

// Writes rotated q, k and v of each slot into the bucket tensors: slot s reads row source[s] of qkv
// [N, 3, H, Dh] and of cos / sin [N, Dh / 2] (the padding gather and RoPE in one pass).
void rotary_qkv_scatter(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& source,
                        const at::Tensor& bucket, const at::Tensor& seq, const at::Tensor& pos,
                        const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& ks,
                        const std::vector<at::Tensor>& vs) {
  check_cpu(qkv, "qkv");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3, "qkv must be [N, 3, H, Dh]");
  const int64_t N = qkv.size(0), H = qkv.size(2), Dh = qkv.size(3), half = Dh / 2, S = source.numel();
  TORCH_CHECK(Dh % 2 == 0 && cos.numel() == N * half && sin.numel() == cos.numel() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must hold [N, Dh / 2] values in qkv's dtype");
  for (const auto* t : {&source, &bucket, &seq, &pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == S, "slot indices must be int64 [S]");
  TORCH_CHECK(qs.size() == ks.size() && qs.size() == vs.size(), "one q, k and v per bucket");
  for (const auto* list : {&qs, &ks, &vs})
    for (const auto& t : *list) {
      check_heads(t, "a bucket tensor");
      TORCH_CHECK(t.size(1) == H && t.size(3) == Dh && t.scalar_type() == qkv.scalar_type(),
                  "bucket tensors must be [n, H, kmax, Dh] in qkv's dtype");
    }
  const int64_t* src = source.data_ptr<int64_t>();
  const int64_t* bkt = bucket.data_ptr<int64_t>();
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const std::vector<Heads<T>> dq(qs.begin(), qs.end()), dk(ks.begin(), ks.end()), dv(vs.begin(), vs.end());
    const T* in = qkv.data_ptr<T>();
    const T* cs = cos.data_ptr<T>();
    const T* sn = sin.data_ptr<T>();
    const int64_t buckets = static_cast<int64_t>(qs.size());
    at::parallel_for(0, S, grain(3 * H * Dh), [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t r = src[s], b = bkt[s];
        TORCH_CHECK(r >= 0 && r < N && b >= 0 && b < buckets, "slot index out of range");
        const T* row = in + r * 3 * H * Dh;
        for (int64_t hh = 0; hh < H; ++hh) {
          rotate_head<T>(row + hh * Dh, dq[b].at(sq[s], hh, ps[s]), cs + r * half, sn + r * half, half);
          rotate_head<T>(row + (H + hh) * Dh, dk[b].at(sq[s], hh, ps[s]), cs + r * half, sn + r * half, half);
          std::copy(row + (2 * H + hh) * Dh, row + (2 * H + hh + 1) * Dh, dv[b].at(sq[s], hh, ps[s]));
        }
      }
    });
  });
}

// out [N, H, Dh]: row r takes every head of (sequence seq[r], position pos[r]) of ys[bucket[r]], each
// [n, H, kmax, Dh] with any strides but a contiguous last dimension (the unpadding in one pass).
at::Tensor gather_heads(const std::vector<at::Tensor>& ys, const at::Tensor& bucket, const at::Tensor& seq,
                        const at::Tensor& pos) {
  TORCH_CHECK(!ys.empty(), "no bucket tensors");
  const auto dtype = ys[0].scalar_type();
  const int64_t H = ys[0].size(1), Dh = ys[0].size(3), N = bucket.numel();
  for (const auto& t : ys) {
    check_heads(t, "a bucket output");
    TORCH_CHECK(t.size(1) == H && t.size(3) == Dh && t.scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "bucket outputs must be float32 / bf16 [n, H, kmax, Dh] of one dtype");
  }
  for (const auto* t : {&bucket, &seq, &pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N, "row indices must be int64 [N]");
  at::Tensor out = at::empty({N, H, Dh}, ys[0].options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t* bkt = bucket.data_ptr<int64_t>();
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const std::vector<Heads<T>> src(ys.begin(), ys.end());
    T* o = out.data_ptr<T>();
    const int64_t buckets = static_cast<int64_t>(ys.size());
    at::parallel_for(0, N, grain(H * Dh), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = bkt[r];
        TORCH_CHECK(b >= 0 && b < buckets, "bucket index out of range");
        for (int64_t hh = 0; hh < H; ++hh) {
          const T* head = src[b].at(sq[r], hh, ps[r]);
          std::copy(head, head + Dh, o + (r * H + hh) * Dh);
        }
      }
    });
  });
  return out;
}

// --------------------------------------------------------------------------------- ragged combine

// rows: a contiguous CPU int64 [n], one per row of `per` (n_expected of them), strictly ascending
// indices of R rows; checked, then its data.
const int64_t* checked_rows(const at::Tensor& rows, int64_t R, int64_t n_expected, const char* op, const char* per) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == n_expected,
              op, ": rows must be a contiguous CPU int64 [n], one per ", per, " row");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < R && (j == 0 || r[j] > r[j - 1]),
                op, ": rows must be strictly ascending row indices of x's ", R, " rows");
  return r;
}

// out = x;  out[rows[j]] += weight[j] * delta[j] (weight absent: 1), each sum in float32 and rounded
// once to x's dtype, as ragged.update_rows' index_add does it. One pass over x's rows, where
// x.index_add makes two (a copy of x, then the selected rows once more); rows strictly ascending,
// so each chunk of output rows finds its first selected row by binary search.
template <typename X, typename T>
void rows_add_kernel(const X* x, const int64_t* rows, const T* delta, const float* weight, X* out,
                     int64_t R, int64_t n, int64_t D) {
  at::parallel_for(0, R, grain(D), [&](int64_t begin, int64_t end) {
    int64_t j = std::lower_bound(rows, rows + n, begin) - rows;
    for (int64_t i = begin; i < end; ++i) {
      const X* src = x + i * D;
      X* dst = out + i * D;
      if (j == n || rows[j] != i) {
        std::copy(src, src + D, dst);
        continue;
      }
      const T* d = delta + j * D;
      for (int64_t c = 0; c < D; c += kStep) {
        const int64_t m = std::min(kStep, D - c);
        fVec xa, xb, da, db;
        load(src + c, m, xa, xb);
        load(d + c, m, da, db);
        if (weight != nullptr) {  // the product rounded to float32 first, as the eager update is
          const fVec w(weight[j]);
          da = w * da;
          db = w * db;
        }
        store(dst + c, m, xa + da, xb + db);
      }
      ++j;
    }
  });
}

at::Tensor rows_add(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& delta,
                    const c10::optional<at::Tensor>& weight) {
  check_cpu(x, "x");
  check_cpu(delta, "delta");
  TORCH_CHECK(x.dim() == 2 && delta.dim() == 2 && delta.size(1) == x.size(1),
              "rows_add: x must be [R, D] and delta [n, D], got ", x.sizes(), " and ", delta.sizes());
  const int64_t R = x.size(0), n = rows.size(0), D = x.size(1);
  const int64_t* r = checked_rows(rows, R, delta.size(0), "rows_add", "delta");
  const float* w = nullptr;
  if (weight.has_value()) {
    TORCH_CHECK(weight->device().is_cpu() && weight->scalar_type() == at::kFloat && weight->is_contiguous() &&
                    weight->numel() == n,
                "rows_add: weight must be a contiguous CPU float32 [n]");
    w = weight->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch(delta.scalar_type(), [&](auto d_tag) {
      using T = decltype(d_tag);
      rows_add_kernel<X, T>(x.data_ptr<X>(), r, delta.data_ptr<T>(), w, out.data_ptr<X>(), R, n, D);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------- RMSNorm

inline float hsum(const fVec& a, const fVec& b) {
  return at::vec::vec_reduce_all<float>([](fVec x, fVec y) { return x + y; }, a + b);
}

template <typename T, typename W>
void rms_norm_forward_kernel(const T* x, const W* w, T* y, float* rstd, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, grain(2 * D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      fVec acc0(0.f), acc1(0.f);
      for (int64_t i = 0; i < D; i += kStep) {
        fVec x0, x1;
        load(xr + i, std::min(kStep, D - i), x0, x1);
        acc0 = acc0 + x0 * x0;
        acc1 = acc1 + x1 * x1;
      }
      const float inv = 1.f / std::sqrt(hsum(acc0, acc1) / static_cast<float>(D) + eps);
      rstd[r] = inv;
      const fVec vinv(inv);
      for (int64_t i = 0; i < D; i += kStep) {
        const int64_t n = std::min(kStep, D - i);
        fVec x0, x1, w0, w1;
        load(xr + i, n, x0, x1);
        load(w + i, n, w0, w1);
        store(y + r * D + i, n, x0 * vinv * w0, x1 * vinv * w1);
      }
    }
  });
}

template <typename T, typename W>
void rms_norm_backward_kernel(const T* grad, const T* x, const W* w, const float* rstd, T* grad_x, float* grad_w_parts,
                              int64_t rows, int64_t D) {
  // grad_w_parts: [threads, D] zeros; each thread sums its rows' grad * xhat into its own row.
  at::parallel_for(0, rows, grain(3 * D), [&](int64_t r0, int64_t r1) {
    float* part = grad_w_parts + at::get_thread_num() * D;
    const fVec invD(1.f / static_cast<float>(D));
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = grad + r * D;
      const T* xr = x + r * D;
      const fVec inv(rstd[r]);
      fVec acc0(0.f), acc1(0.f);
      for (int64_t i = 0; i < D; i += kStep) {  // <grad * w, xhat>, and the weight gradient terms
        const int64_t n = std::min(kStep, D - i);
        fVec g0, g1, x0, x1, w0, w1, p0, p1;
        load(gr + i, n, g0, g1);
        load(xr + i, n, x0, x1);
        load(w + i, n, w0, w1);
        const fVec t0 = g0 * (x0 * inv), t1 = g1 * (x1 * inv);
        acc0 = acc0 + t0 * w0;
        acc1 = acc1 + t1 * w1;
        load(part + i, n, p0, p1);
        store(part + i, n, p0 + t0, p1 + t1);
      }
      const fVec dot = fVec(hsum(acc0, acc1)) * invD;
      for (int64_t i = 0; i < D; i += kStep) {
        const int64_t n = std::min(kStep, D - i);
        fVec g0, g1, x0, x1, w0, w1;
        load(gr + i, n, g0, g1);
        load(xr + i, n, x0, x1);
        load(w + i, n, w0, w1);
        store(grad_x + r * D + i, n, (g0 * w0 - x0 * inv * dot) * inv, (g1 * w1 - x1 * inv * dot) * inv);
      }
    }
  });
}

std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  const int64_t D = weight.numel();
  TORCH_CHECK(D > 0 && x.size(-1) == D, "x's last dimension must match the weight");
  const int64_t rows = x.numel() / D;
  at::Tensor y = at::empty_like(x);
  std::vector<int64_t> rshape(x.sizes().begin(), x.sizes().end());
  rshape.back() = 1;
  at::Tensor rstd = at::empty(rshape, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch(weight.scalar_type(), [&](auto wtag) {
      using W = decltype(wtag);
      rms_norm_forward_kernel<T, W>(x.data_ptr<T>(), weight.data_ptr<W>(), y.data_ptr<T>(), rstd.data_ptr<float>(),
                                    rows, D, static_cast<float>(eps));
    });
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd) {
  check_cpu(grad, "grad");
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(grad.scalar_type() == x.scalar_type() && grad.sizes() == x.sizes(), "grad must match x");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous(), "rstd must be contiguous float32");
  const int64_t D = weight.numel(), rows = x.numel() / D;
  TORCH_CHECK(rstd.numel() == rows, "rstd must hold one value per row");
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor parts = at::zeros({at::get_num_threads(), D}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch(weight.scalar_type(), [&](auto wtag) {
      using W = decltype(wtag);
      rms_norm_backward_kernel<T, W>(grad.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<W>(), rstd.data_ptr<float>(),
                                     grad_x.data_ptr<T>(), parts.data_ptr<float>(), rows, D);
    });
  });
  return {grad_x, parts.sum(0).to(weight.scalar_type())};
}

// ------------------------------------------------------------------------- MoD router's backward

// x's gradient where MoD's router, its top-k and the gather are one autograd node (routing/mod.py
// _RouteTopkGather), and the router weight's:
//   out[i] = grad[i] + g[i] * w  (+ grad_rows[j] where rows[j] == i),  grad_w = sum_i g[i] * x[i]
// grad and x are [..., D] (R rows), out has their shape. One pass over the rows (grad and x read once,
// out written once), where torch ran addr (out), an
// index_add into it and a [1, R] x [R, D] GEMM that read x again. rows strictly ascending; each
// chunk finds its first selected row by binary search; grad_w summed per thread, then over threads.
void router_grads_kernel(const float* grad, const float* g, const float* w, const float* x, const int64_t* rows,
                           const float* grad_rows, float* out, float* grad_w_parts, int64_t R, int64_t n, int64_t D) {
  at::parallel_for(0, R, grain(3 * D), [&](int64_t begin, int64_t end) {
    float* part = grad_w_parts + at::get_thread_num() * D;
    int64_t j = std::lower_bound(rows, rows + n, begin) - rows;
    for (int64_t i = begin; i < end; ++i) {
      const float* gr = grad + i * D;
      const float* xr = x + i * D;
      float* o = out + i * D;
      const float* add = (j < n && rows[j] == i) ? grad_rows + (j++) * D : nullptr;
      const fVec gi(g[i]);
      for (int64_t c = 0; c < D; c += kStep) {
        const int64_t m = std::min(kStep, D - c);
        fVec a0, a1, w0, w1, x0, x1, p0, p1;
        load(gr + c, m, a0, a1);
        load(w + c, m, w0, w1);
        a0 = a0 + gi * w0;
        a1 = a1 + gi * w1;
        if (add != nullptr) {
          fVec r0, r1;
          load(add + c, m, r0, r1);
          a0 = a0 + r0;
          a1 = a1 + r1;
        }
        store(o + c, m, a0, a1);
        load(xr + c, m, x0, x1);
        load(part + c, m, p0, p1);
        store(part + c, m, p0 + gi * x0, p1 + gi * x1);
      }
    }
  });
}

std::vector<at::Tensor> router_grads(const at::Tensor& grad, const at::Tensor& g, const at::Tensor& w,
                                       const at::Tensor& x, const at::Tensor& rows, const at::Tensor& grad_rows) {
  for (auto [t, name] : {std::pair{&grad, "grad"}, {&g, "g"}, {&w, "w"}, {&x, "x"}, {&grad_rows, "grad_rows"}}) {
    check_cpu(*t, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat, "router_grads: ", name, " must be float32");
  }
  TORCH_CHECK(x.dim() >= 2 && grad.sizes() == x.sizes() && g.numel() * x.size(-1) == x.numel() &&
                  w.numel() == x.size(-1) && grad_rows.dim() == 2 && grad_rows.size(1) == x.size(-1),
              "router_grads: grad and x must be [..., D] (R rows), g [R], w [D], grad_rows [n, D]; got ", grad.sizes(),
              ", ", x.sizes(), ", ", g.sizes(), ", ", w.sizes(), ", ", grad_rows.sizes());
  const int64_t D = x.size(-1), R = g.numel(), n = rows.size(0);
  const int64_t* r = checked_rows(rows, R, grad_rows.size(0), "router_grads", "grad_rows");
  // x's shape, not a view of [R, D]: a view returned from backward keeps its base's storage referenced,
  // and autograd then adds the next gradient into x's out of place (a fresh [B, T, D] per routed layer)
  at::Tensor out = at::empty_like(x);
  at::Tensor parts = at::zeros({at::get_num_threads(), D}, x.options());
  router_grads_kernel(grad.data_ptr<float>(), g.data_ptr<float>(), w.data_ptr<float>(), x.data_ptr<float>(), r,
                        grad_rows.data_ptr<float>(), out.data_ptr<float>(), parts.data_ptr<float>(), R, n, D);
  return {out, parts.sum(0)};
}

// ------------------------------------------------------------------- quantile threshold's update

// routing/calibration.py QuantileCut.update in one call: the cut that keeps n of the scores (the mean
// of the n-th and (n+1)-th largest, NaN ranked above every number as topk ranks it; n >= N: the
// smallest score less 1; n == 0: the largest), then threshold = m * threshold + (1 - m) * cut with
// m = momentum after the first update (0 before), kept only when finite, and updates += 1; the same
// float32 operations as the eager ops, which in a training step paid ~15 dispatches on cold caches
// (0.2 ms of a MoD layer's step at nanoGPT's shape against ~35 us alone).
void quantile_update(const at::Tensor& scores, int64_t n, at::Tensor& threshold, at::Tensor& updates, double momentum) {
  check_cpu(scores, "scores");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.numel() > 0, "quantile_update: scores must be non-empty float32");
  TORCH_CHECK(threshold.device().is_cpu() && threshold.scalar_type() == at::kFloat && threshold.numel() == 1,
              "quantile_update: threshold must be one CPU float32");
  TORCH_CHECK(updates.device().is_cpu() && updates.scalar_type() == at::kLong && updates.numel() == 1,
              "quantile_update: updates must be one CPU int64");
  const int64_t N = scores.numel();
  TORCH_CHECK(n >= 0, "quantile_update: n must be >= 0, got ", n);
  const float* s = scores.data_ptr<float>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float cut;
  if (n >= N) {  // torch.min propagates NaN
    cut = std::any_of(s, s + N, [](float v) { return std::isnan(v); }) ? nan : *std::min_element(s, s + N) - 1.0f;
  } else {
    std::vector<float> v(s, s + N);
    auto before = [](float a, float b) { return std::isnan(a) ? !std::isnan(b) : !std::isnan(b) && a > b; };
    std::nth_element(v.begin(), v.begin() + n, v.end(), before);  // v[n]: rank n, v[0, n): ranks 0 .. n-1
    if (n == 0) {
      cut = v[0];
    } else {
      const float last = *std::max_element(v.begin(), v.begin() + n, before);  // rank n - 1
      cut = (last + v[n]) / 2.0f;
    }
  }
  float* t = threshold.data_ptr<float>();
  int64_t* u = updates.data_ptr<int64_t>();
  const float m = *u > 0 ? static_cast<float>(momentum) : 0.0f;
  const float blended = m * *t + (1.0f - m) * cut;
  if (std::isfinite(blended)) *t = blended;
  *u += 1;
}

// ----------------------------------------------------------------------------- LM cross-entropy rows

// n (0..kStep) elements as two float vectors, lanes past n set to fill.
template <typename T>
inline void load_fill(const T* p, int64_t n, float fill, fVec& a, fVec& b) {
  load(p, n, a, b);
  if (n >= kStep) return;
  a = fVec::set(fVec(fill), a, std::min(n, kF));
  b = fVec::set(fVec(fill), b, std::max<int64_t>(0, n - kF));
}

inline float hmax(const fVec& a, const fVec& b) {
  return at::vec::vec_reduce_all<float>([](fVec x, fVec y) { return at::vec::maximum(x, y); },
                                        at::vec::maximum(a, b));
}

// The largest of row [V] in float32; NaN if it holds one (at::vec::maximum propagates NaN, as torch's max does).
template <typename T>
inline float row_max(const T* row, int64_t V) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  fVec m0(kNegInf), m1(kNegInf);
  for (int64_t i = 0; i < V; i += kStep) {
    fVec a, b;
    load_fill(row + i, std::min(kStep, V - i), kNegInf, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  return hmax(m0, m1);
}

// The index of the first element of row [V] equal to its max `peak` (the first NaN when peak is NaN):
// torch.argmax's choice. Vector compares find the block of kStep elements holding it, a scalar scan
// the element (a match in a short last block's padding lanes only costs that scan).
template <typename T>
inline int64_t first_index_of(const T* row, int64_t V, float peak) {
  const bool nan = std::isnan(peak);
  const fVec vp(peak);
  constexpr int kNone = (1 << kF) - 1;  // zero_mask() when no lane matches (every lane of the compare is 0)
  for (int64_t i = 0; i < V; i += kStep) {
    const int64_t m = std::min(kStep, V - i);
    fVec a, b;
    load(row + i, m, a, b);
    const fVec ea = nan ? a.isnan() : (a == vp), eb = nan ? b.isnan() : (b == vp);
    if (ea.zero_mask() == kNone && eb.zero_mask() == kNone) continue;
    for (int64_t j = i; j < i + m; ++j) {
      const float v = static_cast<float>(row[j]);
      if (nan ? std::isnan(v) : v == peak) return j;
    }
  }
  return 0;  // unreachable: peak is one of the row's values
}

// Per row of x [n, V]: the index of its first maximum (NaN counting as the maximum), torch.argmax(-1)'s
// result, in two vector passes over a row that stays in cache; torch's CPU argmax is a scalar loop
// (20 ms float32, 27 ms bf16 at [2048, 8192] on 2 threads; max(dim).indices 7-8 ms).
at::Tensor row_argmax(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [n, V] with V > 0");
  const int64_t n = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, n, grain(V), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = first_index_of(xp + r * V, V, row_max(xp + r * V, V));
    });
  });
  return out;
}

// Per row r of logits [n, V]: losses[r] = logsumexp(row) - row[target[r]], in float32. With keep
// (a gradient is wanted) the row becomes (softmax(row) - onehot(target)) * keep[r], rounded once to
// T; with predictions, predictions[r] = the row's argmax (row_argmax's). Per row, which stays in
// cache: its max; exp(row - max) into a float32 scratch row, summed; the scaled gradient from the
// scratch (exp is the costly part: it runs once per element). This replaces the tile loop's copies,
// exp, reductions and scatter (lm_loss._LinearCrossEntropy).
template <typename T>
void cross_entropy_rows_kernel(T* logits, const int64_t* target, const float* keep, float* losses,
                               int64_t* predictions, int64_t n, int64_t V) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, grain(3 * V), [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(keep == nullptr ? 0 : V);
    for (int64_t r = r0; r < r1; ++r) {
      T* row = logits + r * V;
      const float peak = row_max(row, V);
      if (predictions != nullptr) predictions[r] = first_index_of(row, V, peak);
      const fVec vpeak(peak);
      const int64_t t = target[r];
      const float target_logit = static_cast<float>(row[t]);
      fVec s0(0.f), s1(0.f);
      for (int64_t i = 0; i < V; i += kStep) {
        const int64_t m = std::min(kStep, V - i);
        fVec a, b;
        load_fill(row + i, m, kNegInf, a, b);
        a = (a - vpeak).exp();
        b = (b - vpeak).exp();
        s0 = s0 + a;
        s1 = s1 + b;
        if (keep != nullptr) store(scratch.data() + i, m, a, b);
      }
      const float total = hsum(s0, s1);
      losses[r] = std::log(total) + peak - target_logit;
      if (keep == nullptr) continue;
      const fVec scale(keep[r] / total);
      for (int64_t i = 0; i < V; i += kStep) {
        const int64_t m = std::min(kStep, V - i);
        fVec a, b;
        load(scratch.data() + i, m, a, b);
        store(row + i, m, a * scale, b * scale);
      }
      row[t] = static_cast<T>(scratch[t] * (keep[r] / total) - keep[r]);  // minus the one-hot, rounded once
    }
  });
}

void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& target, const c10::optional<at::Tensor>& keep,
                        const at::Tensor& losses, const c10::optional<at::Tensor>& predictions) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [n, V] with V > 0");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == n,
              "target must be n contiguous int64 indices");
  TORCH_CHECK(losses.scalar_type() == at::kFloat && losses.is_contiguous() && losses.numel() == n,
              "losses must be n contiguous float32 values");
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == at::kFloat && keep->is_contiguous() && keep->numel() == n,
                "keep must be n contiguous float32 values");
  }
  if (predictions.has_value()) {
    TORCH_CHECK(predictions->scalar_type() == at::kLong && predictions->is_contiguous() && predictions->numel() == n,
                "predictions must be n contiguous int64 values");
  }
  const int64_t* tp = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "target ", tp[r], " out of range [0, ", V, ")");
  dispatch(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_rows_kernel<T>(logits.data_ptr<T>(), tp, keep.has_value() ? keep->data_ptr<float>() : nullptr,
                                 losses.data_ptr<float>(),
                                 predictions.has_value() ? predictions->data_ptr<int64_t>() : nullptr, n, V);
  });
}

// ------------------------------------------------------------------------------------ transpose

// dst [cols, rows] = src [rows, cols]^T; src rows `ld_src` apart, dst rows `ld_dst` apart. AVX-512:
// ATen's 16 x 16 register tiles (attention's backward 10% faster than with the scalar tiled loop);
// AVX2, whose ATen transpose of any shape is an untiled scalar loop: the tiled loop.
inline void transpose(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
#if defined(CPU_CAPABILITY_AVX512)
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(rows), static_cast<int>(cols));
#else
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile)
      for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kTile); ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
#endif
}

// src [R, C] float32 (rows any distance apart, columns contiguous) -> src^T as a contiguous [C, R]:
// the operand a float32 weight-gradient GEMM reads (kernels/cpu_linear.py). torch's copy of a transposed
// view runs one thread through scalar 60 x 60 blocks: [2048, 384] at 20 GB/s here against ~60 in strips
// of 16 rows over both threads (each writes 64-byte runs into every output row).
at::Tensor transpose_matrix(const at::Tensor& src) {
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == at::kFloat && src.dim() == 2 &&
                  (src.stride(1) == 1 || src.numel() == 0),
              "transpose_matrix: src must be a float32 CPU [R, C] matrix with contiguous columns");
  const int64_t R = src.size(0), C = src.size(1), ld = src.stride(0);
  auto dst = at::empty({C, R}, src.options());
  const float* s = src.data_ptr<float>();
  float* d = dst.data_ptr<float>();
  constexpr int64_t kStrip = 16;
  at::parallel_for(0, (R + kStrip - 1) / kStrip, 1, [&](int64_t b0, int64_t b1) {
    const int64_t r0 = b0 * kStrip, r1 = std::min(R, b1 * kStrip);
    transpose(s + r0 * ld, ld, d + r0, R, r1 - r0, C);
  });
  return dst;
}

#ifdef CPUBLAS_BRGEMM_F32F32F32
// ------------------------------------------------------------------------- float32 causal attention
// Per head (parallel over B * H), flash-style: queries in blocks of kQueryBlock rows, each against the
// keys up to its last row only (the scores above the diagonal blocks are never computed), the softmax
// in float32 with the row's logsumexp saved, and backward recomputing the probabilities from it (what
// SDPA saves: q, k, v, out, logsumexp). A head's q, k, v (T x Dh each) and one block's scores stay in
// L2 through all of its matmuls (oneDNN's brgemm through at::native::cpublas), where torch's
// batched matmuls stream every operand from memory per op.

constexpr int64_t kQueryBlock = 64;

struct HeadView {  // one head (b, h) of a float32 [B, H, T, Dh] tensor: rows `row` apart
  float* data;
  int64_t row;
};

inline HeadView head_of(const Heads<float>& t, int64_t bh, int64_t H) {
  return {t.at(bh / H, bh % H, 0), t.s};
}

void check_f32_heads(const at::Tensor& t, const char* name, const at::Tensor& like) {
  check_heads(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == like.sizes(), name, " must be float32, shaped like q");
}

// Probabilities of one query block [rows a..b) against keys [0, b): p = exp(scale * s - lse), causal.
inline void block_probs(float* p, int64_t a, int64_t b, float scale, const float* lse) {
  for (int64_t r = 0; r < b - a; ++r) {
    float* row = p + r * b;
    const int64_t valid = a + r + 1;
    const fVec vs(scale), vl(lse[a + r]);
    at::vec::map([&](fVec x) { return (x * vs - vl).exp_u20(); }, row, row, valid);
    std::fill(row + valid, row + b, 0.f);
  }
}

// One head's causal attention: T rows of Q, K, V and O, each `*_row` elements apart (Dh contiguous);
// kt [Dh, T] and scores [kQueryBlock, T] are scratch; lse (nullptr: not kept) gets each row's logsumexp.
inline void attend_head(const float* Q, int64_t q_row, const float* K, int64_t k_row, const float* V, int64_t v_row,
                        float* O, int64_t o_row, int64_t T, int64_t Dh, float scale, float* lse, float* kt,
                        float* scores) {
  transpose(K, k_row, kt, T, T, Dh);
  for (int64_t a = 0; a < T; a += kQueryBlock) {
    const int64_t b = std::min(T, a + kQueryBlock), m = b - a;
    at::native::cpublas::brgemm(m, b, Dh, q_row, T, b, false, Q + a * q_row, kt, scores, false);
    for (int64_t r = 0; r < m; ++r) {  // softmax over keys [0, a + r]
      float* row = scores + r * b;
      const int64_t valid = a + r + 1;
      const float mx = at::vec::reduce_all<float>([](fVec x, fVec y) { return at::vec::maximum(x, y); }, row, valid);
      const fVec vs(scale), vm(mx * scale);
      at::vec::map([&](fVec x) { return (x * vs - vm).exp_u20(); }, row, row, valid);
      const float sum = at::vec::reduce_all<float>([](fVec x, fVec y) { return x + y; }, row, valid);
      const fVec inv(1.f / sum);
      at::vec::map([&](fVec x) { return x * inv; }, row, row, valid);
      std::fill(row + valid, row + b, 0.f);
      if (lse != nullptr) lse[a + r] = mx * scale + std::log(sum);
    }
    at::native::cpublas::brgemm(m, Dh, b, b, v_row, o_row, false, scores, V, O + a * o_row, false);
  }
}

std::vector<at::Tensor> causal_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_f32_heads(q, "q", q);
  check_f32_heads(k, "k", q);
  check_f32_heads(v, "v", q);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = q.size(3);
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  // Rows laid out [B, T, H, Dh] (a [B, H, T, Dh] view): the output projection reads them as [B * T, D] with no copy.
  at::Tensor out = at::empty({B, T, H, Dh}, q.options()).permute({0, 2, 1, 3});
  at::Tensor lse = at::empty({B, H, T}, q.options());
  const Heads<float> qh(q), kh(k), vh(v), oh(out);
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> kt(Dh * T), scores(kQueryBlock * T);
    for (int64_t bh = h0; bh < h1; ++bh) {
      const HeadView Q = head_of(qh, bh, H), K = head_of(kh, bh, H), V = head_of(vh, bh, H), O = head_of(oh, bh, H);
      attend_head(Q.data, Q.row, K.data, K.row, V.data, V.row, O.data, O.row, T, Dh, scale,
                  lse.data_ptr<float>() + bh * T, kt.data(), scores.data());
    }
    at::native::cpublas::brgemm_release(false);
  });
  return {out, lse};
}

// Causal attention within each sequence of rows laid end to end (attention.forward_varlen without
// autograd): q, k, v [N, H, Dh] float32 with any row and head strides (Dh contiguous), offsets [S + 1]
// int64 (cu_seqlens: sequence s is rows offsets[s] .. offsets[s + 1], empty ones allowed) -> out
// [N, H, Dh]. Every (sequence, head) runs at its own length: no padding, no layout.
at::Tensor varlen_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& offsets) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->sizes() == q.sizes() &&
                    (t->stride(2) == 1 || t->numel() == 0),
                name, " must be a float32 CPU [N, H, Dh] tensor with Dh contiguous, shaped like q");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.numel() >= 1 && offsets.device().is_cpu(),
              "offsets must be a contiguous int64 CPU tensor [S + 1]");
  const int64_t N = q.size(0), H = q.size(1), Dh = q.size(2), S = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  int64_t longest = 0;
  TORCH_CHECK(off[0] == 0 && off[S] == N, "offsets must run from 0 to N = ", N);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(off[s + 1] >= off[s], "offsets must be non-decreasing");
    longest = std::max(longest, off[s + 1] - off[s]);
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  at::Tensor out = at::empty({N, H, Dh}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, S * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kt(Dh * longest), scores(kQueryBlock * longest);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t s = w / H, h = w % H, first = off[s], T = off[s + 1] - first;
      if (T == 0) continue;
      attend_head(qd + first * q.stride(0) + h * q.stride(1), q.stride(0), kd + first * k.stride(0) + h * k.stride(1),
                  k.stride(0), vd + first * v.stride(0) + h * v.stride(1), v.stride(0), od + (first * H + h) * Dh,
                  H * Dh, T, Dh, scale, nullptr, kt.data(), scores.data());
    }
    at::native::cpublas::brgemm_release(false);
  });
  return out;
}

std::vector<at::Tensor> causal_attention_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
  for (const auto& [t, name] : {std::pair{&grad, "grad"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}})
    check_f32_heads(*t, name, q);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = q.size(3);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == B * H * T, "lse must be [B, H, T]");
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  at::Tensor dq = at::empty({B, H, T, Dh}, q.options()), dk = at::empty_like(dq), dv = at::empty_like(dq);
  const Heads<float> gh(grad), qh(q), kh(k), vh(v), oh(out), dqh(dq), dkh(dk), dvh(dv);
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> kt(Dh * T), vt(Dh * T), qt(Dh * T), got(Dh * T), dkt(Dh * T), dvt(Dh * T), delta(T),
        p(kQueryBlock * T), dp(kQueryBlock * T);
    for (int64_t bh = h0; bh < h1; ++bh) {
      const HeadView G = head_of(gh, bh, H), Q = head_of(qh, bh, H), K = head_of(kh, bh, H), V = head_of(vh, bh, H),
                     O = head_of(oh, bh, H), DQ = head_of(dqh, bh, H), DK = head_of(dkh, bh, H), DV = head_of(dvh, bh, H);
      const float* L = lse.data_ptr<float>() + bh * T;
      transpose(K.data, K.row, kt.data(), T, T, Dh);
      transpose(V.data, V.row, vt.data(), T, T, Dh);
      transpose(Q.data, Q.row, qt.data(), T, T, Dh);
      transpose(G.data, G.row, got.data(), T, T, Dh);
      for (int64_t t = 0; t < T; ++t) {  // delta = rowsum(grad * out): softmax backward's per-row term
        delta[t] = at::vec::map2_reduce_all<float>([](fVec x, fVec y) { return x * y; },
                                                   [](fVec x, fVec y) { return x + y; }, G.data + t * G.row,
                                                   O.data + t * O.row, Dh);
      }
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t a = 0; a < T; a += kQueryBlock) {
        const int64_t b = std::min(T, a + kQueryBlock), m = b - a;
        at::native::cpublas::brgemm(m, b, Dh, Q.row, T, b, false, Q.data + a * Q.row, kt.data(), p.data(), false);
        block_probs(p.data(), a, b, scale, L);
        // dV^T[:, :b] += grad_block^T p;  dP = grad_block v[:b]^T
        at::native::cpublas::brgemm(Dh, b, m, T, b, T, true, got.data() + a, p.data(), dvt.data(), false);
        at::native::cpublas::brgemm(m, b, Dh, G.row, T, b, false, G.data + a * G.row, vt.data(), dp.data(), false);
        for (int64_t r = 0; r < m; ++r) {  // dS = p * (dP - delta) * scale, in place in dp
          float* ds = dp.data() + r * b;
          const float* pr = p.data() + r * b;
          const fVec vd(delta[a + r]), vs(scale);
          at::vec::map2([&](fVec x, fVec y) { return y * (x - vd) * vs; }, ds, ds, pr, b);
        }
        // dQ_block = dS k[:b];  dK^T[:, :b] += q_block^T dS
        at::native::cpublas::brgemm(m, Dh, b, b, K.row, DQ.row, false, dp.data(), K.data, DQ.data + a * DQ.row, false);
        at::native::cpublas::brgemm(Dh, b, m, T, b, T, true, qt.data() + a, dp.data(), dkt.data(), false);
      }
      transpose(dkt.data(), T, DK.data, Dh, Dh, T);  // [Dh, T] -> [T, Dh] rows (dk, dv are contiguous: rows Dh apart)
      transpose(dvt.data(), T, DV.data, Dh, Dh, T);
    }
    at::native::cpublas::brgemm_release(false);
  });
  return {dq, dk, dv};
}
#endif  // CPUBLAS_BRGEMM_F32F32F32

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_forward", &swiglu_forward, "gate_up [..., 2h] -> (silu(gate), silu(gate) * up)");
  m.def("swiglu_backward", &swiglu_backward, "(grad, gate_up, act) -> grad of gate_up");
  m.def("rotary_qkv_forward", &rotary_qkv_forward, "qkv [B, T, 3, H, Dh], cos, sin -> rotated q, k and v");
  m.def("rotary_qkv_inplace", &rotary_qkv_inplace, "qkv [B, T, 3, H, Dh], cos, sin: q and k rotated in place");
  m.def("rotary_qkv_backward", &rotary_qkv_backward, "(dq, dk, dv, cos, -sin) -> grad of qkv");
  m.def("rotary_qkv_scatter", &rotary_qkv_scatter, "varlen: qkv rows -> rotated q, k, v in padded buckets");
  m.def("gather_heads", &gather_heads, "varlen: padded bucket outputs -> [N, H, Dh] rows");
  m.def("rows_add", &rows_add, py::arg("x"), py::arg("rows"), py::arg("delta"), py::arg("weight") = py::none(),
        "ragged combine: x [R, D] with weight[j] * delta[j] added to row rows[j] (ascending), one pass");
  m.def("router_grads", &router_grads,
        "(grad, g, w, x, rows, grad_rows) -> (grad + g w^T with grad_rows added at rows, g^T x): MoD's router node");
#ifdef CPUBLAS_BRGEMM_F32F32F32
  m.def("causal_attention_forward", &causal_attention_forward, "float32 q, k, v [B, H, T, Dh] -> (out, logsumexp)");
  m.def("causal_attention_backward", &causal_attention_backward, "(grad, q, k, v, out, lse) -> (dq, dk, dv)");
  m.def("varlen_attention_forward", &varlen_attention_forward,
        "float32 q, k, v [N, H, Dh], offsets [S + 1] -> causal attention within each sequence, [N, H, Dh]");
#endif
  m.def("transpose_matrix", &transpose_matrix, "float32 src [R, C] (contiguous columns) -> src^T, a contiguous [C, R]");
  m.def("rms_norm_forward", &rms_norm_forward, "(x, weight, eps) -> (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "(grad, x, weight, rstd) -> (grad_x, grad_weight)");
  m.def("cross_entropy_rows", &cross_entropy_rows, py::arg("logits"), py::arg("target"), py::arg("keep"),
        py::arg("losses"), py::arg("predictions") = py::none(),
        "per-row CE into losses; with keep, logits become (softmax - onehot) * keep in place; with predictions, "
        "each row's argmax into them");
  m.def("quantile_update", &quantile_update, "(scores, n, threshold, updates, momentum): QuantileCut.update in place");
  m.def("row_argmax", &row_argmax, "x [n, V] -> int64 [n]: each row's first maximum, as torch.argmax(-1)");
}
