// Row-invariant attention over bf16 keys/values: one new token at a time, over its own keys (a causal range,
// optionally windowed, or an explicit list: a token tree's mask), the query heads of one key head together (each
// key read once for them). Scores and probabilities in fp32; every sum runs over the visible keys in their given
// order, so a row's result never depends on how many rows (or heads) share the call, at any context length.
//
// It does not batch sequences of unequal length in one call (callers pass one sequence's keys) or handle
// other key dtypes.
#pragma once

#include <vector>

#include "simd.h"

namespace sd {

// Scratch of one thread: scores over the visible keys, the fp32 output accumulators, each score row's maximum, and
// a block of keys (or values) widened to fp32.
struct AttendScratch {
  std::vector<float> scores, acc, best, block;
  explicit AttendScratch(int64_t d) : acc(d) {}
};

// n floats of v on a cache line's boundary, set to `fill` (vectors that straddle two lines load at half speed:
// the kernel ran 1.5x slower in the runs where malloc returned 16-byte-aligned scratch).
inline float* aligned_floats(std::vector<float>& v, int64_t n, float fill) {
  v.resize(n + 16);
  float* p = v.data() + (16 - (reinterpret_cast<uintptr_t>(v.data()) / sizeof(float)) % 16) % 16;
  std::fill(p, p + n, fill);
  return p;
}

// One new token of one query head over n keys: key j is lo + j, or index[j] when an index is given (a tree
// node sees its context and its ancestors). out[D] = softmax(q k_j * scale) v_j in fp32, for any D, through
// memory: the form of head sizes that are not 1, 2, 4 or 8 vectors (attend_rows_impl's operations in the same
// order lane by lane, but no promise that both forms agree bitwise: a model always takes the same one).
inline void attend_row_any(const float* qf, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                           int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                           float* out, AttendScratch& s) {
  const int64_t n_padded = (n + kLanes - 1) / kLanes * kLanes;
  const int64_t d_vec = d / kLanes * kLanes;
  s.scores.assign(n_padded, -std::numeric_limits<float>::infinity());
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {  // each score: one vector sum over d, then a fixed-order lane sum
    const uint16_t* kj = keys + (index ? index[j] : lo + j) * key_stride;
    vf acc = vzero();
    for (int64_t i = 0; i < d_vec; i += kLanes) acc = vfma(vload(qf + i), load_bf16(kj + i), acc);
    float total = hsum(acc);
    for (int64_t i = d_vec; i < d; ++i) total = std::fma(qf[i], bf16_to_float(kj[i]), total);
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
  float* acc = s.acc.data();
  std::fill(acc, acc + d, 0.0f);
  for (int64_t j = 0; j < n; ++j) {  // out += p_j v_j, in key order
    const uint16_t* vj = values + (index ? index[j] : lo + j) * value_stride;
    const vf p = vset(s.scores[j]);
    for (int64_t i = 0; i < d_vec; i += kLanes) vstore(acc + i, vfma(p, load_bf16(vj + i), vload(acc + i)));
    for (int64_t i = d_vec; i < d; ++i) acc[i] = std::fma(s.scores[j], bf16_to_float(vj[i]), acc[i]);
  }
  for (int64_t i = 0; i < d_vec; i += kLanes) vstore(out + i, vmul(vload(acc + i), vset(inv)));
  for (int64_t i = d_vec; i < d; ++i) out[i] = acc[i] * inv;
}

// Query heads that share a key head attend together, and so do the new rows of one sequence: keys and values are
// widened to fp32 a block at a time, and each block serves every (row, head) of the call while it sits in L1, so
// that a verification's rows share one pass over the cache rather than one each (at 1,000 keys a second row's
// attention read the cache again: 30% of a SmolLM2 step). Scores are summed kLanes keys at a time (hsum_lanes).
// Each (row, head)'s arithmetic is the same whatever shares the call: per key one vector sum over d, then hsum's
// fixed-order lane sum; the softmax over its own keys; p_j v_j summed in key order.
constexpr int kVectorRegisters = kLanes == 16 ? 32 : 16;
// Heads whose accumulators stay in registers beside a value's NV vectors.
constexpr int heads_together_nv(int nv) { return nv == 0 ? 1 : std::clamp((kVectorRegisters - 1 - nv) / nv, 1, 4); }
constexpr int64_t kBlockBytes = 32768;  // one block of keys (or values) in fp32: inside L1
constexpr int64_t kRowsTogether = 8;  // most rows of one call
constexpr int64_t kWideFrom = 4;  // (row, head)s from which a call widens each block once for all (faster from 4)

// G heads (queries q + r * q_stride + g * d, outputs out + r * out_stride + g * d, d = NV * kLanes) of `rows` rows:
// row r sees keys [max(0, end0 + r - window), end0 + r) (window 0: from key 0); with an index (one row), key j is
// index[j] for j < end0. Key j is at keys + j * key_stride.
template <int NV, int G, bool Wide>
inline void attend_rows_impl(const float* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values,
                             int64_t key_stride, int64_t value_stride, int64_t end0, int64_t window,
                             const int64_t* index, int64_t rows, float scale, float* out, int64_t out_stride,
                             AttendScratch& s) {
  constexpr int64_t d = NV * kLanes, block = kBlockBytes / (4 * d);
  const auto lo_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, end0 + r - window) : int64_t(0); };
  const int64_t first = lo_of(0), last = end0 + rows - 1;  // the keys any row sees: [first, last)
  const int64_t stride = (last - first + kLanes - 1) / kLanes * kLanes;  // scores of (row r, head g) at (r * G + g) * stride
  float* scores = aligned_floats(s.scores, rows * G * stride, -std::numeric_limits<float>::infinity());
  float* accs = aligned_floats(s.acc, rows * G * d, 0.0f);
  s.best.assign(rows * G, -std::numeric_limits<float>::infinity());
  float* wide = Wide ? aligned_floats(s.block, block * d, 0.0f) : nullptr;
  const auto widen = [&](const uint16_t* from, int64_t from_stride, int64_t b0, int64_t b1) {  // keys b0..b1 -> wide
    if (!Wide) return;
    for (int64_t j = b0; j < b1; ++j) {
      const uint16_t* src = from + (index ? index[j] : j) * from_stride;
      for (int v = 0; v < NV; ++v) vstore(wide + (j - b0) * d + v * kLanes, load_bf16(src + v * kLanes));
    }
  };
  // vector v of key (or value) j of block b0: widened once, or (few rows and heads to share it) where it is
  const auto load = [&](const uint16_t* from, int64_t from_stride, int64_t b0, int64_t j, int v) SD_INLINE_LAMBDA {
    if constexpr (Wide) return vload(wide + (j - b0) * d + v * kLanes);
    else return load_bf16(from + (index ? index[j] : j) * from_stride + v * kLanes);
  };
  for (int64_t b0 = first; b0 < last; b0 += block) {
    const int64_t b1 = std::min(last, b0 + block);
    widen(keys, key_stride, b0, b1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = lo_of(r), j0 = std::max(b0, lo), j1 = std::min(b1, end0 + r);
      for (int g = 0; g < G && j0 < j1; ++g) {
        vf qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = vload(q + r * q_stride + g * d + v * kLanes);
        float* sg = scores + (r * G + g) * stride - lo;  // sg[j]: key j's score
        vf best = vset(s.best[r * G + g]);
        int64_t j = j0;
        for (; j + kLanes <= j1; j += kLanes) {
          vf acc[kLanes];
          for (int k = 0; k < kLanes; ++k) {
            acc[k] = vzero();
            for (int v = 0; v < NV; ++v) acc[k] = vfma(qv[v], load(keys, key_stride, b0, j + k, v), acc[k]);
          }
          const vf score = vmul(hsum_lanes(acc), vset(scale));
          vstore(sg + j, score);
          best = vmax(best, score);
        }
        float tail = hmax(best);
        for (; j < j1; ++j) {
          vf acc = vzero();
          for (int v = 0; v < NV; ++v) acc = vfma(qv[v], load(keys, key_stride, b0, j, v), acc);
          sg[j] = hsum(acc) * scale;
          tail = std::max(tail, sg[j]);
        }
        s.best[r * G + g] = tail;
      }
    }
  }
  float inv[G * kRowsTogether];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n_padded = (end0 + r - lo_of(r) + kLanes - 1) / kLanes * kLanes;
    for (int g = 0; g < G; ++g) {  // padding lanes are -inf: their weight is exactly 0
      float* sg = scores + (r * G + g) * stride;
      vf sum = vzero();
      const vf shift = vset(s.best[r * G + g]);
      for (int64_t j = 0; j < n_padded; j += kLanes) {
        const vf p = vexp(vsub(vload(sg + j), shift));
        vstore(sg + j, p);
        sum = vadd(sum, p);
      }
      inv[r * G + g] = 1.0f / hsum(sum);
    }
  }
  for (int64_t b0 = first; b0 < last; b0 += block) {
    const int64_t b1 = std::min(last, b0 + block);
    widen(values, value_stride, b0, b1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = lo_of(r), j0 = std::max(b0, lo), j1 = std::min(b1, end0 + r);
      if (j0 >= j1) continue;
      float* ar = accs + r * G * d;
      const float* sr = scores + r * G * stride - lo;
      vf acc[G][NV];
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < NV; ++v) acc[g][v] = vload(ar + g * d + v * kLanes);
      for (int64_t j = j0; j < j1; ++j) {  // out += p_j v_j, in key order
        vf vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load(values, value_stride, b0, j, v);
        for (int g = 0; g < G; ++g) {
          const vf p = vset(sr[g * stride + j]);
          for (int v = 0; v < NV; ++v) acc[g][v] = vfma(p, vv[v], acc[g][v]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < NV; ++v) vstore(ar + g * d + v * kLanes, acc[g][v]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < NV; ++v)
        vstore(out + r * out_stride + g * d + v * kLanes,
               vmul(vload(accs + (r * G + g) * d + v * kLanes), vset(inv[r * G + g])));
}

// g <= G heads as attend_rows_impl<NV, g>.
template <int NV, int G>
inline void attend_some_heads(int g, const float* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values,
                              int64_t key_stride, int64_t value_stride, int64_t end0, int64_t window,
                              const int64_t* index, int64_t rows, float scale, float* out, int64_t out_stride,
                              AttendScratch& s) {
  if constexpr (G > 1)
    if (g < G)
      return attend_some_heads<NV, G - 1>(g, q, q_stride, keys, values, key_stride, value_stride, end0, window, index,
                                          rows, scale, out, out_stride, s);
  if (rows * G >= kWideFrom)
    attend_rows_impl<NV, G, true>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows, scale,
                                  out, out_stride, s);
  else
    attend_rows_impl<NV, G, false>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows,
                                   scale, out, out_stride, s);
}

template <int NV>
inline void attend_rows_nv(const float* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values,
                           int64_t key_stride, int64_t value_stride, int64_t end0, int64_t window,
                           const int64_t* index, int64_t rows, int heads, float scale, float* out, int64_t out_stride,
                           AttendScratch& s) {
  constexpr int64_t d = NV * kLanes;
  constexpr int together = heads_together_nv(NV);
  for (int g = 0; g < heads; g += together)
    attend_some_heads<NV, together>(std::min(heads - g, together), q + g * d, q_stride, keys, values, key_stride,
                                    value_stride, end0, window, index, rows, scale, out + g * d, out_stride, s);
}

// Query heads 0..heads-1 of rows 0..rows-1 (<= kRowsTogether) sharing one key head (see attend_rows_impl for the
// arguments): each (row, head)'s result is the same bits however many rows and heads share the call.
inline void attend_rows(const float* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values,
                        int64_t key_stride, int64_t value_stride, int64_t end0, int64_t window, const int64_t* index,
                        int64_t rows, int64_t d, int heads, float scale, float* out, int64_t out_stride,
                        AttendScratch& s) {
  TORCH_CHECK(rows >= 1 && rows <= kRowsTogether && (!index || rows == 1), "attend_rows: 1..8 rows, one with an index");
  switch (d) {
    case kLanes: return attend_rows_nv<1>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows, heads, scale, out, out_stride, s);
    case 2 * kLanes: return attend_rows_nv<2>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows, heads, scale, out, out_stride, s);
    case 4 * kLanes: return attend_rows_nv<4>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows, heads, scale, out, out_stride, s);
    case 8 * kLanes: return attend_rows_nv<8>(q, q_stride, keys, values, key_stride, value_stride, end0, window, index, rows, heads, scale, out, out_stride, s);
    default:
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t end = end0 + r, lo = index || window <= 0 ? 0 : std::max<int64_t>(0, end - window);
        for (int h = 0; h < heads; ++h)
          attend_row_any(q + r * q_stride + h * d, keys, values, key_stride, value_stride, lo, end - lo, index, d,
                         scale, out + r * out_stride + h * d, s);
      }
  }
}

// Query heads attend_rows takes together for head size d.
inline int heads_together(int64_t d) {
  const bool fits = d % kLanes == 0 && (d / kLanes == 1 || d / kLanes == 2 || d / kLanes == 4 || d / kLanes == 8);
  return fits ? heads_together_nv(int(d / kLanes)) : 1;
}

// The same with a bf16 query and a bf16 output (the torch-facing kernels).
inline void attend_row_bf16(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                            int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                            uint16_t* out, AttendScratch& s, std::vector<float>& qf, std::vector<float>& of) {
  for (int64_t i = 0; i < d; ++i) qf[i] = bf16_to_float(q[i]);
  attend_rows(qf.data(), d, keys + (index ? 0 : lo * key_stride), values + (index ? 0 : lo * value_stride), key_stride,
              value_stride, n, 0, index, 1, d, 1, scale, of.data(), d, s);
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
