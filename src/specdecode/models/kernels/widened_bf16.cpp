// bf16 projections and attention for x86-64 CPUs without AVX512-BF16: bf16 in memory, fp32 in registers.
//
// Built twice by models/native.py from this one source: with -mavx2 -mfma (SPECDECODE_AVX512 unset, 8
// fp32 lanes) and with -mavx512f (16 lanes). Both functions are row-invariant by construction: every
// output is one fixed sequence of fp32 operations that depends only on its own row's inputs, never on how
// many rows share the call (what exact verification needs).
//
// widened_linear: W packed as [N/T, K/2, T, 2] (T = 4 vectors of outputs; models/native.py packs it),
// the same pair layout as tiled_bf16.cpp. A 32-bit lane holds (W[n, k], W[n, k+1]): shifting it left by
// 16 gives W[n, k] in fp32, masking the low half gives W[n, k+1], so widening costs one ALU op per
// vector and no shuffle. Output (m, n) is one fp32 lane, y = fma(x[m,K-1], W[n,K-1], ... fma(x[m,0],
// W[n,0], 0)), in order k = 0, 1, 2, ... on both builds: the AVX2 and AVX512F builds agree bitwise.
//
// attention: for each new token of a single sequence, softmax(q K^T * scale) V over its own keys (causal,
// optionally a sliding window), scores and probabilities in fp32, one pass per (head, token).
// attention_indexed: the same over an explicit list of keys per new token (a token tree's mask).
//
// It does not handle other dtypes, autograd or batches of sequences of unequal length (the caller
// falls back to torch there).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ---------------------------------------------------------------- the vector type of this build
#ifdef SPECDECODE_AVX512
using vf = __m512;
using vi = __m512i;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vi vload_i(const void* p) { return _mm512_loadu_si512(p); }
inline vf even_half(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline vf odd_half(vi v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u)))); }
inline vf load_bf16(const uint16_t* p) {  // kLanes consecutive bf16 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vf zero_below(vf value, vf x, float limit) {  // value where x >= limit, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(limit), _CMP_GE_OQ), value);
}
inline void store_bf16(uint16_t* p, vf a, int n) {  // round to nearest even (NaN -> quiet NaN), store n lanes
  const vi u = _mm512_castps_si512(a);
  vi r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  alignas(32) uint16_t tmp[kLanes];
  _mm256_store_si256((__m256i*)tmp, _mm512_cvtepi32_epi16(r));
  std::memcpy(p, tmp, sizeof(uint16_t) * n);
}
#else
using vf = __m256;
using vi = __m256i;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vi vload_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vf even_half(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline vf odd_half(vi v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u)))); }
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf zero_below(vf value, vf x, float limit) {
  return _mm256_and_ps(value, _mm256_cmp_ps(x, vset(limit), _CMP_GE_OQ));
}
inline void store_bf16(uint16_t* p, vf a, int n) {
  const vi u = _mm256_castps_si256(a);
  vi r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                               _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  r = _mm256_srli_epi32(r, 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
  alignas(32) int32_t wide[kLanes];
  _mm256_store_si256((__m256i*)wide, r);
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(wide[i]);
}
#endif

// A fixed-order horizontal sum (lane 0 + lane 1 + ... in sequence), the same for every call.
inline float hsum(vf a) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, a);
  float s = lanes[0];
  for (int i = 1; i < kLanes; ++i) s += lanes[i];
  return s;
}

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6
// polynomial, about 2 ulp; below -87 (e^x under the smallest normal float) the result is 0.
inline vf vexp(vf x) {
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset(1.0f)));
  return zero_below(vmul(p, vpow2i(vmax(n, vset(-126.0f)))), x, -87.0f);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

const uint16_t* bf16_ptr(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// ---------------------------------------------------------------- widened_linear

constexpr int kVecs = 4;                 // output vectors per tile
constexpr int64_t kTile = kVecs * kLanes;  // outputs per tile: 32 (AVX2) or 64 (AVX512F)
#ifdef SPECDECODE_AVX512
constexpr int kMaxRows = 6;  // 6 x 4 accumulators + 8 widened weights fill the 32 registers (not measured: no AVX512F CPU yet)
#else
constexpr int kMaxRows = 4;  // 16 accumulators fill the 16 registers, so some spill; measured faster than 2 or 3 rows per pass
#endif

// R rows of x (fp32, row stride ldx) against one tile; y rows have stride n_out.
template <int R>
void tile_pass(const float* x, int64_t ldx, const uint16_t* w, int64_t pairs, const uint16_t* bias,
               uint16_t* y, int64_t n_out, int64_t n0) {
  vf acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = vzero();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* p = w + kp * 2 * kTile;
    vf even[kVecs], odd[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      const vi pair = vload_i(p + v * 2 * kLanes);
      even[v] = even_half(pair);
      odd[v] = odd_half(pair);
    }
    for (int r = 0; r < R; ++r) {
      const vf x0 = vset(x[r * ldx + 2 * kp]), x1 = vset(x[r * ldx + 2 * kp + 1]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = vfma(x1, odd[v], vfma(x0, even[v], acc[r][v]));
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int64_t n = n0 + v * kLanes;
    if (n >= n_out) break;
    const int valid = int(std::min<int64_t>(kLanes, n_out - n));
    vf b = vzero();
    if (bias) {  // added in fp32 before the single rounding to bf16
      alignas(64) float lanes[kLanes] = {};
      for (int i = 0; i < valid; ++i) lanes[i] = bf16_to_float(bias[n + i]);
      b = vload(lanes);
    }
    for (int r = 0; r < R; ++r) store_bf16(y + r * n_out + n, bias ? vadd(acc[r][v], b) : acc[r][v], valid);
  }
}

void tile_rows(const float* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t pairs,
               const uint16_t* bias, uint16_t* y, int64_t n_out, int64_t n0) {
  int64_t m = 0;
  for (; m + kMaxRows <= rows; m += kMaxRows)
    tile_pass<kMaxRows>(x + m * ldx, ldx, w, pairs, bias, y + m * n_out, n_out, n0);
  const float* xm = x + m * ldx;
  uint16_t* ym = y + m * n_out;
  switch (rows - m) {
#ifdef SPECDECODE_AVX512
    case 5: tile_pass<5>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 4: tile_pass<4>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
#endif
    case 3: tile_pass<3>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 2: tile_pass<2>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 1: tile_pass<1>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    default: break;
  }
}

}  // namespace

int64_t tile_outputs() { return kTile; }

// x: [..., K] bf16; packed: [ceil(N/T), ceil(K/2), T, 2] bf16; bias: [N] bf16 or None. Returns [..., N] bf16.
torch::Tensor widened_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "widened_linear needs bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous(),
              "packed weight has the wrong layout (tile ", packed.size(2), ", this build's is ", kTile, ")");
  const int64_t k = x.size(-1), pairs = packed.size(1), k_padded = 2 * pairs;
  TORCH_CHECK(k <= k_padded && k_padded - k < 2, "x has ", k, " features, the weight ", k_padded);
  TORCH_CHECK(packed.size(0) * kTile >= n_out, "the packed weight has fewer than ", n_out, " outputs");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n_out),
              "bias must be a contiguous bf16 vector of ", n_out);
  auto xf = x.reshape({-1, k}).to(at::kFloat);  // [M, K] widened once; exact
  if (k_padded != k) xf = torch::constant_pad_nd(xf, {0, 1});
  xf = xf.contiguous();
  const int64_t rows = xf.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = torch::empty(out_shape, x.options());
  if (rows == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = bf16_ptr(packed);
  const uint16_t* bp = bias.has_value() ? bf16_ptr(*bias) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile_rows(xp, k_padded, rows, wp + t * pairs * 2 * kTile, pairs, bp, yp, n_out, t * kTile);
  });
  return y;
}

namespace {

// ---------------------------------------------------------------- attention

// One new token of one query head over n keys: key j is lo + j, or index[j] when an index is given (a tree
// node sees its context and its ancestors). out[D] = softmax(q k_j * scale) v_j. Every sum runs over the
// n visible keys in their given order, so a node computes bitwise what decoding its path computes.
void attend_row(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t key_stride,
                int64_t value_stride, int64_t lo, int64_t n, const int64_t* index, int64_t d, float scale,
                uint16_t* out, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  const int64_t n_padded = (n + kLanes - 1) / kLanes * kLanes;
  const int64_t d_vec = d / kLanes * kLanes;
  for (int64_t i = 0; i < d; ++i) qf[i] = bf16_to_float(q[i]);
  scores.assign(n_padded, -std::numeric_limits<float>::infinity());
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {  // each score: one vector sum over d, then a fixed-order lane sum
    const uint16_t* kj = keys + (index ? index[j] : lo + j) * key_stride;
    vf s = vzero();
    for (int64_t i = 0; i < d_vec; i += kLanes) s = vfma(vload(qf.data() + i), load_bf16(kj + i), s);
    float total = hsum(s);
    for (int64_t i = d_vec; i < d; ++i) total = std::fma(qf[i], bf16_to_float(kj[i]), total);
    scores[j] = total * scale;
    best = std::max(best, scores[j]);
  }
  vf sum = vzero();
  const vf shift = vset(best);
  for (int64_t j = 0; j < n_padded; j += kLanes) {  // padding lanes are -inf: their weight is exactly 0
    const vf p = vexp(vsub(vload(scores.data() + j), shift));
    vstore(scores.data() + j, p);
    sum = vadd(sum, p);
  }
  const float inv = 1.0f / hsum(sum);
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t j = 0; j < n; ++j) {  // out += p_j v_j, in key order
    const uint16_t* vj = values + (index ? index[j] : lo + j) * value_stride;
    const vf p = vset(scores[j]);
    for (int64_t i = 0; i < d_vec; i += kLanes) vstore(acc.data() + i, vfma(p, load_bf16(vj + i), vload(acc.data() + i)));
    for (int64_t i = d_vec; i < d; ++i) acc[i] = std::fma(scores[j], bf16_to_float(vj[i]), acc[i]);
  }
  for (int64_t i = 0; i < d_vec; i += kLanes) store_bf16(out + i, vmul(vload(acc.data() + i), vset(inv)), kLanes);
  for (int64_t i = d_vec; i < d; ++i) store_bf16(out + i, vset(acc[i] * inv), 1);
}

}  // namespace

// q: [B, H, T, D], keys/values: [B, Hkv, L, D] (bf16, last dim contiguous), the T new tokens being the
// last T of the L keys. Token t sees keys [max(0, e - window), e) with e = L - T + t + 1 (window 0: no
// limit). Query heads h*G..h*G+G-1 share key head h. Returns [B, H, T, D] bf16.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        int64_t window, double scale) {
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
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = h / kv_heads, rows = b * h * t;
  // Small calls (a decode step over a short context) stay on one thread: a fork costs more than they do.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, length * d));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores, qf(d), acc(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / (h * t), hi = (r / t) % h, ti = r % t, kh = hi / group;
      const int64_t end = length - t + ti + 1, start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      attend_row(qp + r * d, kp + bi * kc.stride(0) + kh * kc.stride(1), vp + bi * vc.stride(0) + kh * vc.stride(1),
                 kc.stride(2), vc.stride(2), start, end - start, nullptr, d, float(scale), op + r * d, scores, qf, acc);
    }
  });
  return out;
}

// Tree attention for one sequence: q [1, H, T, D], keys/values [1, Hkv, L, D]; new token t sees the keys
// index[t, :counts[t]] (int64 [T, M], in order: its context, its ancestors, itself). Returns [1, H, T, D].
torch::Tensor attention_indexed(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                const torch::Tensor& index, const torch::Tensor& counts, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attention_indexed needs bf16");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && keys.dim() == 4 && keys.size(0) == 1 && values.sizes() == keys.sizes(),
              "attention_indexed: q [1,H,T,D], keys/values [1,Hkv,L,D]");
  const int64_t h = q.size(1), t = q.size(2), d = q.size(3), kv_heads = keys.size(1), length = keys.size(2);
  TORCH_CHECK(keys.size(3) == d && h % kv_heads == 0, "attention_indexed: shapes do not match");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 2 && index.size(0) == t && index.is_contiguous() &&
              counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.size(0) == t,
              "attention_indexed: index int64 [T, M] contiguous, counts int64 [T]");
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t ti = 0; ti < t; ++ti) {  // checked once here, so that no row reads outside the keys
    TORCH_CHECK(cp[ti] >= 1 && cp[ti] <= index.size(1), "attention_indexed: counts out of range");
    for (int64_t j = 0; j < cp[ti]; ++j)
      TORCH_CHECK(ip[ti * index.size(1) + j] >= 0 && ip[ti * index.size(1) + j] < length, "attention_indexed: index out of range");
  }
  const auto qc = q.contiguous();
  const auto kc = keys.stride(3) == 1 ? keys : keys.contiguous();
  const auto vc = values.stride(3) == 1 ? values : values.contiguous();
  auto out = torch::empty({1, h, t, d}, q.options());
  const uint16_t* qp = bf16_ptr(qc);
  const uint16_t* kp = bf16_ptr(kc);
  const uint16_t* vp = bf16_ptr(vc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = h / kv_heads, rows = h * t, width = index.size(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, length * d));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores, qf(d), acc(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t hi = r / t, ti = r % t, kh = hi / group;
      attend_row(qp + r * d, kp + kh * kc.stride(1), vp + kh * vc.stride(1), kc.stride(2), vc.stride(2), 0, cp[ti],
                 ip + ti * width, d, float(scale), op + r * d, scores, qf, acc);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widened_linear", &widened_linear);
  m.def("attention", &attention);
  m.def("attention_indexed", &attention_indexed);
  m.def("tile_outputs", &tile_outputs);
}
