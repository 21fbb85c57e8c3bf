// One decoder layer in one call: RMSNorm, the q/k/v projection, RoPE, attention over the sequence's cached
// keys, the output projection and residual, RMSNorm, gate/up, SiLU (Gemma: tanh-GELU), down and residual
// (Gemma: each output RMSNormed before its residual add), with no torch op in between (a decode step of a
// small model otherwise spends as long dispatching ~25 small ops per layer as it does in its projections).
// The residual stream and every intermediate stay in fp32; keys and values are rounded to bf16 for the
// cache, and projections of bf16 weights read bf16-rounded inputs.
//
// Rows are independent: every row's numbers come from its own inputs and its own keys in a fixed order, so
// the layer is row-invariant like the kernels it calls. Two forms give the same bits: `layer_rows` writes new
// keys/values straight into a plain cache's buffers; `layer_qkv` + `layer_attend` + `layer_finish` leave the
// cache write to Python (compressing caches, recorders).
//
// It does not compress, evict or check cache room (Python does), or compute anything off the CPU.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <pybind11/stl.h>

#include <vector>

#include "attention.h"
#include "linear_bf16.h"
#include "linear_blocks.h"

namespace sd {

constexpr int64_t kBF16 = 3;  // a projection's format code beside the block formats' (linear_quant.h)
constexpr int64_t kParts = -1;  // the format code of a projection made of parts in formats of their own

// One projection: its packed weight (this build's bf16 layout, or a quantized one), shapes and fp32 bias.
struct Proj {
  torch::Tensor packed;
  int64_t fmt, n_out, k_in;
  torch::Tensor bias;  // fp32 [n_out], or undefined
  std::vector<Proj> parts;  // where fmt is kParts: its outputs in order, each part in a block format of its own

  Proj(torch::Tensor packed_, int64_t fmt_, int64_t n_out_, int64_t k_in_, c10::optional<torch::Tensor> bias_)
      : packed(std::move(packed_)), fmt(fmt_), n_out(n_out_), k_in(k_in_) {
    if (fmt == kBF16) {
#ifdef SPECDECODE_TILED
      check_packed_bf16(packed, kTiledTile, n_out, k_in);
#else
      check_packed_bf16(packed, kTile, n_out, k_in);
#endif
    } else {
      check_packed_quant(packed, fmt, n_out, k_in);
    }
    if (bias_.has_value()) {
      TORCH_CHECK(bias_->scalar_type() == at::kFloat && bias_->is_contiguous() && bias_->numel() == n_out,
                  "bias must be a contiguous fp32 vector of ", n_out);
      bias = *bias_;
    }
  }

  // One projection over parts that read the same inputs, each in its block format as a GGUF stores it (q and k
  // in Q4_K beside v in Q6_K): its outputs are theirs in order, each computed as the part alone computes it.
  explicit Proj(std::vector<Proj> parts_) : fmt(kParts), n_out(0), k_in(parts_.at(0).k_in), parts(std::move(parts_)) {
    for (const Proj& p : parts) {
      TORCH_CHECK(p.fmt != kBF16 && p.fmt != kParts && p.k_in == k_in,
                  "a projection's parts must be block formats over the same ", k_in, " inputs");
      n_out += p.n_out;
    }
  }
};

// A projection's inputs, prepared once per set of rows: int8 blocks (block formats) or bf16-rounded values
// (bf16 weights: bf16 halves for the tiled kernel, their fp32 values for the widened one).
struct Prepared {
  QuantRows quant;
  std::vector<float> rounded;
  std::vector<uint16_t> halves;
  int64_t rows = 0;
};

// Sizes `in` for `rows` rows of p's inputs (prepare_range fills it).
inline void shape_prepared(const Proj& p, int64_t rows, Prepared& in) {
  in.rows = rows;
  if (p.fmt != kBF16) return shape_quant(rows, p.k_in, in.quant);
  const int64_t k2 = 2 * p.packed.size(1);
#ifdef SPECDECODE_TILED
  in.halves.assign(rows * k2, 0);
#else
  in.rounded.assign(rows * k2, 0.0f);
#endif
}

// Rows r0..r1 of `in` (shaped) from x (row r0 at x, row stride ldx).
inline void prepare_range(const Proj& p, const float* x, int64_t ldx, int64_t r0, int64_t r1, Prepared& in) {
  if (p.fmt != kBF16) return quantize_range(x, ldx, r0, r1, p.k_in, in.quant);
  const int64_t k2 = 2 * p.packed.size(1);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < p.k_in; ++i) {
      const float v = x[(r - r0) * ldx + i];
#ifdef SPECDECODE_TILED
      in.halves[r * k2 + i] = float_to_bf16(v);
#else
      in.rounded[r * k2 + i] = bf16_to_float(float_to_bf16(v));
#endif
    }
}

inline void prepare(const Proj& p, const float* x, int64_t ldx, int64_t rows, Prepared& in) {
  shape_prepared(p, rows, in);
  prepare_range(p, x, ldx, 0, rows, in);
}

inline int64_t tiles_of(const Proj& p) {
  if (p.fmt != kParts) return p.packed.size(0);
  int64_t tiles = 0;
  for (const Proj& part : p.parts) tiles += tiles_of(part);
  return tiles;
}

// Output tiles t0..t1 of y [rows, n_out] fp32 (rows ldy apart) = prepared x W^T + b, on the calling thread; a
// projection of parts numbers its tiles part after part.
inline void project_tiles(const Proj& p, const Prepared& in, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  if (p.fmt == kParts) {
    int64_t first_tile = 0, first_out = 0;
    for (const Proj& part : p.parts) {
      const int64_t n = tiles_of(part), a = std::max(t0, first_tile), b = std::min(t1, first_tile + n);
      if (a < b) project_tiles(part, in, y + first_out, ldy, a - first_tile, b - first_tile);
      first_tile += n;
      first_out += part.n_out;
    }
    return;
  }
  const float* bias = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  if (p.fmt != kBF16) {
    const uint8_t* w = p.packed.data_ptr<uint8_t>();
    const int64_t stride = tile_bytes(p.fmt, in.quant.blocks);
    for (int64_t t = t0; t < t1; ++t) block_tile(p.fmt, in.quant, w, stride, t, bias, y, ldy, p.n_out);
    return;
  }
  const int64_t pairs = p.packed.size(1), k2 = 2 * pairs;
  const uint16_t* w = bf16_ptr(p.packed);
#ifdef SPECDECODE_TILED
  for (int64_t t = t0; t < t1; ++t)
    tiled_tile(in.halves.data(), k2, in.rows, w + t * pairs * 2 * kTiledTile, pairs, nullptr, y, ldy, p.n_out,
               t * kTiledTile);
  const int64_t tile = kTiledTile;
#else
  for (int64_t t = t0; t < t1; ++t)
    widened_tile(in.rounded.data(), k2, in.rows, w + t * pairs * 2 * kTile, pairs, nullptr, y, ldy, p.n_out, t * kTile);
  const int64_t tile = kTile;
#endif
  if (bias) {  // fp32 adds, as the kernels add a bias before rounding
    const int64_t n0 = t0 * tile, n1 = std::min(p.n_out, t1 * tile);
    for (int64_t r = 0; r < in.rows; ++r)
      for (int64_t n = n0; n < n1; ++n) y[r * ldy + n] += bias[n];
  }
}

// y [rows, n_out] fp32 = x [rows, k_in] fp32 (row stride ldx) W^T + b, tiles split across threads.
inline void project(const Proj& p, const float* x, int64_t ldx, int64_t rows, float* y) {
  Prepared in;
  prepare(p, x, ldx, rows, in);
  at::parallel_for(0, tiles_of(p), 1, [&](int64_t t0, int64_t t1) { project_tiles(p, in, y, p.n_out, t0, t1); });
}

// The share [a, b) of n work items that thread tid of nt takes.
inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

// The share [a, b) of p's tiles that thread tid of nt takes: equal counts, or for a projection of parts equal
// bytes (a Q6_K tile streams 1.4x a Q4_K tile's bytes and takes about as much longer).
inline void share_tiles(const Proj& p, int tid, int nt, int64_t& a, int64_t& b) {
  if (p.fmt != kParts) return share(tiles_of(p), tid, nt, a, b);
  const auto tile_bytes_of = [](const Proj& part) { return part.packed.size(1) * part.packed.size(2); };
  int64_t total = 0;
  for (const Proj& part : p.parts) total += tiles_of(part) * tile_bytes_of(part);
  const auto boundary = [&](int64_t k) {  // the first tile that starts at or past byte total * k / nt
    const int64_t target = total * k / nt;
    int64_t tile = 0, bytes = 0;
    for (const Proj& part : p.parts) {
      const int64_t n = tiles_of(part), per = tile_bytes_of(part);
      if (bytes + n * per >= target) return tile + (target - bytes + per - 1) / per;
      tile += n;
      bytes += n * per;
    }
    return tile;
  };
  a = boundary(tid);
  b = boundary(tid + 1);
}

// out[i] = x[i] / rms(x) * w[i] over one row of h features.
inline void rms_norm_row(const float* x, const float* w, int64_t h, float eps, float* out) {
  const int64_t h_vec = h / kLanes * kLanes;
  vf acc = vzero();
  for (int64_t i = 0; i < h_vec; i += kLanes) acc = vfma(vload(x + i), vload(x + i), acc);
  float ss = hsum(acc);
  for (int64_t i = h_vec; i < h; ++i) ss = std::fma(x[i], x[i], ss);
  const float r = 1.0f / std::sqrt(ss / float(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = (x[i] * r) * w[i];
}

// act(g) * u per element, act computed a vector at a time (the tail through the same vector code, zero-padded).
template <typename Act>
inline void gated(const float* g, const float* u, int64_t n, float* out, Act act) {
  const int64_t n_vec = n / kLanes * kLanes;
  for (int64_t i = 0; i < n_vec; i += kLanes) vstore(out + i, vmul(act(vload(g + i)), vload(u + i)));
  if (n_vec < n) {
    alignas(64) float gl[kLanes] = {}, ul[kLanes] = {};
    std::memcpy(gl, g + n_vec, sizeof(float) * (n - n_vec));
    std::memcpy(ul, u + n_vec, sizeof(float) * (n - n_vec));
    alignas(64) float ol[kLanes];
    vstore(ol, vmul(act(vload(gl)), vload(ul)));
    std::memcpy(out + n_vec, ol, sizeof(float) * (n - n_vec));
  }
}

// silu(g) * u per element: g * sigmoid(g) with e^-|g| from vexp (its domain is x <= 0).
inline void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  gated(g, u, n, out, [](vf x) {
    const vf one = vset(1.0f), e = vexp(vsub(vzero(), vabs(x)));
    return vmul(x, select_ge0(x, vdiv(one, vadd(one, e)), vdiv(e, vadd(one, e))));
  });
}

// tanh-GELU(g) * u per element (Gemma's GeGLU): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), the tanh
// from vexp's e^-2|y|.
inline void gelu_mul(const float* g, const float* u, int64_t n, float* out) {
  gated(g, u, n, out, [](vf x) {
    const vf one = vset(1.0f), c = vset(0.7978845608028654f), cube = vset(0.044715f);
    const vf y = vmul(c, vfma(vmul(cube, vmul(x, x)), x, x));  // c (x + 0.044715 x^3)
    const vf e = vexp(vsub(vzero(), vadd(vabs(y), vabs(y))));
    const vf t = vdiv(vsub(one, e), vadd(one, e));  // tanh |y|
    return vmul(vmul(vset(0.5f), x), vadd(one, select_ge0(y, t, vsub(vzero(), t))));
  });
}

constexpr int64_t kSiLU = 0, kGeluTanh = 1;  // the MLP's activation (config.Activation)

inline std::vector<float> float_vector(const torch::Tensor& t, int64_t n, const char* what) {
  auto f = t.to(at::kFloat).contiguous();
  TORCH_CHECK(f.numel() == n, what, " must have ", n, " weights");
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + n);
}

struct Layer {
  Proj qkv, o, gate_up, down;
  std::vector<float> ln1, ln2;
  std::vector<float> q_norm, k_norm;  // per-head RMSNorm weights [D] before RoPE (Qwen3, Gemma); empty elsewhere
  std::vector<float> post_attn, post_mlp;  // Gemma's norms of attention's and the MLP's outputs; empty elsewhere
  float eps, scale;  // scale: what attention scores are multiplied by
  int64_t heads, kv_heads, head_dim, hidden, inter;
  int64_t window, activation;  // window: keys a row sees (0: all of them)

  Layer(Proj qkv_, Proj o_, Proj gate_up_, Proj down_, const torch::Tensor& ln1_, const torch::Tensor& ln2_, double eps_,
        int64_t heads_, int64_t kv_heads_, int64_t head_dim_, c10::optional<torch::Tensor> q_norm_,
        c10::optional<torch::Tensor> k_norm_, int64_t window_, double scale_, int64_t activation_,
        c10::optional<torch::Tensor> post_attn_, c10::optional<torch::Tensor> post_mlp_)
      : qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)), down(std::move(down_)), eps(float(eps_)),
        scale(float(scale_)), heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), window(window_),
        activation(activation_) {
    hidden = ln1_.numel();
    inter = down.k_in;
    ln1 = float_vector(ln1_, hidden, "ln1");
    ln2 = float_vector(ln2_, hidden, "ln2");
    TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "q_norm and k_norm come together");
    if (q_norm_.has_value()) {
      q_norm = float_vector(*q_norm_, head_dim_, "q_norm");
      k_norm = float_vector(*k_norm_, head_dim_, "k_norm");
    }
    TORCH_CHECK(post_attn_.has_value() == post_mlp_.has_value(), "post_attn and post_mlp norms come together");
    if (post_attn_.has_value()) {
      post_attn = float_vector(*post_attn_, hidden, "post_attn");
      post_mlp = float_vector(*post_mlp_, hidden, "post_mlp");
    }
    TORCH_CHECK(activation == kSiLU || activation == kGeluTanh, "activation must be 0 (SiLU) or 1 (tanh-GELU)");
    TORCH_CHECK(window >= 0, "window must be >= 0");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
    TORCH_CHECK(qkv.k_in == hidden && qkv.n_out == (heads + 2 * kv_heads) * head_dim && o.k_in == heads * head_dim &&
                o.n_out == hidden && gate_up.k_in == hidden && gate_up.n_out == 2 * inter && down.n_out == hidden,
                "the layer's projections do not fit together");
  }
};

// RoPE and routing of the projected rows proj [N, (H + 2 Hkv) * D] for the (row, head) units u0..u1: queries
// to q fp32 [N, H, D], keys and values (bf16) to where kv_at(is_key, key head, row) says (D values there).
template <typename KVAt>
inline void rope_units(const Layer& L, float* proj, int64_t n, const float* cos, const float* sin, const int64_t* pos,
                       float* q, const KVAt& kv_at, int64_t u0, int64_t u1) {
  const int64_t d = L.head_dim, half = d / 2, heads = L.heads + 2 * L.kv_heads, width = heads * d;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t r = u / heads, head = u % heads;
    const float* c = cos + pos[r] * half;
    const float* s = sin + pos[r] * half;
    float* src = proj + r * width + head * d;
    if (!L.q_norm.empty() && head < L.heads + L.kv_heads)  // Qwen3, Gemma: the head's RMSNorm, in place, before RoPE
      rms_norm_row(src, (head < L.heads ? L.q_norm : L.k_norm).data(), d, L.eps, src);
    if (head < L.heads + L.kv_heads) {  // rotate-half RoPE on queries and keys
      for (int64_t i = 0; i < half; ++i) {
        const float a = src[i], b = src[i + half];
        src[i] = a * c[i] - b * s[i];
        src[i + half] = b * c[i] + a * s[i];
      }
    }
    if (head < L.heads) {
      std::memcpy(q + (r * L.heads + head) * d, src, sizeof(float) * d);
    } else {
      const bool is_key = head < L.heads + L.kv_heads;
      const int64_t kh = is_key ? head - L.heads : head - L.heads - L.kv_heads;
      uint16_t* dst = kv_at(is_key, kh, r);
      for (int64_t i = 0; i < d; ++i) dst[i] = float_to_bf16(src[i]);
    }
  }
}

// One sequence's keys as attention reads them: [Hkv, L, D] with strides, the rows' first position, a window,
// and for a token tree each row's key index.
struct KeyView {
  const uint16_t* keys;
  const uint16_t* values;
  int64_t head_stride_k, head_stride_v, row_stride_k, row_stride_v;
  int64_t first, window;
  const int64_t* index = nullptr;
  const int64_t* counts = nullptr;
  int64_t width = 0;
};

// One piece of a forward's attention: query heads head..head + heads - 1 (which share a key head) of rows
// row..row + rows - 1 of sequence `seq`; `cost` (about the keys read times the heads) shares the pieces out among
// threads.
struct AttendUnit {
  int64_t seq, row, rows, head, heads, cost;
};

// A layer's attention over sequences of counts[j] new rows after starts[j] cached tokens, in pieces: per key head
// and run of up to kRowsTogether rows (a token tree's rows one by one: each has its own keys), the group's query
// heads in chunks of what attend together (``attend_rows``), smaller where the threads would get fewer than two
// pieces each (a one-row step of 3 key heads on 2 threads: chunks of 2 and 1). The same for every layer of a
// forward; which thread runs a piece changes no result.
struct AttendPlan {
  std::vector<AttendUnit> units;
  std::vector<int64_t> before;  // cost of the units before each, and the total last

  AttendPlan(const Layer& L, const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
             const std::vector<bool>& tree, int nt) {
    const int64_t group = L.heads / L.kv_heads;
    int64_t runs = 0;
    for (size_t j = 0; j < counts.size(); ++j) runs += tree[j] ? counts[j] : (counts[j] + kRowsTogether - 1) / kRowsTogether;
    int64_t chunk = std::min<int64_t>(group, heads_together(L.head_dim));
    while (chunk > 1 && runs * L.kv_heads * ((group + chunk - 1) / chunk) < 2 * nt) --chunk;
    before.push_back(0);
    for (size_t j = 0; j < counts.size(); ++j) {
      const int64_t run = tree[j] ? 1 : kRowsTogether;
      for (int64_t i = 0; i < counts[j]; i += run) {
        const int64_t rows = std::min(run, counts[j] - i);
        int64_t keys = 0;
        for (int64_t r = i; r < i + rows; ++r) {
          const int64_t end = starts[j] + r + 1;
          keys += L.window > 0 ? std::min(end, L.window) : end;
        }
        for (int64_t kh = 0; kh < L.kv_heads; ++kh)
          for (int64_t h = 0; h < group; h += chunk) {
            const int64_t heads = std::min(chunk, group - h);
            units.push_back({int64_t(j), i, rows, kh * group + h, heads, (keys + 16 * rows) * heads});
            before.push_back(before.back() + units.back().cost);
          }
      }
    }
  }

  // The units [a, b) thread tid of nt runs: shares of the cost as equal as whole units make them.
  void share(int tid, int nt, int64_t& a, int64_t& b) const {
    const auto at = [&](int k) {  // the unit boundary nearest to k / nt of the cost
      const int64_t target = before.back() * k / nt;
      int64_t u = std::lower_bound(before.begin(), before.end(), target) - before.begin();
      if (u > 0 && target - before[u - 1] < before[u] - target) --u;
      return u;
    };
    a = tid == 0 ? 0 : at(tid);
    b = tid + 1 == nt ? int64_t(units.size()) : at(tid + 1);
  }
};

// Attention unit u of a sequence whose rows start at row0 into out fp32 [N, H * D].
inline void attend_unit(const Layer& L, const float* q, int64_t row0, const KeyView& kv, const AttendUnit& u,
                        float* out, AttendScratch& s) {
  const int64_t d = L.head_dim, kh = u.head / (L.heads / L.kv_heads), row = row0 + u.row, stride = L.heads * d;
  const uint16_t* kp = kv.keys + kh * kv.head_stride_k;
  const uint16_t* vp = kv.values + kh * kv.head_stride_v;
  const float* qr = q + row * stride + u.head * d;
  float* dst = out + row * stride + u.head * d;
  if (kv.index) {  // one row of a tree
    attend_rows(qr, stride, kp, vp, kv.row_stride_k, kv.row_stride_v, kv.counts[u.row], 0, kv.index + u.row * kv.width,
                1, d, int(u.heads), L.scale, dst, stride, s);
  } else {
    attend_rows(qr, stride, kp, vp, kv.row_stride_k, kv.row_stride_v, kv.first + u.row + 1, kv.window, nullptr, u.rows,
                d, int(u.heads), L.scale, dst, stride, s);
  }
}

// Per-thread buffers of the layer: its own copies of what every thread computes alike (norms, activations,
// prepared inputs), so that threads meet only where one needs another's output.
struct ThreadBuffers {
  std::vector<float> normed, mid, act;
  Prepared in;
};

// From this many rows the threads split the per-row work of a layer (norms, activations, a projection's
// inputs prepared) and meet at barriers, rather than each doing all rows for itself (prefill of 512 rows on 2
// threads: that work was a tenth of the time, done twice). What they share then:
constexpr int64_t kShareRows = 32;
struct SharedRows {
  Prepared in;  // a projection's inputs
  std::vector<float> mid;  // the residual stream after attention [N, hidden]
};

// p's prepared inputs for n rows (ldx apart) that rows(a, b) computes (returning row a; rows a..b): by this
// thread alone for itself, or with `shared` each thread its share of the rows, for all.
template <typename Rows>
inline const Prepared& prepare_rows(const Proj& p, int64_t n, int64_t ldx, Rows&& rows, ThreadBuffers& tb,
                                    SharedRows* shared, int tid, int nt) {
  if (!shared) {
    prepare(p, rows(0, n), ldx, n, tb.in);
    return tb.in;
  }
  int64_t a, b;
  share(n, tid, nt, a, b);
  if (tid == 0) shape_prepared(p, n, shared->in);  // nobody reads it now: a barrier follows each projection
  const float* x = rows(a, b);
#pragma omp barrier
  prepare_range(p, x, ldx, a, b, shared->in);
#pragma omp barrier
  return shared->in;
}

// The first half of the layer for n rows: queries and new keys/values (see rope_units).
template <typename KVAt>
inline void qkv_part(const Layer& L, const float* x, int64_t n, const float* cos, const float* sin, const int64_t* pos,
                     float* proj, float* q, const KVAt& kv_at, ThreadBuffers& tb, SharedRows* shared, int tid, int nt) {
  const int64_t h = L.hidden;
  const Prepared& in = prepare_rows(L.qkv, n, h, [&](int64_t a, int64_t b) {
    tb.normed.resize((b - a) * h);
    for (int64_t r = a; r < b; ++r) rms_norm_row(x + r * h, L.ln1.data(), h, L.eps, tb.normed.data() + (r - a) * h);
    return tb.normed.data();
  }, tb, shared, tid, nt);
  int64_t a, b;
  share_tiles(L.qkv, tid, nt, a, b);
  project_tiles(L.qkv, in, proj, L.qkv.n_out, a, b);
#pragma omp barrier
  share(n * (L.heads + 2 * L.kv_heads), tid, nt, a, b);
  rope_units(L, proj, n, cos, sin, pos, q, kv_at, a, b);
}

// The second half: x [N, hidden] -> out = x + o(attn), then + down(silu(gate) * up) of its norm (Gemma: o(attn)
// and down(...) each RMSNormed first).
inline void finish_part(const Layer& L, const float* x, const float* attn, int64_t n, float* o_out, float* gu_out,
                        float* down_out, float* out, ThreadBuffers& tb, SharedRows* shared, int tid, int nt) {
  const int64_t h = L.hidden, inter = L.inter, width = L.heads * L.head_dim;
  int64_t a, b;
  const Prepared& o_in = prepare_rows(L.o, n, width, [&](int64_t r0, int64_t) { return attn + r0 * width; }, tb,
                                      shared, tid, nt);
  share_tiles(L.o, tid, nt, a, b);
  project_tiles(L.o, o_in, o_out, L.o.n_out, a, b);
#pragma omp barrier
  if (!shared) tb.mid.resize(n * h);
  float* mid = shared ? shared->mid.data() : tb.mid.data();  // rows a thread computes; all read after barriers
  const Prepared& gu_in = prepare_rows(L.gate_up, n, h, [&](int64_t r0, int64_t r1) {
    tb.normed.resize((r1 - r0) * h);
    for (int64_t r = r0; r < r1; ++r) {
      float* row = mid + r * h;
      float* normed = tb.normed.data() + (r - r0) * h;
      if (!L.post_attn.empty()) {  // Gemma: the attention output normed before its residual add
        rms_norm_row(o_out + r * h, L.post_attn.data(), h, L.eps, normed);
        for (int64_t i = 0; i < h; ++i) row[i] = x[r * h + i] + normed[i];
      } else {
        for (int64_t i = 0; i < h; ++i) row[i] = x[r * h + i] + o_out[r * h + i];
      }
      rms_norm_row(row, L.ln2.data(), h, L.eps, normed);
    }
    return tb.normed.data();
  }, tb, shared, tid, nt);
  share_tiles(L.gate_up, tid, nt, a, b);
  project_tiles(L.gate_up, gu_in, gu_out, L.gate_up.n_out, a, b);
#pragma omp barrier
  const Prepared& down_in = prepare_rows(L.down, n, inter, [&](int64_t r0, int64_t r1) {
    tb.act.resize((r1 - r0) * inter);
    for (int64_t r = r0; r < r1; ++r)
      (L.activation == kGeluTanh ? gelu_mul : silu_mul)(gu_out + r * 2 * inter, gu_out + r * 2 * inter + inter, inter,
                                                        tb.act.data() + (r - r0) * inter);
    return tb.act.data();
  }, tb, shared, tid, nt);
  share_tiles(L.down, tid, nt, a, b);
  project_tiles(L.down, down_in, down_out, L.down.n_out, a, b);
#pragma omp barrier
  if (!L.post_mlp.empty()) {  // whole rows per thread: a norm needs its row
    share(n, tid, nt, a, b);
    tb.normed.resize(h);
    for (int64_t r = a; r < b; ++r) {
      rms_norm_row(down_out + r * h, L.post_mlp.data(), h, L.eps, tb.normed.data());
      for (int64_t i = 0; i < h; ++i) out[r * h + i] = mid[r * h + i] + tb.normed[i];
    }
    return;
  }
  share(n * h, tid, nt, a, b);
  for (int64_t i = a; i < b; ++i) out[i] = mid[i] + down_out[i];
}

// Runs body(tid, nt) on torch's intra-op threads (one parallel region; body may use omp barriers). Inside a
// parallel region it runs in a team of its own thread, so that its barriers never wait on the outer team.
template <typename F>
inline void on_threads(F&& body) {
  const int nt = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  body(omp_get_thread_num(), omp_get_num_threads());
}

inline void check_rows(const Layer& L, const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == L.hidden && x.is_contiguous(),
              "x must be contiguous fp32 [N, ", L.hidden, "]");
}

inline void check_rope(const Layer& L, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                       int64_t n) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == L.head_dim / 2 && sin.sizes() == cos.sizes(),
              "RoPE tables must be contiguous fp32 [P, head_dim / 2]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == n && pos.is_contiguous(),
              "positions must be int64 [N]");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "position ", p[r], " is beyond the RoPE table");
}

}  // namespace sd

using sd::Layer;
using sd::Proj;

// The generic form, step 1: (q fp32 [N, H, D], k bf16 [1, Hkv, N, D], v bf16 [1, Hkv, N, D]).
inline std::vector<torch::Tensor> layer_qkv(const Layer& L, const torch::Tensor& x, const torch::Tensor& cos,
                                            const torch::Tensor& sin, const torch::Tensor& pos) {
  sd::check_rows(L, x);
  const int64_t n = x.size(0);
  sd::check_rope(L, cos, sin, pos, n);
  auto q = torch::empty({n, L.heads, L.head_dim}, x.options());
  auto bf = x.options().dtype(at::kBFloat16);
  auto k = torch::empty({1, L.kv_heads, n, L.head_dim}, bf), v = torch::empty({1, L.kv_heads, n, L.head_dim}, bf);
  std::vector<float> proj(n * L.qkv.n_out);
  sd::on_threads([&](int tid, int nt) {
    sd::ThreadBuffers tb;
    uint16_t *keys = sd::bf16_ptr_mut(k), *values = sd::bf16_ptr_mut(v);
    const auto kv_at = [&](bool is_key, int64_t kh, int64_t r) {
      return (is_key ? keys : values) + (kh * n + r) * L.head_dim;
    };
    sd::qkv_part(L, x.data_ptr<float>(), n, cos.data_ptr<float>(), sin.data_ptr<float>(), pos.data_ptr<int64_t>(),
                 proj.data(), q.data_ptr<float>(), kv_at, tb, nullptr, tid, nt);
  });
  return {q, k, v};
}

// Step 2, per sequence: rows row0..row0+n-1 of q over keys/values [1, Hkv, L, D] as a cache's update returns
// them (the new rows last), into out fp32 [N, H * D]; with index/counts, a token tree's rows.
inline void layer_attend(const Layer& L, const torch::Tensor& q, int64_t row0, int64_t n, const torch::Tensor& keys,
                         const torch::Tensor& values, const c10::optional<torch::Tensor>& index,
                         const c10::optional<torch::Tensor>& counts, torch::Tensor out) {
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16 && keys.dim() == 4 &&
              keys.size(0) == 1 && keys.size(1) == L.kv_heads && keys.size(3) == L.head_dim && keys.stride(3) == 1 &&
              values.sizes() == keys.sizes() && values.stride(3) == 1, "layer_attend: keys/values bf16 [1, Hkv, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3 && row0 >= 0 && row0 + n <= q.size(0) &&
              out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == q.size(0) &&
              out.size(1) == L.heads * L.head_dim, "layer_attend: q fp32 [N, H, D], out fp32 [N, H * D]");
  const int64_t length = keys.size(2);
  TORCH_CHECK(n <= length, "layer_attend: more rows than keys");
  sd::KeyView kv{sd::bf16_ptr(keys), sd::bf16_ptr(values), keys.stride(1), values.stride(1), keys.stride(2),
                 values.stride(2), length - n, L.window};
  if (index.has_value()) {
    TORCH_CHECK(counts.has_value(), "layer_attend: an index needs counts");
    check_key_index(*index, *counts, n, length);
    kv.index = index->data_ptr<int64_t>();
    kv.counts = counts->data_ptr<int64_t>();
    kv.width = index->size(1);
  }
  const sd::AttendPlan plan(L, {kv.first}, {n}, {kv.index != nullptr}, at::get_num_threads());
  at::parallel_for(0, int64_t(plan.units.size()), sd::attention_grain(length, L.head_dim), [&](int64_t u0, int64_t u1) {
    sd::AttendScratch s(L.head_dim);
    for (int64_t u = u0; u < u1; ++u) sd::attend_unit(L, q.data_ptr<float>(), row0, kv, plan.units[u], out.data_ptr<float>(), s);
  });
}

// Step 3: x [N, hidden] fp32 after the output projection, the MLP and both residuals (a new tensor).
inline torch::Tensor layer_finish(const Layer& L, const torch::Tensor& x, const torch::Tensor& attn) {
  sd::check_rows(L, x);
  TORCH_CHECK(attn.scalar_type() == at::kFloat && attn.is_contiguous() && attn.dim() == 2 && attn.size(0) == x.size(0) &&
              attn.size(1) == L.heads * L.head_dim, "layer_finish: attn fp32 [N, H * D]");
  const int64_t n = x.size(0);
  auto out = torch::empty_like(x);
  std::vector<float> o(n * L.hidden), gu(n * 2 * L.inter), down(n * L.hidden);
  sd::on_threads([&](int tid, int nt) {
    sd::ThreadBuffers tb;
    sd::finish_part(L, x.data_ptr<float>(), attn.data_ptr<float>(), n, o.data(), gu.data(), down.data(),
                    out.data_ptr<float>(), tb, nullptr, tid, nt);
  });
  return out;
}

// Layers over ragged rows of several sequences whose keys/values live in plain buffers [S, Hkv, M, D] (bf16,
// one pair per layer): sequence j's counts[j] rows continue slot slots[j] at starts[j] (written there);
// trees[j], if given, is (index [n, W], counts [n]) over that slot's keys; cos[l]/sin[l] are layer l's RoPE
// tables. Returns x after the last layer.
// One parallel region for all of them: the threads meet at a barrier only where one needs another's output.
inline torch::Tensor layers_rows(const std::vector<const Layer*>& layers, const torch::Tensor& x,
                                 const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                 const torch::Tensor& pos, const std::vector<torch::Tensor>& kbufs,
                                 const std::vector<torch::Tensor>& vbufs, const std::vector<int64_t>& slots,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                                 const std::vector<c10::optional<std::vector<torch::Tensor>>>& trees) {
  TORCH_CHECK(!layers.empty() && kbufs.size() == layers.size() && vbufs.size() == layers.size() &&
              cos.size() == layers.size() && sin.size() == layers.size(),
              "layers_rows: one key and one value buffer and one pair of RoPE tables per layer");
  TORCH_CHECK(slots.size() == starts.size() && slots.size() == counts.size() && trees.size() == slots.size(),
              "layers_rows: one start, count and tree entry per slot");
  const int64_t n = x.size(0);
  std::vector<int64_t> first_row;
  int64_t total = 0;
  for (size_t j = 0; j < slots.size(); ++j) {
    TORCH_CHECK(counts[j] >= 1 && starts[j] >= 0, "layers_rows: slot ", slots[j], " rows out of range");
    first_row.push_back(total);
    total += counts[j];
  }
  TORCH_CHECK(total == n, "layers_rows: counts sum to ", total, ", x has ", n, " rows");
  std::vector<std::vector<sd::KeyView>> views(layers.size());
  int64_t width = 0, hidden = 0, inter = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer& L = *layers[l];
    const torch::Tensor &kbuf = kbufs[l], &vbuf = vbufs[l];
    sd::check_rows(L, x);
    sd::check_rope(L, cos[l], sin[l], pos, n);
    TORCH_CHECK(kbuf.scalar_type() == at::kBFloat16 && vbuf.scalar_type() == at::kBFloat16 && kbuf.is_contiguous() &&
                vbuf.is_contiguous() && kbuf.dim() == 4 && kbuf.size(1) == L.kv_heads && kbuf.size(3) == L.head_dim &&
                vbuf.sizes() == kbuf.sizes(), "layers_rows: cache buffers bf16 [S, Hkv, M, D], contiguous");
    const int64_t max_len = kbuf.size(2), d = L.head_dim, slot_stride = L.kv_heads * max_len * d;
    for (size_t j = 0; j < slots.size(); ++j) {
      TORCH_CHECK(slots[j] >= 0 && slots[j] < kbuf.size(0) && starts[j] + counts[j] <= max_len,
                  "layers_rows: slot ", slots[j], " rows out of range");
      const int64_t length = starts[j] + counts[j];
      sd::KeyView kv{sd::bf16_ptr(kbuf) + slots[j] * slot_stride, sd::bf16_ptr(vbuf) + slots[j] * slot_stride,
                     max_len * d, max_len * d, d, d, starts[j], L.window};
      if (trees[j].has_value()) {
        const auto& t = *trees[j];
        TORCH_CHECK(t.size() == 2, "layers_rows: a tree is (index, counts)");
        check_key_index(t[0], t[1], counts[j], length);
        kv.index = t[0].data_ptr<int64_t>();
        kv.counts = t[1].data_ptr<int64_t>();
        kv.width = t[0].size(1);
      }
      views[l].push_back(kv);
    }
    width = std::max(width, L.qkv.n_out);
    hidden = std::max(hidden, std::max(L.hidden, L.heads * L.head_dim));
    inter = std::max(inter, L.inter);
  }
  auto current = x.clone(), next = torch::empty_like(x);
  std::vector<float> proj(n * width), q(n * hidden), attn(n * hidden);
  std::vector<float> o(n * hidden), gu(n * 2 * inter), down(n * hidden);
  for (const Layer* L : layers)  // one attention plan serves every layer
    TORCH_CHECK(L->heads == layers[0]->heads && L->kv_heads == layers[0]->kv_heads && L->head_dim == layers[0]->head_dim,
                "layers_rows: layers of different attention shapes");
  std::vector<bool> tree;
  for (const auto& t : trees) tree.push_back(t.has_value());
  const sd::AttendPlan attention(*layers[0], starts, counts, tree, at::get_num_threads());
  sd::SharedRows rows_shared;
  sd::SharedRows* shared = n >= sd::kShareRows ? &rows_shared : nullptr;
  if (shared) shared->mid.resize(n * hidden);
  sd::on_threads([&](int tid, int nt) {
    sd::ThreadBuffers tb;
    sd::AttendScratch s(hidden);
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& L = *layers[l];
      const int64_t d = L.head_dim;
      const float* xin = (l % 2 ? next : current).data_ptr<float>();
      float* xout = (l % 2 ? current : next).data_ptr<float>();
      // RoPE writes the new keys/values straight into their slots' buffers (copied there in a pass of their own,
      // they cost each layer one more barrier).
      const auto kv_at = [&](bool is_key, int64_t kh, int64_t r) {
        const size_t j = std::upper_bound(first_row.begin(), first_row.end(), r) - first_row.begin() - 1;
        const sd::KeyView& kv = views[l][j];
        const int64_t at = (starts[j] + r - first_row[j]) * d;
        return const_cast<uint16_t*>(is_key ? kv.keys + kh * kv.head_stride_k : kv.values + kh * kv.head_stride_v) + at;
      };
      sd::qkv_part(L, xin, n, cos[l].data_ptr<float>(), sin[l].data_ptr<float>(), pos.data_ptr<int64_t>(), proj.data(),
                   q.data(), kv_at, tb, shared, tid, nt);
#pragma omp barrier
      int64_t a, b;
      attention.share(tid, nt, a, b);
      for (int64_t u = a; u < b; ++u) {
        const sd::AttendUnit& unit = attention.units[u];
        sd::attend_unit(L, q.data(), first_row[unit.seq], views[l][unit.seq], unit, attn.data(), s);
      }
#pragma omp barrier
      sd::finish_part(L, xin, attn.data(), n, o.data(), gu.data(), down.data(), xout, tb, shared, tid, nt);
#pragma omp barrier
    }
  });
  return layers.size() % 2 ? next : current;
}

// One layer of layers_rows.
inline torch::Tensor layer_rows(const Layer& L, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                const torch::Tensor& pos, torch::Tensor kbuf, torch::Tensor vbuf,
                                const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& counts,
                                const std::vector<c10::optional<std::vector<torch::Tensor>>>& trees) {
  return layers_rows({&L}, x, {cos}, {sin}, pos, {kbuf}, {vbuf}, slots, starts, counts, trees);
}

// fp32 [N, F] -> fp32 [N, N_out]: one projection on its own (the output head).
inline torch::Tensor project_rows(const Proj& p, const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == p.k_in && x.is_contiguous(),
              "project_rows: x must be contiguous fp32 [N, ", p.k_in, "]");
  auto y = torch::empty({x.size(0), p.n_out}, x.options());
  if (x.size(0)) sd::project(p, x.data_ptr<float>(), p.k_in, x.size(0), y.data_ptr<float>());
  return y;
}

// fp32 [N, h] -> fp32 [N, h]: RMSNorm with weight w (any float dtype).
inline torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && w.numel() == x.size(1),
              "rms_norm_rows: x contiguous fp32 [N, h], w [h]");
  auto wf = w.to(at::kFloat).contiguous();
  auto y = torch::empty_like(x);
  for (int64_t r = 0; r < x.size(0); ++r)
    sd::rms_norm_row(x.data_ptr<float>() + r * x.size(1), wf.data_ptr<float>(), x.size(1), float(eps),
                     y.data_ptr<float>() + r * x.size(1));
  return y;
}
