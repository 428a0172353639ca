// A decoding step's small operations, each as one operator (engine/model/step_ops.py loads them).
// On 2 cores with a few rows a step of the embedded model is ~12 ms, and about a quarter of it was
// torch's dispatch of ~1,800 small ops around the weights' products: an RMSNorm is ~8 ops (~25 us
// a call, 61 calls), the rotation of q and k ~10 ops a layer, the rows' top-k ~125 us a row.
// Here each is one call of a few us. One library, so the first run compiles once.
//
//   rms_norm, add_rms_norm  transformers' Llama RMSNorm (norms.py swaps the modules where the
//                           weights are a GGUF's 4-bit blocks): the same steps in the same
//                           precision, the sum of squares in another fixed order (16 partial sums
//                           added pairwise): within fp32's last bits, nearly always bf16's exact
//                           bits. add_rms_norm first adds the residual, rounded as torch's add.
//   rope                    the lean step's rotation of q and k (lean._rotate): bitwise the same
//                           floats, each product rounded to the dtype and then their sum (the
//                           compile flags keep a * b + c two roundings, as torch's ops are).
//   top_k                   each row's k likeliest tokens, best first, equal logits by index (as
//                           argmax picks); NaN above every number, as torch.topk ranks it.
//
// Every row is computed alone, in a fixed order, by one thread: a row gives the same bits alone
// or among a step's rows, on one thread or two, so a lookahead step computes what a one-row step does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int LANES = 16;      // partial sums of squares
constexpr int64_t GRAIN = 64;  // rows of a norm per thread: a step's few rows run on one, a long prompt's split

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1
              && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": x must be fp32 or bf16, contiguous, on the CPU");
}

// -- RMSNorm -----------------------------------------------------------------------------------

// One row: y = weight * T(x * r), r = 1 / sqrt(mean(x^2) + eps) with x read as fp32.
template <typename T>
void norm_row(const T* x, const T* weight, int64_t H, float eps, T* y) {
  float acc[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= H; i += LANES)
    for (int j = 0; j < LANES; ++j) {
      const float v = as_float(x[i + j]);
      acc[j] += v * v;
    }
  for (int j = 0; i < H; ++i, ++j) {
    const float v = as_float(x[i]);
    acc[j] += v * v;
  }
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  const float r = 1.0f / std::sqrt(acc[0] / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) {
    const T scaled = static_cast<T>(as_float(x[k]) * r);
    y[k] = static_cast<T>(as_float(weight[k]) * as_float(scaled));
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type()
              && weight.is_contiguous() && weight.device().is_cpu(),
              "rms_norm: the weight must be (hidden,) in x's dtype");
}

// sum (if given) = x + delta, rounded to T; y = norm(sum or x)
template <typename T>
void norm_rows(const T* x, const T* delta, const T* weight, int64_t rows, int64_t H, float eps, T* sum, T* y) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* in = x + r * H;
      if (delta) {
        for (int64_t k = 0; k < H; ++k) sum[r * H + k] = static_cast<T>(as_float(in[k]) + as_float(delta[r * H + k]));
        in = sum + r * H;
      }
      norm_row(in, weight, H, eps, y + r * H);
    }
  });
}

template <typename T>
void norm_dispatch(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps,
                   at::Tensor* sum, at::Tensor& y) {
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  norm_rows(x.data_ptr<T>(), delta ? delta->data_ptr<T>() : nullptr, weight.data_ptr<T>(), rows, H,
            static_cast<float>(eps), sum ? sum->data_ptr<T>() : nullptr, y.data_ptr<T>());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(x, weight);
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) norm_dispatch<float>(x, nullptr, weight, eps, nullptr, y);
  else norm_dispatch<c10::BFloat16>(x, nullptr, weight, eps, nullptr, y);
  return y;
}

// (x + delta, rms_norm(x + delta)): a layer's residual add and the norm after it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_weight(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous()
              && delta.device().is_cpu(), "add_rms_norm: delta must be contiguous, of x's shape and dtype");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) norm_dispatch<float>(x, &delta, weight, eps, &sum, y);
  else norm_dispatch<c10::BFloat16>(x, &delta, weight, eps, &sum, y);
  return {sum, y};
}

// -- rotary position embedding -------------------------------------------------------------------

// x (S, heads * dim) -> out (heads, S, dim): x * cos + roll(x, dim / 2) * signed_sin per row.
template <typename T>
void rotate(const T* x, int64_t S, int64_t heads, int64_t dim, const T* cos, const T* signed_sin, T* out) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < S; ++s) {
      const T* row = x + (s * heads + h) * dim;
      const T* c = cos + s * dim;
      const T* n = signed_sin + s * dim;
      T* o = out + (h * S + s) * dim;
      for (int64_t j = 0; j < dim; ++j) {
        const T rolled = row[j < half ? j + half : j - half];
        const T a = static_cast<T>(as_float(row[j]) * as_float(c[j]));
        const T b = static_cast<T>(as_float(rolled) * as_float(n[j]));
        o[j] = static_cast<T>(as_float(a) + as_float(b));
      }
    }
}

at::Tensor rotated(const at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& signed_sin) {
  const int64_t S = cos.size(0), dim = cos.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == S && x.size(1) == heads * dim && x.is_contiguous()
              && x.scalar_type() == cos.scalar_type() && x.device().is_cpu(),
              "rope: q and k must be (rows, heads * dim), contiguous, in cos's dtype, on the CPU");
  at::Tensor out = at::empty({heads, S, dim}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotate(x.data_ptr<float>(), S, heads, dim, cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
           out.data_ptr<float>());
  else
    rotate(x.data_ptr<c10::BFloat16>(), S, heads, dim, cos.data_ptr<c10::BFloat16>(),
           signed_sin.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  return out;
}

// q (S, heads * dim), k (S, kv_heads * dim); cos, signed_sin (S, dim), signed_sin =
// cat(-sin[:dim/2], sin[dim/2:]) -> q, k rotated, heads first: (heads, S, dim), (kv_heads, S, dim).
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, int64_t heads, int64_t kv_heads,
                                        const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) % 2 == 0 && cos.is_contiguous() && signed_sin.sizes() == cos.sizes()
              && signed_sin.is_contiguous() && signed_sin.scalar_type() == cos.scalar_type()
              && (cos.scalar_type() == at::kFloat || cos.scalar_type() == at::kBFloat16)
              && cos.device().is_cpu() && signed_sin.device().is_cpu(),
              "rope: cos and signed_sin must be (rows, even dim), fp32 or bf16, contiguous, on the CPU");
  return {rotated(q, heads, cos, signed_sin), rotated(k, kv_heads, cos, signed_sin)};
}

// -- top-k ---------------------------------------------------------------------------------------

// Whether (a, i) ranks above (b, j): NaN first, then the larger value, then the lower index.
inline bool above(float a, int64_t i, float b, int64_t j) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return i < j;
}

template <typename T>
void top_row(const T* x, int64_t V, int64_t k, int64_t* out) {
  std::vector<float> best(k);
  int64_t kept = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float v = as_float(x[i]);
    // a later index never ranks above an equal value: only a larger one (or a NaN) gets in
    if (kept == k && !(v > best[k - 1]) && !std::isnan(v)) continue;
    if (kept == k && !above(v, i, best[k - 1], out[k - 1])) continue;
    int64_t at = kept < k ? kept++ : k - 1;
    for (; at > 0 && above(v, i, best[at - 1], out[at - 1]); --at) {
      best[at] = best[at - 1];
      out[at] = out[at - 1];
    }
    best[at] = v;
    out[at] = i;
  }
}

// logits (rows, V) fp32 or bf16 -> (rows, k) int64 token ids, best first.
at::Tensor top_k(const at::Tensor& logits, int64_t k) {
  check_rows(logits, "top_k");
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "top_k: logits must be (rows, vocab), 1 <= k <= vocab");
  const int64_t rows = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({rows, k}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (logits.scalar_type() == at::kFloat) top_row(logits.data_ptr<float>() + r * V, V, k, o + r * k);
      else top_row(logits.data_ptr<c10::BFloat16>() + r * V, V, k, o + r * k);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ladechat_step, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope(Tensor q, Tensor k, int heads, int kv_heads, Tensor cos, Tensor signed_sin) -> (Tensor, Tensor)",
        &rope);
  m.def("top_k(Tensor logits, int k) -> Tensor", &top_k);
}
