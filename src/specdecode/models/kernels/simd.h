// The vector type of one build, and the bf16 / exp helpers every kernel of that build shares.
//
// Built with SPECDECODE_AVX512 (16 fp32 lanes, AVX512F) or without (8 lanes, AVX2 + FMA). SPECDECODE_VNNI
// marks builds with AVX512-VNNI (int8 dot products in one instruction); SPECDECODE_TILED, builds with
// AVX512-BF16. Nothing here allocates, threads or knows about torch beyond its bf16 type.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// Inlining is decided here, not left to GCC, whose choice moved with unrelated edits (prefill of 512 rows on
// Zen 5 ran 250-340 tokens/s with the same loops): every pass and helper of a projection kernel inlines into the
// one function of its weight format (SD_TILE: q_tile, k_tile), so that its loops keep their registers; the
// passes that prefetch stay functions of their own (tile_passes, linear_quant.h).
#define SD_INLINE inline __attribute__((always_inline))
#define SD_TILE __attribute__((noinline))
#define SD_INLINE_LAMBDA __attribute__((always_inline))

namespace sd {

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
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vi vload_i(const void* p) { return _mm512_loadu_si512(p); }
inline vi vzero_i() { return _mm512_setzero_si512(); }
inline vi vset_i(int32_t a) { return _mm512_set1_epi32(a); }
inline vi vsub_i(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vf vcvt_i(vi a) { return _mm512_cvtepi32_ps(a); }
inline vi vcvt_f(vf a) { return _mm512_cvtps_epi32(a); }  // integral inputs: exact
inline vi vadd_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline void vstore_bytes(uint8_t* p, vi a) { _mm512_storeu_si512(p, a); }
inline vi vand_i(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vor_i(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi vset_i8(char a) { return _mm512_set1_epi8(a); }
template <int N> inline vi vshl16(vi a) { return _mm512_slli_epi16(a, N); }  // per 16-bit lane
template <int N> inline vi vshr16(vi a) { return _mm512_srli_epi16(a, N); }
inline vi load_u8_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline vi load_i8_lanes(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline void store_i8(int8_t* p, vi a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(a)); }  // |a| <= 127
inline vf even_half(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline vf odd_half(vi v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u)))); }
inline vf load_bf16(const uint16_t* p) {  // kLanes consecutive bf16 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vf zero_below(vf value, vf x, float limit) {  // value where x >= limit, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(limit), _CMP_GE_OQ), value);
}
inline vf select_ge0(vf x, vf if_ge, vf if_lt) {  // per lane: x >= 0 ? if_ge : if_lt
  return _mm512_mask_mov_ps(if_lt, _mm512_cmp_ps_mask(x, vzero(), _CMP_GE_OQ), if_ge);
}
inline void store_bf16(uint16_t* p, vf a, int n) {  // round to nearest even (NaN -> quiet NaN), store n lanes
  const vi u = _mm512_castps_si512(a);
  vi r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, __mmask16((1u << n) - 1), _mm512_cvtepi32_epi16(r));
}
inline void vstore_n(float* p, vf a, int n) {  // n lanes (a masked store: a copy through memory ran as rep movsq)
  _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), a);
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
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vi vload_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vi vzero_i() { return _mm256_setzero_si256(); }
inline vi vset_i(int32_t a) { return _mm256_set1_epi32(a); }
inline vi vsub_i(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vf vcvt_i(vi a) { return _mm256_cvtepi32_ps(a); }
inline vi vcvt_f(vf a) { return _mm256_cvtps_epi32(a); }
inline vi vadd_i(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline void vstore_bytes(uint8_t* p, vi a) { _mm256_storeu_si256((__m256i*)p, a); }
inline vi vand_i(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi vor_i(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi vset_i8(char a) { return _mm256_set1_epi8(a); }
template <int N> inline vi vshl16(vi a) { return _mm256_slli_epi16(a, N); }  // per 16-bit lane
template <int N> inline vi vshr16(vi a) { return _mm256_srli_epi16(a, N); }
inline vi load_u8_lanes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline vi load_i8_lanes(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline void store_i8(int8_t* p, vi a) {  // 8 lanes with |a| <= 127 -> 8 bytes
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
inline vf even_half(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline vf odd_half(vi v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u)))); }
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf zero_below(vf value, vf x, float limit) {
  return _mm256_and_ps(value, _mm256_cmp_ps(x, vset(limit), _CMP_GE_OQ));
}
inline vf select_ge0(vf x, vf if_ge, vf if_lt) {
  return _mm256_blendv_ps(if_lt, if_ge, _mm256_cmp_ps(x, vzero(), _CMP_GE_OQ));
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
inline void vstore_n(float* p, vf a, int n) {  // n lanes
  if (n == kLanes) return vstore(p, a);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), a);
}
#endif

// A horizontal sum in a fixed tree order (halves added, then their halves, ...), the same for every call.
inline float hsum(vf a) {
#ifdef SPECDECODE_AVX512
  const __m256 lo = _mm512_castps512_ps256(a);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 h = _mm256_add_ps(lo, hi);
#else
  const __m256 h = a;
#endif
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// The largest lane (exact in any order for lanes without NaN).
inline float hmax(vf a) {
#ifdef SPECDECODE_AVX512
  return _mm512_reduce_max_ps(a);
#else
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
#endif
}

// The sum of the integer lanes (exact: any order gives the same).
inline int32_t hsum_i(vi a) {
#ifdef SPECDECODE_AVX512
  return _mm512_reduce_add_epi32(a);
#else
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(b, _mm_shuffle_epi32(b, _MM_SHUFFLE(2, 3, 0, 1))));
#endif
}

// Per 128-bit lane of a and b: (a0 + a2, a1 + a3, b0 + b2, b1 + b3), and (a0 + a1, a2 + a3, b0 + b1, b2 + b3).
#ifdef SPECDECODE_AVX512
inline __m512 add_halves4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 add_neighbours4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif
inline __m256 add_halves4(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m256 add_neighbours4(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane k = hsum(x[k]) for kLanes vectors, bit for bit (the same tree of adds, kLanes sums at a time by shuffles:
// about 3 instructions a sum instead of hsum's 8).
inline vf hsum_lanes(const vf* x) {
#ifdef SPECDECODE_AVX512
  __m512 h[8], s[4];
  for (int i = 0; i < 8; ++i)  // per key: quarters 0 + 2 and 1 + 3 (hsum's halves); keys 2i, 2i+1 side by side
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // the two quarters added: quarter k holds key 4m + k's four lanes
    s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lanes 0 + 2 and 1 + 3 of each key's four, then those two added: quarter k, position p holds key 4p + k
  const __m512 f = add_neighbours4(add_halves4(s[0], s[1]), add_halves4(s[2], s[3]));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
#else
  __m256 s[4];
  for (int i = 0; i < 4; ++i)  // per key: halves added; keys 2i, 2i+1 side by side
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x31));
  // lanes 0 + 2 and 1 + 3 of each key's four, then those two added: half k, position p holds key 2p + k
  const __m256 f = add_neighbours4(add_halves4(s[0], s[1]), add_halves4(s[2], s[3]));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
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

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN -> quiet NaN (as store_bf16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline const uint16_t* bf16_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* bf16_ptr_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// Runs pass(std::integral_constant<int, R>{}, m) over rows [0, rows): blocks of kMax rows from m = 0, then
// one block of the R < kMax rows left. Each block height is its own compiled pass (its accumulators in
// registers); every projection kernel walks its rows this way.
template <int R, typename Pass>
inline void rest_rows(int64_t left, int64_t m, Pass& pass) {
  if constexpr (R > 0) {
    if (left == R)
      pass(std::integral_constant<int, R>{}, m);
    else
      rest_rows<R - 1>(left, m, pass);
  }
}

template <int kMax, typename Pass>
inline void row_blocks(int64_t rows, Pass&& pass) {
  int64_t m = 0;
  for (; m + kMax <= rows; m += kMax) pass(std::integral_constant<int, kMax>{}, m);
  rest_rows<kMax - 1>(rows - m, m, pass);
}

}  // namespace sd
