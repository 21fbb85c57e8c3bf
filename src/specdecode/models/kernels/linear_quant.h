// y = x W^T (+ b) with W in llama.cpp's block formats (q8_0, q4_0, q4_1, q5_0, q5_1: blocks of 32 weights
// along the input, an fp16 scale each, q4_1 and q5_1 an fp16 minimum too) and x quantized per row to int8
// blocks of 32 with an fp32 scale (llama.cpp's q8_0 / q8_1 activations).
//
// Per block, a row's dot product with an output is an exact integer (VNNI vpdpbusd, or AVX2 vpmaddubsw +
// vpmaddwd, which give the same integers), scaled in fp32: y += float(isum) * (d_w * d_x), plus m_w * s_x
// for q4_1 and q5_1 (s_x = d_x * sum of the row's block codes). The blocks are summed in order and nothing depends
// on other rows, so each row is bitwise what it is alone, and the AVX2 and AVX512 builds give the same bits.
//
// Packed layout (models/weights.py packs it): [ceil(N/T), K/32, record] bytes, T = 2 vectors of outputs. A
// record holds one block of T outputs: the codes (q5: then their fifth bits, 4 bytes per output as q5_k's, see
// nibble_sums), then T fp16 scales d (then T fp16 minimums m for q4_1 and q5_1).
// q8_0 codes are stored as w + 128 (unsigned): vector (quad q, vector v) holds, per output lane, the 4 codes
// of inputs 4q..4q+3. q4 codes are nibbles: vector (p, v) holds inputs 4p..4p+3 in its low nibbles and
// 16+4p..16+4p+3 in its high ones.
//
// It does not quantize weights (Python does, once). The K-quant super-block formats are linear_kquant.h's;
// linear_blocks.h dispatches on the format and is the torch entry point.
#pragma once

#include <unistd.h>

#include <atomic>
#include <vector>

#include "simd.h"

#if defined(SPECDECODE_AVX512) && !defined(SPECDECODE_VNNI)
#error "the AVX512 builds of the quantized kernels need AVX512-VNNI"
#endif

namespace sd {

// Format codes (models/weights.py FORMAT_CODES); 3 is bf16 (layer.h). q4_k, q5_k and q6_k: linear_kquant.h.
enum : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 4, kQ6_K = 5, kQ5_K = 6, kQ5_0 = 7, kQ5_1 = 8 };
constexpr int64_t kQBlock = 32;
constexpr int kQVecs = 2;                    // output vectors per tile
constexpr int64_t kQTile = kQVecs * kLanes;  // outputs per tile: 32 (AVX512) or 16 (AVX2)
#ifdef SPECDECODE_AVX512
constexpr int kQRows = 4;  // 8 int + 8 fp32 accumulators, weights and scales within the 32 registers (6 measured no faster)
#else
constexpr int kQRows = 2;
#endif

constexpr bool has_fifth_bits(int64_t fmt) { return fmt == kQ5_0 || fmt == kQ5_1; }
constexpr bool has_minimum(int64_t fmt) { return fmt == kQ4_1 || fmt == kQ5_1; }
constexpr int64_t q_code_bytes(int64_t fmt) { return kQTile * (fmt == kQ8_0 ? 32 : has_fifth_bits(fmt) ? 20 : 16); }
constexpr int64_t q_scale_count(int64_t fmt) { return kQTile * (has_minimum(fmt) ? 2 : 1); }
constexpr int64_t q_record_bytes(int64_t fmt) { return q_code_bytes(fmt) + 2 * q_scale_count(fmt); }

// Rows of x quantized to int8 blocks: codes [rows, blocks * 32], scale d, code sum sx and s = d * sx per block,
// and the code sums of each block's two halves of 16 (sx16 [rows, blocks, 2]: Q6_K scales 16 weights apart).
struct QuantRows {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sx, sx16;
};

// Sizes `out` for `rows` rows of k features (quantize_range fills it).
inline void shape_quant(int64_t rows, int64_t k, QuantRows& out) {
  const int64_t blocks = (k + kQBlock - 1) / kQBlock;
  out.rows = rows;
  out.blocks = blocks;
  out.q.resize(rows * blocks * kQBlock);
  out.d.resize(rows * blocks);
  out.s.resize(rows * blocks);
  out.sx.resize(rows * blocks);
  out.sx16.resize(rows * blocks * 2);
}

// Quantizes rows r0..r1 of `out` (shaped) from fp32 x (row r0 at x, row stride ldx, k features; zero beyond k up
// to a whole block) with llama.cpp's q8_0 scale, d = amax / 127, and codes x * (1 / d) rounded to nearest (ties
// to even); all codes 0 where 1 / d is not finite.
inline void quantize_range(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, QuantRows& out) {
  const int64_t blocks = out.blocks;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      alignas(64) float tail[kQBlock];
      const int64_t n = std::min<int64_t>(kQBlock, k - b * kQBlock);
      const float* v = x + (r - r0) * ldx + b * kQBlock;
      if (n < kQBlock) {  // the last block of a row whose length is not a whole number of blocks
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, v, sizeof(float) * n);
        v = tail;
      }
      vf amax = vzero();
      for (int i = 0; i < kQBlock; i += kLanes) amax = vmax(amax, vabs(vload(v + i)));
      // max(lane, 0) first drops a NaN lane (the second operand wins), as a scalar std::max over the lanes did
      const float d = hmax(vmax(amax, vzero())) / 127.0f, inv = 1.0f / d;
      const float id = std::isfinite(inv) ? inv : 0.0f;  // d = 0, or so small (< 2^-128) that 1 / d overflows: codes 0
      int8_t* q = out.q.data() + (r * blocks + b) * kQBlock;
      vi sum[2] = {vzero_i(), vzero_i()};  // per half of 16 codes
      for (int i = 0; i < kQBlock; i += kLanes) {  // codes: rounded to nearest even, then narrowed (|c| <= 127)
        const vi c = vcvt_f(vround(vmul(vload(v + i), vset(id))));
        sum[i / 16] = vadd_i(sum[i / 16], c);
        store_i8(q + i, c);
      }
      const int32_t low = hsum_i(sum[0]), high = hsum_i(sum[1]), total = low + high;
      out.d[r * blocks + b] = d;
      out.sx16[2 * (r * blocks + b)] = low;
      out.sx16[2 * (r * blocks + b) + 1] = high;
      out.sx[r * blocks + b] = total;
      out.s[r * blocks + b] = d * float(total);
    }
  }
}

// All rows of x: shape_quant, then quantize_range over them.
inline void quantize_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, QuantRows& out) {
  shape_quant(rows, k, out);
  quantize_range(x, ldx, 0, rows, k, out);
}

// y rows r (stride ldy), outputs n0.. of one tile: the fp32 sums facc plus the bias, as fp32 or bf16.
template <int R, typename Out>
void store_tile(const vf (&facc)[R][kQVecs], const float* bias, Out* y, int64_t ldy, int64_t n_out, int64_t n0) {
  for (int v = 0; v < kQVecs; ++v) {
    const int64_t n = n0 + v * kLanes;
    if (n >= n_out) break;
    const int valid = int(std::min<int64_t>(kLanes, n_out - n));
    vf b = vzero();
    if (bias) {
      alignas(64) float lanes[kLanes] = {};
      std::memcpy(lanes, bias + n, sizeof(float) * valid);
      b = vload(lanes);
    }
    for (int r = 0; r < R; ++r) {
      const vf out = bias ? vadd(facc[r][v], b) : facc[r][v];
      if constexpr (std::is_same_v<Out, float>) {
        vstore_n(y + r * ldy + n, out, valid);
      } else {
        store_bf16(y + r * ldy + n, out, valid);
      }
    }
  }
}

inline vi bcast4(const int8_t* p) {  // 4 consecutive codes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return vset_i(v);
}

inline vi low_nibbles(vi v) { return vand_i(v, vset_i8(0x0F)); }
inline vi high_nibbles(vi v) { return vand_i(vshr16<4>(v), vset_i8(0x0F)); }

// acc + per lane sum of 4 products u8 w x s8 x, for w <= 63 (no 16-bit saturation on AVX2: 2 * 63 * 127 < 2^15).
inline vi dot_u4(vi acc, vi w, vi x) {
#ifdef SPECDECODE_VNNI
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// Bit p (low) or bit 4 + p (high) of every byte moved to bit 4, the rest cleared; p is a constant where
// inlined (the quad loops unroll).
inline vi fifth_low(vi h, int p) {
  const vi moved = p == 0 ? vshl16<4>(h) : p == 1 ? vshl16<3>(h) : p == 2 ? vshl16<2>(h) : vshl16<1>(h);
  return vand_i(moved, vset_i8(0x10));
}
inline vi fifth_high(vi h, int p) {
  const vi moved = p == 0 ? h : p == 1 ? vshr16<1>(h) : p == 2 ? vshr16<2>(h) : vshr16<3>(h);
  return vand_i(moved, vset_i8(0x10));
}

// acc[r][v] += one block's integer sums of R activation rows (codes xb[r]) with 4-bit codes laid out as q4's
// (vector (p, v): inputs 4p..4p+3 in the low nibbles, 16+4p.. in the high ones), or 5-bit ones where `high`
// holds their fifth bits (q5_k, q5_0, q5_1: vector v, per output lane 4 bytes, byte i: bit p = input 4p + i,
// bit 4 + p = input 16 + 4p + i; the 16-bit shifts' spill between bytes never reaches bit 4).
template <int R>
SD_INLINE void nibble_sums(const uint8_t* codes, const int8_t* const (&xb)[R], vi (&acc)[R][kQVecs],
                        const uint8_t* high = nullptr) {
  constexpr int kVecBytes = kLanes * 4;
  vi fifth[kQVecs];
  if (high)
    for (int v = 0; v < kQVecs; ++v) fifth[v] = vload_i(high + v * kVecBytes);
#pragma GCC unroll 4  // with the fifth bits GCC kept the loop, shifting by a p known only at run time
  for (int p = 0; p < 4; ++p) {
    vi lo[kQVecs], hi[kQVecs];
    for (int v = 0; v < kQVecs; ++v) {
      const vi raw = vload_i(codes + (p * kQVecs + v) * kVecBytes);
      lo[v] = low_nibbles(raw);
      hi[v] = high_nibbles(raw);
      if (high) {
        lo[v] = vor_i(lo[v], fifth_low(fifth[v], p));
        hi[v] = vor_i(hi[v], fifth_high(fifth[v], p));
      }
    }
    for (int r = 0; r < R; ++r) {
      const vi xlo = bcast4(xb[r] + 4 * p), xhi = bcast4(xb[r] + 16 + 4 * p);
      for (int v = 0; v < kQVecs; ++v) acc[r][v] = dot_u4(dot_u4(acc[r][v], lo[v], xlo), hi[v], xhi);
    }
  }
}

#ifdef SPECDECODE_VNNI
constexpr bool kQ8Offset = true;  // VNNI sums (w + 128) x; the block's 128 * sum(x) is taken off once
#else
constexpr bool kQ8Offset = false;  // AVX2 sums w x directly: |x| times w with x's sign, within 16 bits
#endif

// The next tile, prefetched while a tile computes (past the last tile a prefetch is harmless): the hardware's
// prefetcher alone leaves memory idle while a pass of a few rows computes (4-5 rows: 10-25% slower without it
// on Zen 5), and a pass over a tile already in cache would leave it idle altogether. The passes over one tile
// share the work: pass i of n prefetches blocks i, i + n, ... of the next tile. Past kAheadPasses passes the
// tile computes long enough for the hardware's prefetcher, and prefetching into L1 only evicts the tile and
// rows in use, so those passes are compiled without it (Zen 5, Qwen 1.5B: 512 rows 6% faster without; 17-64
// rows 0-8% slower, so not from 5 passes on).
constexpr int64_t kAheadPasses = 16;

// The cache the next tile is prefetched into: 1 for L2, 0 for L1. Where L1 cannot hold the tile in use beside the
// next one (32 KB, and a q4_k tile of 1536 inputs is 28 KB), a tile prefetched into L1 evicted the one that the
// next pass of rows reads again (Zen 4: a 5-row forward of Qwen 1.5B 0.61-0.66x the time into L2, 1 row no
// slower; its AVX2 build, with half-width tiles, the same either way). L1 stays where L1 holds 48 KB or more
// (Zen 5: measured with L1 only) or its size is unknown. set_prefetch_level overrides it.
inline int default_prefetch_level() {
  const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return l1 > 0 && l1 < 48 * 1024 ? 1 : 0;
}
inline std::atomic<int> prefetch_level{default_prefetch_level()};

struct Ahead {
  const uint8_t* next;
  int64_t period, wait;  // every period-th block, from block `wait`
  bool to_l2 = prefetch_level.load(std::memory_order_relaxed) == 1;

  // Pass m / rows_per_pass of a tile's passes over `rows` rows (m: its first row).
  Ahead(const uint8_t* next_tile, int64_t m, int64_t rows, int64_t rows_per_pass)
      : next(next_tile), period((rows + rows_per_pass - 1) / rows_per_pass), wait(m / rows_per_pass) {}

  SD_INLINE bool due() {  // whether this pass prefetches the block it starts now
    if (wait > 0) {
      --wait;
      return false;
    }
    wait = period - 1;
    return true;
  }

  SD_INLINE void fetch(int64_t from, int64_t to) const {  // bytes [from, to) of the next tile, whole lines
    for (int64_t line = from / 64 * 64; line < to; line += 64) {
      const char* at = reinterpret_cast<const char*>(next + line);
      if (to_l2) _mm_prefetch(at, _MM_HINT_T1);
      else _mm_prefetch(at, _MM_HINT_T0);
    }
  }
};

// Calls f() from a function of its own, one per f.
template <typename F>
__attribute__((noinline)) void call_apart(const F& f) {
  f();
}

// Runs pass(rows_constant, m, ahead_constant, ahead) over a tile's rows in passes of up to kMax (row_blocks),
// with the prefetch of the next tile (`next`) compiled in where the tile has at most kAheadPasses passes. Those
// passes run as functions of their own (inlined into the tile's function, one-row decode ran ~4% slower in
// paired runs: Qwen 1.5B, Zen 5); the others inline into it.
template <int kMax, typename Pass>
inline void tile_passes(int64_t rows, const uint8_t* next, Pass&& pass) {
  if ((rows + kMax - 1) / kMax <= kAheadPasses) {
    row_blocks<kMax>(rows, [&](auto r, int64_t m) {
      call_apart([&] { pass(r, m, std::true_type{}, Ahead(next, m, rows, kMax)); });
    });
  } else {
    row_blocks<kMax>(rows, [&](auto r, int64_t m) { pass(r, m, std::false_type{}, Ahead(next, m, rows, kMax)); });
  }
}

// R rows of the quantized activations (from row r0) against one tile of format F; `ahead` as above, used where
// kAhead.
template <int R, int64_t F, bool kAhead, typename Out>
SD_INLINE void q_pass(const QuantRows& a, int64_t r0, const uint8_t* w, const float* bias, Out* y, int64_t ldy,
                      int64_t n_out, int64_t n0, Ahead ahead) {
  constexpr int64_t kRecord = q_record_bytes(F), kCodes = q_code_bytes(F);
  constexpr int kVecBytes = kLanes * 4;
  const int64_t blocks = a.blocks;
  vf facc[R][kQVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kQVecs; ++v) facc[r][v] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = w + b * kRecord;
    if (kAhead && ahead.due()) ahead.fetch(b * kRecord, (b + 1) * kRecord);
    vi acc[R][kQVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kQVecs; ++v) acc[r][v] = vzero_i();
    const int8_t* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = a.q.data() + ((r0 + r) * blocks + b) * kQBlock;
    if constexpr (F == kQ8_0) {
      for (int q = 0; q < 8; ++q) {
        vi wv[kQVecs];
        for (int v = 0; v < kQVecs; ++v) wv[v] = vload_i(rec + (q * kQVecs + v) * kVecBytes);
#ifndef SPECDECODE_VNNI
        for (int v = 0; v < kQVecs; ++v) wv[v] = _mm256_xor_si256(wv[v], _mm256_set1_epi8(char(0x80)));  // back to s8
#endif
        for (int r = 0; r < R; ++r) {
          const vi x = bcast4(xb[r] + 4 * q);
#ifdef SPECDECODE_VNNI
          for (int v = 0; v < kQVecs; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv[v], x);
#else
          const vi ax = _mm256_abs_epi8(x);
          for (int v = 0; v < kQVecs; ++v)
            acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], x)),
                                                                      _mm256_set1_epi16(1)));
#endif
        }
      }
    } else {
      nibble_sums<R>(rec, xb, acc, has_fifth_bits(F) ? rec + 16 * kQTile : nullptr);
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + kCodes);
    vf dw[kQVecs], mw[kQVecs];
    for (int v = 0; v < kQVecs; ++v) {
      dw[v] = load_half(scales + v * kLanes);
      if constexpr (has_minimum(F)) mw[v] = load_half(scales + kQTile + v * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + b;
      const vf dx = vset(a.d[at]);
      int32_t offset = 0;  // what the integer sums hold beyond sum(w x): the codes' offset times sum(x)
      if constexpr (F == kQ8_0) offset = kQ8Offset ? 128 * a.sx[at] : 0;
      if constexpr (F == kQ4_0) offset = 8 * a.sx[at];
      if constexpr (F == kQ5_0) offset = 16 * a.sx[at];
      for (int v = 0; v < kQVecs; ++v) {
        const vi exact = offset ? vsub_i(acc[r][v], vset_i(offset)) : acc[r][v];
        facc[r][v] = vfma(vcvt_i(exact), vmul(dw[v], dx), facc[r][v]);
        if constexpr (has_minimum(F)) facc[r][v] = vfma(mw[v], vset(a.s[at]), facc[r][v]);
      }
    }
  }
  store_tile<R>(facc, bias, y, ldy, n_out, n0);
}

// Every row against one tile (stride bytes long; the next tile follows it), in passes of up to kQRows rows;
// y's rows are ldy apart and n_out wide.
template <int64_t F, typename Out>
SD_TILE void q_tile(const QuantRows& a, const uint8_t* w, int64_t stride, const float* bias, Out* y, int64_t ldy,
                    int64_t n_out, int64_t n0) {
  tile_passes<kQRows>(a.rows, w + stride, [&](auto r, int64_t m, auto prefetch, Ahead ahead) {
    q_pass<decltype(r)::value, F, decltype(prefetch)::value>(a, m, w, bias, y + m * ldy, ldy, n_out, n0, ahead);
  });
}

}  // namespace sd
