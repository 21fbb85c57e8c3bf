// y = x W^T (+ b) with W bf16, for the 1-32 rows of a decode or verification step. Two kernels, one per
// build: `widened` (every build: bf16 weights widened to fp32 in registers, fp32 FMAs) and `tiled`
// (AVX512-BF16 builds: vdpbf16ps dot products over pairs of features).
//
// W is packed once (models/native.py) as [N/T, K/2, T, 2]: for each tile of T outputs, consecutive pairs of
// input features, so a tile streams from memory as one sequential run. Output (m, n) is one fp32 lane
// whose sum runs over k in order and depends only on row m, never on how many rows share the call: every
// row is bitwise what it is alone (what exact verification needs).
//
// widened: a 32-bit lane holds (W[n, k], W[n, k+1]): shifting it left by 16 gives W[n, k] in fp32, masking
// the low half gives W[n, k+1], so widening costs one ALU op per vector. y = fma(x[m,K-1], W[n,K-1], ...
// fma(x[m,0], W[n,0], 0)) on both vector widths: the AVX2 and AVX512F builds agree bitwise.
// tiled: each step loads 4 vectors of W (64 outputs x 2 features) and, for each of up to 6 rows, broadcasts
// that row's 2 features and accumulates with vdpbf16ps; no claim that it matches `widened` bit for bit.
//
// It does not handle other weight dtypes or autograd.
#pragma once

#include <ATen/Parallel.h>

#include "simd.h"

namespace sd {

constexpr int kVecs = 4;                   // output vectors per tile
constexpr int64_t kTile = kVecs * kLanes;  // outputs per tile: 32 (AVX2) or 64 (AVX512F)
#ifdef SPECDECODE_AVX512
constexpr int kMaxRows = 6;  // 6 x 4 accumulators + 8 widened weights fill the 32 registers
#else
constexpr int kMaxRows = 4;  // 16 accumulators fill the 16 registers, so some spill; measured faster than 2 or 3 rows per pass
#endif

inline void store_out(float* y, vf a, int n) { vstore_n(y, a, n); }
inline void store_out(uint16_t* y, vf a, int n) { store_bf16(y, a, n); }

inline vf load_bias(const uint16_t* bias, int64_t n, int valid) {  // bf16 bias lanes n..n+valid-1, zero beyond
  alignas(64) float lanes[kLanes] = {};
  for (int i = 0; i < valid; ++i) lanes[i] = bf16_to_float(bias[n + i]);
  return vload(lanes);
}

// R rows of x (fp32, row stride ldx) against one tile; y rows have stride ldy.
template <int R, typename Out>
void widened_pass(const float* x, int64_t ldx, const uint16_t* w, int64_t pairs, const uint16_t* bias, Out* y,
                  int64_t ldy, int64_t n_out, int64_t n0) {
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
    const vf b = bias ? load_bias(bias, n, valid) : vzero();  // added in fp32 before the output's one rounding
    for (int r = 0; r < R; ++r) store_out(y + r * ldy + n, bias ? vadd(acc[r][v], b) : acc[r][v], valid);
  }
}

template <typename Out>
void widened_tile(const float* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t pairs, const uint16_t* bias,
                  Out* y, int64_t ldy, int64_t n_out, int64_t n0) {
  row_blocks<kMaxRows>(rows, [&](auto r, int64_t m) {
    widened_pass<decltype(r)::value>(x + m * ldx, ldx, w, pairs, bias, y + m * ldy, ldy, n_out, n0);
  });
}

// All tiles of a widened projection, split across threads: x fp32 [rows, 2 * pairs].
template <typename Out>
void widened_rows(const float* x, int64_t rows, const uint16_t* w, int64_t tiles, int64_t pairs, const uint16_t* bias,
                  Out* y, int64_t n_out) {
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      widened_tile(x, 2 * pairs, rows, w + t * pairs * 2 * kTile, pairs, bias, y, n_out, n_out, t * kTile);
  });
}

#ifdef SPECDECODE_TILED
constexpr int64_t kTiledTile = 64;  // 4 vectors of 16 fp32 lanes
constexpr int kTiledRows = 6;       // 6 x 4 accumulators + 4 weight vectors fit 32 registers

inline void tiled_store(float* y, __m512 a, int n) { store_out(y, a, n); }
inline void tiled_store(uint16_t* y, __m512 a, int n) {  // the hardware's rounding to bf16, as this kernel always did
  _mm256_mask_storeu_epi16(y, (__mmask16)((1u << n) - 1), (__m256i)_mm512_cvtneps_pbh(a));
}

template <int C, typename Out>
void tiled_pass(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const uint16_t* bias, Out* y,
                int64_t ldy, int64_t n_out, int64_t n0) {
  __m512 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < 4; ++r) acc[c][r] = _mm512_setzero_ps();
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);  // one int32 = two bf16 features
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* p = w + kp * 2 * kTiledTile;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p), w1 = (__m512bh)_mm512_loadu_si512(p + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(p + 64), w3 = (__m512bh)_mm512_loadu_si512(p + 96);
    for (int c = 0; c < C; ++c) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpairs[c * (ldx / 2) + kp]);
      acc[c][0] = _mm512_dpbf16_ps(acc[c][0], xv, w0);
      acc[c][1] = _mm512_dpbf16_ps(acc[c][1], xv, w1);
      acc[c][2] = _mm512_dpbf16_ps(acc[c][2], xv, w2);
      acc[c][3] = _mm512_dpbf16_ps(acc[c][3], xv, w3);
    }
  }
  for (int r = 0; r < 4; ++r) {
    const int64_t n = n0 + r * 16;
    if (n >= n_out) break;
    const int valid = int(std::min<int64_t>(16, n_out - n));
    const vf b = bias ? load_bias(bias, n, valid) : vzero();  // bias is added in fp32 before the single rounding
    for (int c = 0; c < C; ++c) tiled_store(y + c * ldy + n, bias ? vadd(acc[c][r], b) : acc[c][r], valid);
  }
}

template <typename Out>
void tiled_tile(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t pairs, const uint16_t* bias,
                Out* y, int64_t ldy, int64_t n_out, int64_t n0) {
  row_blocks<kTiledRows>(rows, [&](auto r, int64_t m) {
    tiled_pass<decltype(r)::value>(x + m * ldx, ldx, w, pairs, bias, y + m * ldy, ldy, n_out, n0);
  });
}

// All tiles of a tiled projection, split across threads: x bf16 [rows, 2 * pairs].
template <typename Out>
void tiled_rows(const uint16_t* x, int64_t rows, const uint16_t* w, int64_t tiles, int64_t pairs, const uint16_t* bias,
                Out* y, int64_t n_out) {
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tiled_tile(x, 2 * pairs, rows, w + t * pairs * 2 * kTiledTile, pairs, bias, y, n_out, n_out, t * kTiledTile);
  });
}
#endif

inline void check_packed_bf16(const torch::Tensor& packed, int64_t tile, int64_t n_out, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == tile &&
              packed.size(3) == 2 && packed.is_contiguous(),
              "packed weight has the wrong layout (tile ", packed.size(2), ", this build's is ", tile, ")");
  TORCH_CHECK(k <= 2 * packed.size(1) && 2 * packed.size(1) - k < 2, "x has ", k, " features, the weight ", 2 * packed.size(1));
  TORCH_CHECK(packed.size(0) * tile >= n_out, "the packed weight has fewer than ", n_out, " outputs");
}

inline const uint16_t* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t n_out) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n_out,
              "bias must be a contiguous bf16 vector of ", n_out);
  return bf16_ptr(*bias);
}

}  // namespace sd

inline int64_t tile_outputs() { return sd::kTile; }

// x: [..., K] bf16; packed: [ceil(N/T), ceil(K/2), T, 2] bf16; bias: [N] bf16 or None. Returns [..., N] bf16.
inline torch::Tensor widened_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                    const c10::optional<torch::Tensor>& bias) {
  using namespace sd;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "widened_linear needs bf16");
  const int64_t k = x.size(-1);
  check_packed_bf16(packed, kTile, n_out, k);
  const uint16_t* bp = bias_ptr(bias, n_out);
  auto xf = x.reshape({-1, k}).to(at::kFloat);  // [M, K] widened once; exact
  if (2 * packed.size(1) != k) xf = torch::constant_pad_nd(xf, {0, 1});
  xf = xf.contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = torch::empty(out_shape, x.options());
  if (xf.size(0) == 0) return y;
  widened_rows(xf.data_ptr<float>(), xf.size(0), bf16_ptr(packed), packed.size(0), packed.size(1), bp, bf16_ptr_mut(y), n_out);
  return y;
}

#ifdef SPECDECODE_TILED
// x: [..., K] bf16; packed: [ceil(N/64), ceil(K/2), 64, 2] bf16; bias: [N] bf16 or None. Returns [..., N].
inline torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                  const c10::optional<torch::Tensor>& bias) {
  using namespace sd;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tiled_linear needs bf16");
  const int64_t k = x.size(-1);
  check_packed_bf16(packed, kTiledTile, n_out, k);
  const uint16_t* bp = bias_ptr(bias, n_out);
  auto flat = x.reshape({-1, k});
  auto xs = 2 * packed.size(1) == k ? flat.contiguous() : torch::constant_pad_nd(flat, {0, 1});
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = torch::empty(out_shape, x.options());
  if (xs.size(0) == 0) return y;
  tiled_rows(bf16_ptr(xs), xs.size(0), bf16_ptr(packed), packed.size(0), packed.size(1), bp, bf16_ptr_mut(y), n_out);
  return y;
}
#endif
