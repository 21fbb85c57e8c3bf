// The quantized projections behind one entry: a format code picks the kernel of its weights' block format
// (linear_quant.h: q8_0, q4_0, q4_1, q5_0, q5_1; linear_kquant.h: q4_k, q5_k, q6_k), the packed layout is checked
// against it, and the output tiles are split across threads. It does not compute anything itself.
#pragma once

#include <ATen/Parallel.h>

#include "linear_kquant.h"
#include "linear_quant.h"

namespace sd {

constexpr bool is_super(int64_t fmt) { return fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K; }
constexpr int64_t record_weights(int64_t fmt) { return is_super(fmt) ? kSuper : kQBlock; }  // inputs per record
constexpr int64_t record_bytes(int64_t fmt) { return is_super(fmt) ? k_record_bytes(fmt) : q_record_bytes(fmt); }

// Bytes of one packed tile over `blocks` blocks of 32 inputs.
inline int64_t tile_bytes(int64_t fmt, int64_t blocks) { return blocks * kQBlock / record_weights(fmt) * record_bytes(fmt); }

// Every row of a against tile t of weights w (tiles of `stride` bytes, back to back), on the calling thread;
// y's rows are ldy apart and n_out wide.
template <typename Out>
void block_tile(int64_t fmt, const QuantRows& a, const uint8_t* w, int64_t stride, int64_t t, const float* bias, Out* y,
                int64_t ldy, int64_t n_out) {
  const uint8_t* wt = w + t * stride;
  const int64_t n0 = t * kQTile;
  switch (fmt) {
    case kQ8_0: return q_tile<kQ8_0>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ4_0: return q_tile<kQ4_0>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ4_1: return q_tile<kQ4_1>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ5_0: return q_tile<kQ5_0>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ5_1: return q_tile<kQ5_1>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ4_K: return k_tile<kQ4_K>(a, wt, stride, bias, y, ldy, n_out, n0);
    case kQ5_K: return k_tile<kQ5_K>(a, wt, stride, bias, y, ldy, n_out, n0);
    default: return k_tile<kQ6_K>(a, wt, stride, bias, y, ldy, n_out, n0);
  }
}

// All tiles of a quantized projection, split across threads: y [a.rows, n_out].
template <typename Out>
void quant_rows(const QuantRows& a, const uint8_t* w, int64_t fmt, int64_t tiles, const float* bias, Out* y,
                int64_t n_out) {
  const int64_t stride = tile_bytes(fmt, a.blocks);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) block_tile(fmt, a, w, stride, t, bias, y, n_out, n_out);
  });
}

inline void check_packed_quant(const torch::Tensor& packed, int64_t fmt, int64_t n_out, int64_t k) {
  TORCH_CHECK(fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1 || has_fifth_bits(fmt) || is_super(fmt),
              "unknown weight format code ", fmt);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
              packed.size(2) == record_bytes(fmt),
              "packed quantized weight has the wrong layout (record ", packed.size(2), " bytes, this build's is ",
              record_bytes(fmt), ")");
  const int64_t span = packed.size(1) * record_weights(fmt);
  if (is_super(fmt)) {  // K-quants come whole: super-blocks of 256 inputs, no padding
    TORCH_CHECK(span == k, "x has ", k, " features, the weight ", span, " (K-quant weights need a multiple of 256)");
  } else {
    TORCH_CHECK(span >= k && span - k < kQBlock, "x has ", k, " features, the weight ", span);
  }
  TORCH_CHECK(packed.size(0) * kQTile >= n_out, "the packed weight has fewer than ", n_out, " outputs");
}

}  // namespace sd

inline int64_t quant_tile_outputs() { return sd::kQTile; }
inline int64_t quant_record_bytes(int64_t fmt) { return sd::record_bytes(fmt); }

// x: [..., K] bf16 or fp32; packed: [ceil(N/T), K / (32 or 256), record] uint8; bias: [N] fp32 or None.
// Returns [..., N] in x's dtype.
inline torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t fmt, int64_t n_out,
                                  const c10::optional<torch::Tensor>& bias) {
  using namespace sd;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quant_linear needs bf16 or fp32 x");
  const int64_t k = x.size(-1);
  check_packed_quant(packed, fmt, n_out, k);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out),
              "bias must be a contiguous fp32 vector of ", n_out);
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto xf = x.reshape({-1, k}).to(at::kFloat).contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = torch::empty(out_shape, x.options());
  if (xf.size(0) == 0) return y;
  QuantRows a;
  quantize_rows(xf.data_ptr<float>(), k, xf.size(0), k, a);
  if (x.scalar_type() == at::kFloat) quant_rows(a, packed.data_ptr<uint8_t>(), fmt, packed.size(0), bp, y.data_ptr<float>(), n_out);
  else quant_rows(a, packed.data_ptr<uint8_t>(), fmt, packed.size(0), bp, bf16_ptr_mut(y), n_out);
  return y;
}
