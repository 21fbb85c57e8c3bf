// y = x W^T (+ b) in bf16 with fp32 accumulation, for the 1-20 rows of a decode or verification step.
//
// W is packed once (models/native.py) as [N/64, K/2, 64, 2]: for each tile of 64 outputs, consecutive
// pairs of input features, so a tile streams from memory as one sequential run. Each step of the inner
// loop loads 4 vectors of W (64 outputs x 2 features) and, for each of up to 6 rows of x, broadcasts that
// row's 2 features and accumulates with vdpbf16ps (AVX512-BF16). Output (m, n) is one fp32 lane summed
// over k in order 0,1 | 2,3 | ...; nothing about that sum depends on how many rows share the call, so
// every row's result is bitwise the same whether it runs alone or in a batch (what exact verification
// needs). Rows beyond 6 take further passes over the tile, which is then in L2.
//
// It does not handle other dtypes, non-x86 CPUs or autograd; models/native.py builds it, models/transformer.py decides when to use it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kTile = 64;   // outputs per tile: 4 vectors of 16 fp32 lanes
constexpr int kMaxRows = 6;     // rows per pass: 6 x 4 accumulators + 4 weight vectors fit 32 registers

template <int C>
void tile_pass(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t pairs,
               const at::BFloat16* bias, at::BFloat16* y, int64_t n_out, int64_t n0) {
  __m512 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < 4; ++r) acc[c][r] = _mm512_setzero_ps();
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);  // one int32 = two bf16 features
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const at::BFloat16* p = w + kp * 2 * kTile;
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
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < 4; ++r) {
      const int64_t n = n0 + r * 16;
      if (n >= n_out) break;
      __m512 s = acc[c][r];
      const int64_t valid = std::min<int64_t>(16, n_out - n);
      const __mmask16 mask = (__mmask16)((1u << valid) - 1);
      if (bias) {  // bias is added in fp32 before the single rounding to bf16
        const __m256i b16 = _mm256_maskz_loadu_epi16(mask, bias + n);
        s = _mm512_add_ps(s, _mm512_cvtpbh_ps((__m256bh)b16));
      }
      _mm256_mask_storeu_epi16(y + c * n_out + n, mask, (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

void tile_rows(const at::BFloat16* x, int64_t ldx, int64_t rows, const at::BFloat16* w, int64_t pairs,
               const at::BFloat16* bias, at::BFloat16* y, int64_t n_out, int64_t n0) {
  int64_t m = 0;
  for (; m + kMaxRows <= rows; m += kMaxRows)
    tile_pass<kMaxRows>(x + m * ldx, ldx, w, pairs, bias, y + m * n_out, n_out, n0);
  const at::BFloat16* xm = x + m * ldx;
  at::BFloat16* ym = y + m * n_out;
  switch (rows - m) {
    case 5: tile_pass<5>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 4: tile_pass<4>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 3: tile_pass<3>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 2: tile_pass<2>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    case 1: tile_pass<1>(xm, ldx, w, pairs, bias, ym, n_out, n0); break;
    default: break;
  }
}

}  // namespace

// x: [..., K] bf16; packed: [ceil(N/64), ceil(K/2), 64, 2] bf16; bias: [N] bf16 or None. Returns [..., N].
torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "tiled_linear needs bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2, "packed weight has the wrong layout");
  const int64_t k = x.size(-1), pairs = packed.size(1), k_padded = 2 * pairs;
  TORCH_CHECK(k <= k_padded && k_padded - k < 2, "x has ", k, " features, the weight ", k_padded);
  TORCH_CHECK(packed.size(0) * kTile >= n_out, "the packed weight has fewer than ", n_out, " outputs");
  auto flat = x.reshape({-1, k});
  auto xs = k_padded == k ? flat.contiguous() : torch::constant_pad_nd(flat, {0, k_padded - k});
  const int64_t rows = xs.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = torch::empty(out_shape, x.options());
  const at::BFloat16* xp = xs.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile_rows(xp, k_padded, rows, wp + t * pairs * 2 * kTile, pairs, bp, yp, n_out, t * kTile);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tiled_linear", &tiled_linear); }
