// Row-invariant attention over bf16 keys/values: one new token of one query head at a time, over its own
// keys (a causal range, optionally windowed, or an explicit list: a token tree's mask). Scores and
// probabilities in fp32; every sum runs over the visible keys in their given order, so a row's result
// never depends on how many rows share the call, at any context length.
//
// It does not batch sequences of unequal length in one call (callers pass one sequence's keys) or handle
// other key dtypes.
#pragma once

#include <vector>

#include "simd.h"

namespace sd {

// Scratch of one thread: scores over the visible keys and the fp32 output accumulator.
struct AttendScratch {
  std::vector<float> scores, acc;
  explicit AttendScratch(int64_t d) : acc(d) {}
};

// One new token of one query head over n keys: key j is lo + j, or index[j] when an index is given (a tree
// node sees its context and its ancestors). out[D] = softmax(q k_j * scale) v_j in fp32. NV > 0: D is NV
// vectors exactly, held in registers; NV = 0: any D, through memory (the same operations in the same order
// lane by lane, but no promise that both forms agree bitwise: a model always takes the same one).
template <int NV>
inline void attend_row_impl(const float* qf, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                            int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                            float* out, AttendScratch& s) {
  const int64_t n_padded = (n + kLanes - 1) / kLanes * kLanes;
  const int64_t d_vec = NV ? NV * kLanes : d / kLanes * kLanes;
  s.scores.assign(n_padded, -std::numeric_limits<float>::infinity());
  float best = -std::numeric_limits<float>::infinity();
  vf qv[NV ? NV : 1];
  if constexpr (NV > 0)
    for (int v = 0; v < NV; ++v) qv[v] = vload(qf + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {  // each score: one vector sum over d, then a fixed-order lane sum
    const uint16_t* kj = keys + (index ? index[j] : lo + j) * key_stride;
    vf acc = vzero();
    float total;
    if constexpr (NV > 0) {
      for (int v = 0; v < NV; ++v) acc = vfma(qv[v], load_bf16(kj + v * kLanes), acc);
      total = hsum(acc);
    } else {
      for (int64_t i = 0; i < d_vec; i += kLanes) acc = vfma(vload(qf + i), load_bf16(kj + i), acc);
      total = hsum(acc);
      for (int64_t i = d_vec; i < d; ++i) total = std::fma(qf[i], bf16_to_float(kj[i]), total);
    }
    s.scores[j] = total * scale;
    best = std::max(best, s.scores[j]);
  }
  vf sum = vzero();
  const vf shift = vset(best);
  for (int64_t j = 0; j < n_padded; j += kLanes) {  // padding lanes are -inf: their weight is exactly 0
    const vf p = vexp(vsub(vload(s.scores.data() + j), shift));
    vstore(s.scores.data() + j, p);
    sum = vadd(sum, p);
  }
  const float inv = 1.0f / hsum(sum);
  if constexpr (NV > 0) {
    vf acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = vzero();
    for (int64_t j = 0; j < n; ++j) {  // out += p_j v_j, in key order
      const uint16_t* vj = values + (index ? index[j] : lo + j) * value_stride;
      const vf p = vset(s.scores[j]);
      for (int v = 0; v < NV; ++v) acc[v] = vfma(p, load_bf16(vj + v * kLanes), acc[v]);
    }
    for (int v = 0; v < NV; ++v) vstore(out + v * kLanes, vmul(acc[v], vset(inv)));
  } else {
    float* acc = s.acc.data();
    std::fill(acc, acc + d, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vj = values + (index ? index[j] : lo + j) * value_stride;
      const vf p = vset(s.scores[j]);
      for (int64_t i = 0; i < d_vec; i += kLanes) vstore(acc + i, vfma(p, load_bf16(vj + i), vload(acc + i)));
      for (int64_t i = d_vec; i < d; ++i) acc[i] = std::fma(s.scores[j], bf16_to_float(vj[i]), acc[i]);
    }
    for (int64_t i = 0; i < d_vec; i += kLanes) vstore(out + i, vmul(vload(acc + i), vset(inv)));
    for (int64_t i = d_vec; i < d; ++i) out[i] = acc[i] * inv;
  }
}

inline void attend_row(const float* qf, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                       int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                       float* out, AttendScratch& s) {
  switch (d) {  // the head sizes of the models we meet, with the query and the output in registers
    case kLanes: return attend_row_impl<1>(qf, keys, values, key_stride, value_stride, lo, n, index, d, scale, out, s);
    case 2 * kLanes: return attend_row_impl<2>(qf, keys, values, key_stride, value_stride, lo, n, index, d, scale, out, s);
    case 4 * kLanes: return attend_row_impl<4>(qf, keys, values, key_stride, value_stride, lo, n, index, d, scale, out, s);
    case 8 * kLanes: return attend_row_impl<8>(qf, keys, values, key_stride, value_stride, lo, n, index, d, scale, out, s);
    default: return attend_row_impl<0>(qf, keys, values, key_stride, value_stride, lo, n, index, d, scale, out, s);
  }
}

// The same with a bf16 query and a bf16 output (the torch-facing kernels).
inline void attend_row_bf16(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                            int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                            uint16_t* out, AttendScratch& s, std::vector<float>& qf, std::vector<float>& of) {
  for (int64_t i = 0; i < d; ++i) qf[i] = bf16_to_float(q[i]);
  attend_row(qf.data(), keys, values, key_stride, value_stride, lo, n, index, d, scale, of.data(), s);
  for (int64_t i = 0; i < d; ++i) out[i] = float_to_bf16(of[i]);
}

// Small calls (a decode step over a short context) stay on one thread: a fork costs more than they do.
inline int64_t attention_grain(int64_t length, int64_t d) {
  return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, length * d));
}

}  // namespace sd

// q: [B, H, T, D], keys/values: [B, Hkv, L, D] (bf16, last dim contiguous), the T new tokens being the
// last T of the L keys. Token t sees keys [max(0, e - window), e) with e = L - T + t + 1 (window 0: no
// limit). Query heads h*G..h*G+G-1 share key head h. Returns [B, H, T, D] bf16.
inline torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               int64_t window, double scale) {
  using namespace sd;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attention needs bf16");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "attention: q [B,H,T,D], keys/values [B,Hkv,L,D]");
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv_heads = keys.size(1), length = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && keys.size(3) == d && h % kv_heads == 0 && t <= length, "attention: shapes do not match");
  const auto qc = q.contiguous();
  const auto kc = keys.stride(3) == 1 ? keys : keys.contiguous();
  const auto vc = values.stride(3) == 1 ? values : values.contiguous();
  auto out = torch::empty({b, h, t, d}, q.options());
  const uint16_t* qp = bf16_ptr(qc);
  const uint16_t* kp = bf16_ptr(kc);
  const uint16_t* vp = bf16_ptr(vc);
  uint16_t* op = bf16_ptr_mut(out);
  const int64_t group = h / kv_heads, rows = b * h * t;
  at::parallel_for(0, rows, attention_grain(length, d), [&](int64_t r0, int64_t r1) {
    AttendScratch s(d);
    std::vector<float> qf(d), of(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / (h * t), hi = (r / t) % h, ti = r % t, kh = hi / group;
      const int64_t end = length - t + ti + 1, start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      attend_row_bf16(qp + r * d, kp + bi * kc.stride(0) + kh * kc.stride(1), vp + bi * vc.stride(0) + kh * vc.stride(1),
                      kc.stride(2), vc.stride(2), start, end - start, nullptr, d, float(scale), op + r * d, s, qf, of);
    }
  });
  return out;
}

// Checks a tree's key index (int64 [T, M], counts int64 [T]) against L keys, so that no row reads outside them.
inline void check_key_index(const torch::Tensor& index, const torch::Tensor& counts, int64_t t, int64_t length) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 2 && index.size(0) == t && index.is_contiguous() &&
              counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.size(0) == t,
              "attention_indexed: index int64 [T, M] contiguous, counts int64 [T]");
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t ti = 0; ti < t; ++ti) {
    TORCH_CHECK(cp[ti] >= 1 && cp[ti] <= index.size(1), "attention_indexed: counts out of range");
    for (int64_t j = 0; j < cp[ti]; ++j)
      TORCH_CHECK(ip[ti * index.size(1) + j] >= 0 && ip[ti * index.size(1) + j] < length, "attention_indexed: index out of range");
  }
}

// Tree attention for one sequence: q [1, H, T, D], keys/values [1, Hkv, L, D]; new token t sees the keys
// index[t, :counts[t]] (int64 [T, M], in order: its context, its ancestors, itself). Returns [1, H, T, D].
inline torch::Tensor attention_indexed(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                       const torch::Tensor& index, const torch::Tensor& counts, double scale) {
  using namespace sd;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attention_indexed needs bf16");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && keys.dim() == 4 && keys.size(0) == 1 && values.sizes() == keys.sizes(),
              "attention_indexed: q [1,H,T,D], keys/values [1,Hkv,L,D]");
  const int64_t h = q.size(1), t = q.size(2), d = q.size(3), kv_heads = keys.size(1), length = keys.size(2);
  TORCH_CHECK(keys.size(3) == d && h % kv_heads == 0, "attention_indexed: shapes do not match");
  check_key_index(index, counts, t, length);
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  const auto qc = q.contiguous();
  const auto kc = keys.stride(3) == 1 ? keys : keys.contiguous();
  const auto vc = values.stride(3) == 1 ? values : values.contiguous();
  auto out = torch::empty({1, h, t, d}, q.options());
  const uint16_t* qp = bf16_ptr(qc);
  const uint16_t* kp = bf16_ptr(kc);
  const uint16_t* vp = bf16_ptr(vc);
  uint16_t* op = bf16_ptr_mut(out);
  const int64_t group = h / kv_heads, rows = h * t, width = index.size(1);
  at::parallel_for(0, rows, attention_grain(length, d), [&](int64_t r0, int64_t r1) {
    AttendScratch s(d);
    std::vector<float> qf(d), of(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t hi = r / t, ti = r % t, kh = hi / group;
      attend_row_bf16(qp + r * d, kp + kh * kc.stride(1), vp + kh * vc.stride(1), kc.stride(2), vc.stride(2), 0, cp[ti],
                      ip + ti * width, d, float(scale), op + r * d, s, qf, of);
    }
  });
  return out;
}
