// y = x W^T with W in llama.cpp's K-quant formats as stored, super-blocks of 256 weights along the input:
//   q4_k: w = (d * sc_j) * q - (dmin * m_j), q in 0..15, 6-bit sc_j and m_j per 32 weights, fp16 d and dmin;
//   q5_k: the same with q in 0..31 (its fifth bits apart, see nibble_sums);
//   q6_k: w = (d * sc_h) * (q - 32), q in 0..63, int8 sc_h per 16 weights, fp16 d.
// x is quantized per 32 as for the other block formats (linear_quant.h). Per block of 32, a row's dot product
// with an output is an exact integer: q4_k's isum (the scales d * sc_j and dmin * m_j are exact in fp32:
// 11 bits times 6), q6_k's sc_0 * sum(q - 32) x + sc_1 * sum(q - 32) x over its two halves (|.| < 2^24, so
// exact in fp32 too). Then, as for q4_1, y += float(isum) * (d_w * d_x) (q4_k: - (dmin m_j) * s_x). Blocks are
// summed in order and no row depends on another: rows are bitwise what they are alone, on every build.
//
// Packed layout (models/super_blocks.py): [ceil(N/T), K/256, record] bytes, T = kQTile outputs; each block's
// bytes together, so that a block streams in as one run. A
// q4_k record: T fp16 d, T fp16 dmin, then per block j of 8: its codes as q4's (16 T bytes), T sc, T m (uint8);
// a q5_k record the same with each block's fifth bits (4 T) after its nibbles.
// A q6_k record: T fp16 d, then per block j: its low nibbles as q4's codes (16 T), its high bit pairs (8 T:
// vector (half h, v) holds per output lane 4 bytes, byte i = the pairs of inputs 16h + 4p + i at bits 2p), and
// 2 x T int8 sc (half 0, half 1).
//
// It does not read GGUF blocks (Python repacks them once) or quantize weights into these formats.
#pragma once

#include "linear_quant.h"

namespace sd {

constexpr int64_t kSuper = 256;  // weights per super-block
constexpr int64_t kSuperBlocks = kSuper / kQBlock;
constexpr int64_t k_record_bytes(int64_t fmt) { return kQTile * (fmt == kQ4_K ? 148 : fmt == kQ5_K ? 180 : 210); }

// Bit pairs 2p, 2p + 1 of every byte moved to bits 4, 5 (the high part of a 6-bit code); the 16-bit shifts'
// spill between bytes is masked off. p is a constant where inlined (the quad loops unroll).
inline vi pair_to_high(vi h, int p) {
  const vi moved = p == 0 ? vshl16<4>(h) : p == 1 ? vshl16<2>(h) : p == 2 ? h : vshr16<2>(h);
  return vand_i(moved, vset_i8(0x30));
}

// Where block j of a q6_k record starts: its low nibbles (16 T), high bit pairs (8 T), two scales (2 T).
inline const uint8_t* q6_block(const uint8_t* record, int64_t j) { return record + 2 * kQTile + j * 26 * kQTile; }

// Quad p of output vector v of half h of a q6_k block: the 6-bit codes of inputs 16h + 4p.. (their low
// nibbles for h = 0, high for h = 1, with the half's bit pairs `high`).
SD_INLINE vi q6_codes(const uint8_t* block, vi high, int h, int p, int v) {
  const vi raw = vload_i(block + (p * kQVecs + v) * kLanes * 4);
  return vor_i(h == 0 ? low_nibbles(raw) : high_nibbles(raw), pair_to_high(high, p));
}

// Block j's share (an eighth) of super-block s of the next tile: prefetching a whole record at once overruns
// the fill buffers (the fused layers ran 1.6x slower).
SD_INLINE void prefetch_share(const Ahead& ahead, int64_t record_bytes, int64_t s, int64_t j) {
  const int64_t at = s * record_bytes;
  ahead.fetch(at + j * record_bytes / kSuperBlocks, at + (j + 1) * record_bytes / kSuperBlocks);
}

// A q6_k tile's 6-bit codes as whole bytes, q8_0's arrangement per block (quads 0-3: the low half's inputs,
// 4-7: the high half's): unpacked once for all the passes of a call past 32 rows.
SD_INLINE void q6_unpack(const uint8_t* w, int64_t supers, uint8_t* out, const Ahead& ahead) {
  constexpr int64_t T = kQTile, kRecord = k_record_bytes(kQ6_K);
  constexpr int kVecBytes = kLanes * 4;
  for (int64_t s = 0; s < supers; ++s) {
    for (int64_t j = 0; j < kSuperBlocks; ++j) {
      prefetch_share(ahead, kRecord, s, j);
      const uint8_t* ql = q6_block(w + s * kRecord, j);
      uint8_t* block = out + (s * kSuperBlocks + j) * kQBlock * T;
      for (int v = 0; v < kQVecs; ++v) {
        const vi high0 = vload_i(ql + 16 * T + v * kVecBytes), high1 = vload_i(ql + 16 * T + (kQVecs + v) * kVecBytes);
        for (int p = 0; p < 4; ++p) {
          vstore_bytes(block + (p * kQVecs + v) * kVecBytes, q6_codes(ql, high0, 0, p, v));
          vstore_bytes(block + ((4 + p) * kQVecs + v) * kVecBytes, q6_codes(ql, high1, 1, p, v));
        }
      }
    }
  }
}

// R rows of the quantized activations (from row r0) against one tile of K-quant format F, its codes unpacked
// in registers; `ahead` as q_pass's.
template <int R, int64_t F, bool kAhead, typename Out>
SD_INLINE void k_pass(const QuantRows& a, int64_t r0, const uint8_t* w, const float* bias, Out* y, int64_t ldy,
                      int64_t n_out, int64_t n0, Ahead ahead) {
  constexpr int64_t kRecord = k_record_bytes(F), T = kQTile;
  constexpr int kVecBytes = kLanes * 4;
  const int64_t supers = a.blocks / kSuperBlocks;
  vf facc[R][kQVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kQVecs; ++v) facc[r][v] = vzero();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rec = w + s * kRecord;
    // d and dmin are read again where used (L1): held across the blocks they would spill the accumulators.
    const uint16_t* halfs = reinterpret_cast<const uint16_t*>(rec);  // the record's header
    for (int64_t j = 0; j < kSuperBlocks; ++j) {
      const int64_t b = s * kSuperBlocks + j;
      if (kAhead && ahead.due()) prefetch_share(ahead, kRecord, s, j);
      const int8_t* xb[R];
      for (int r = 0; r < R; ++r) xb[r] = a.q.data() + ((r0 + r) * a.blocks + b) * kQBlock;
      if constexpr (F == kQ4_K || F == kQ5_K) {
        constexpr int64_t kWidth = F == kQ4_K ? 18 : 22;  // q5_k: 4 T bytes of fifth bits after the nibbles
        const uint8_t* codes = rec + 4 * T + j * kWidth * T;
        vi acc[R][kQVecs];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kQVecs; ++v) acc[r][v] = vzero_i();
        nibble_sums<R>(codes, xb, acc, F == kQ5_K ? codes + 16 * T : nullptr);
        const uint8_t* sc = codes + (kWidth - 2) * T;
        vf step[kQVecs], low[kQVecs];  // d * sc_j and -(dmin * m_j): exact
        for (int v = 0; v < kQVecs; ++v) {
          step[v] = vmul(load_half(halfs + v * kLanes), vcvt_i(load_u8_lanes(sc + v * kLanes)));
          low[v] = vmul(load_half(halfs + T + v * kLanes), vcvt_i(vsub_i(vzero_i(), load_u8_lanes(sc + T + v * kLanes))));
        }
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * a.blocks + b;
          const vf dx = vset(a.d[at]), sx = vset(a.s[at]);
          for (int v = 0; v < kQVecs; ++v)
            facc[r][v] = vfma(low[v], sx, vfma(vcvt_i(acc[r][v]), vmul(step[v], dx), facc[r][v]));
        }
      } else {
        // One half of 16 inputs at a time (each has its own scale), so that the accumulators of more rows fit.
        const uint8_t* ql = q6_block(rec, j);
        const uint8_t* sc = ql + 24 * T;
        vf part[R][kQVecs];  // the block's sum over both halves: integers below 2^24, exact in fp32 in any order
#pragma GCC unroll 2  // unrolled, the sums stay in registers (a loop kept them on the stack)
        for (int h = 0; h < 2; ++h) {
          vi high[kQVecs], acc[R][kQVecs];
          for (int v = 0; v < kQVecs; ++v) high[v] = vload_i(ql + 16 * T + (h * kQVecs + v) * kVecBytes);
          for (int r = 0; r < R; ++r) {  // from -32 sum(x): the codes' offset 32 taken off in the sum
            const vi offset = vset_i(-32 * a.sx16[2 * ((r0 + r) * a.blocks + b) + h]);
            for (int v = 0; v < kQVecs; ++v) acc[r][v] = offset;
          }
          for (int p = 0; p < 4; ++p) {
            vi codes[kQVecs];
            for (int v = 0; v < kQVecs; ++v) codes[v] = q6_codes(ql, high[v], h, p, v);
            for (int r = 0; r < R; ++r) {
              const vi x = bcast4(xb[r] + 16 * h + 4 * p);
              for (int v = 0; v < kQVecs; ++v) acc[r][v] = dot_u4(acc[r][v], codes[v], x);
            }
          }
          for (int v = 0; v < kQVecs; ++v) {
            const vf scale = vcvt_i(load_i8_lanes(sc + h * T + v * kLanes));
            for (int r = 0; r < R; ++r)
              part[r][v] = h == 0 ? vmul(vcvt_i(acc[r][v]), scale) : vfma(vcvt_i(acc[r][v]), scale, part[r][v]);
          }
        }
        for (int v = 0; v < kQVecs; ++v) {
          const vf d = load_half(halfs + v * kLanes);
          for (int r = 0; r < R; ++r)
            facc[r][v] = vfma(part[r][v], vmul(d, vset(a.d[(r0 + r) * a.blocks + b])), facc[r][v]);
        }
      }
    }
  }
  store_tile<R>(facc, bias, y, ldy, n_out, n0);
}

// R rows against one q6_k tile whose codes q6_unpack laid out as whole bytes (`codes`); scales from `w`.
// The same integers and fp32 steps as k_pass: bitwise its answer.
template <int R, typename Out>
SD_INLINE void q6_unpacked_pass(const QuantRows& a, int64_t r0, const uint8_t* codes, const uint8_t* w,
                                const float* bias, Out* y, int64_t ldy, int64_t n_out, int64_t n0) {
  constexpr int64_t T = kQTile;
  constexpr int kVecBytes = kLanes * 4;
  vf facc[R][kQVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kQVecs; ++v) facc[r][v] = vzero();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = w + b / kSuperBlocks * k_record_bytes(kQ6_K);
    const int64_t j = b % kSuperBlocks;
    const int8_t* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = a.q.data() + ((r0 + r) * a.blocks + b) * kQBlock;
    vf part[R][kQVecs];  // the block's exact sum over both halves
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      vi acc[R][kQVecs];
      for (int r = 0; r < R; ++r) {  // from -32 sum(x): the codes' offset 32 taken off in the sum
        const vi offset = vset_i(-32 * a.sx16[2 * ((r0 + r) * a.blocks + b) + h]);
        for (int v = 0; v < kQVecs; ++v) acc[r][v] = offset;
      }
      for (int p = 0; p < 4; ++p) {
        vi wv[kQVecs];
        for (int v = 0; v < kQVecs; ++v) wv[v] = vload_i(codes + ((b * 8 + 4 * h + p) * kQVecs + v) * kVecBytes);
        for (int r = 0; r < R; ++r) {
          const vi x = bcast4(xb[r] + 16 * h + 4 * p);
          for (int v = 0; v < kQVecs; ++v) acc[r][v] = dot_u4(acc[r][v], wv[v], x);
        }
      }
      vf sc[kQVecs];
      for (int v = 0; v < kQVecs; ++v) sc[v] = vcvt_i(load_i8_lanes(q6_block(rec, j) + (24 + h) * T + v * kLanes));
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kQVecs; ++v)
          part[r][v] = h == 0 ? vmul(vcvt_i(acc[r][v]), sc[v]) : vfma(vcvt_i(acc[r][v]), sc[v], part[r][v]);
    }
    vf d[kQVecs];
    for (int v = 0; v < kQVecs; ++v) d[v] = load_half(reinterpret_cast<const uint16_t*>(rec) + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf dx = vset(a.d[(r0 + r) * a.blocks + b]);
      for (int v = 0; v < kQVecs; ++v) facc[r][v] = vfma(part[r][v], vmul(d[v], dx), facc[r][v]);
    }
  }
  store_tile<R>(facc, bias, y, ldy, n_out, n0);
}

// Every row against one K-quant tile, in passes of up to kQRows rows; y's rows are ldy apart and n_out wide. Past
// 32 rows, q6_k's codes are unpacked once per tile rather than in every pass.
template <int64_t F, typename Out>
SD_TILE void k_tile(const QuantRows& a, const uint8_t* w, int64_t stride, const float* bias, Out* y, int64_t ldy,
                    int64_t n_out, int64_t n0) {
  // Unpacking q6_k's codes to memory once pays past 32 rows (Zen 5, 6 projections of 17920 x 1536 against q4_k's
  // time: 48 / 64 / 128 rows 1.31 / 1.27 / 1.45x unpacking in registers, 1.25 / 1.12 / 1.12x from memory).
  if constexpr (F == kQ6_K) {
    if (a.rows > 32) {
      thread_local std::vector<uint8_t> scratch;
      scratch.resize(a.blocks * kQBlock * kQTile);
      q6_unpack(w, a.blocks / kSuperBlocks, scratch.data(), Ahead(w + stride, 0, 1, 1));  // all the next tile
      row_blocks<kQRows>(a.rows, [&](auto r, int64_t m) {
        q6_unpacked_pass<decltype(r)::value>(a, m, scratch.data(), w, bias, y + m * ldy, ldy, n_out, n0);
      });
      return;
    }
  }
  tile_passes<kQRows>(a.rows, w + stride, [&](auto r, int64_t m, auto prefetch, Ahead ahead) {
    k_pass<decltype(r)::value, F, decltype(prefetch)::value>(a, m, w, bias, y + m * ldy, ldy, n_out, n0, ahead);
  });
}

}  // namespace sd
