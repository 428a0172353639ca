// A decoding step's small operations, each as one operator (engine/kernels/step_ops.py loads them).
// With a small model and a few rows, much of a step was torch's dispatch of ~1,800 small ops
// around the weights' products (measured: BENCHMARKS.md): an RMSNorm is ~8 ops (61 calls), the
// rotation of q and k ~10 ops a layer, the rows' top-k one torch.topk each.
// Here each is one call. One library, so the first run compiles once.
//
//   rms_norm, add_rms_norm  transformers' Llama RMSNorm (norms.py swaps the modules where the
//                           weights are a GGUF's 4-bit blocks): the same steps in the same
//                           precision, the sum of squares in another fixed order (16 partial sums
//                           added pairwise): within fp32's last bits, nearly always bf16's exact
//                           bits. add_rms_norm first adds the residual, rounded as torch's add.
//   rope                    the Llama step's rotation of q and k (models/llama._rotate): bitwise the same
//                           floats, each product rounded to the dtype and then their sum (the
//                           compile flags keep a * b + c two roundings, as torch's ops are).
//   rope_kv                 the same rotation of a joint q/k/v product's rows, k rotated and v
//                           written straight into the layer's cache buffers (kv.GrowingLayer).
//   top_k                   each row's k likeliest tokens, best first, equal logits by index (as
//                           argmax picks); NaN above every number, as torch.topk ranks it.
//   keep_rows               a step's accepted rows moved down in every layer's keys and values
//                           (kv.commit_kv), one call for the whole cache.
//   attend                  attention row by row (attention.py's row-wise kernel, where the weights
//                           are a GGUF's blocks): each query row over the keys its mask lets it see,
//                           in one fixed order whatever the step's rows, so a lookahead row gets a
//                           one-row step's bits; AVX-512, AVX2 or portable loops (attend_best_path
//                           says which this CPU runs).
//
// Every row is computed alone, in a fixed order, by one thread: a row gives the same bits alone
// or among a step's rows, on one thread or two, so a lookahead step computes what a one-row step does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#define LADECHAT_X86 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
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

// x (S, heads * dim), its rows `stride` apart -> out, head h's row s at out + h * out_head + s *
// dim (out_head = S * dim: (heads, S, dim)): x * cos + roll(x, dim / 2) * signed_sin per row.
template <typename T>
void rotate(const T* x, int64_t stride, int64_t S, int64_t heads, int64_t dim, const T* cos, const T* signed_sin,
            T* out, int64_t out_head) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < S; ++s) {
      const T* row = x + s * stride + h * dim;
      const T* c = cos + s * dim;
      const T* n = signed_sin + s * dim;
      T* o = out + h * out_head + s * dim;
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
  // rows may be apart (q and k as column slices of one product with v), each row contiguous
  TORCH_CHECK(x.dim() == 2 && x.size(0) == S && x.size(1) == heads * dim && x.stride(1) == 1
              && (S == 1 || x.stride(0) >= x.size(1)) && x.scalar_type() == cos.scalar_type() && x.device().is_cpu(),
              "rope: q and k must be (rows, heads * dim), each row contiguous, in cos's dtype, on the CPU");
  at::Tensor out = at::empty({heads, S, dim}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotate(x.data_ptr<float>(), x.stride(0), S, heads, dim, cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
           out.data_ptr<float>(), S * dim);
  else
    rotate(x.data_ptr<c10::BFloat16>(), x.stride(0), S, heads, dim, cos.data_ptr<c10::BFloat16>(),
           signed_sin.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), S * dim);
  return out;
}

void check_rotation(const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) % 2 == 0 && cos.is_contiguous() && signed_sin.sizes() == cos.sizes()
              && signed_sin.is_contiguous() && signed_sin.scalar_type() == cos.scalar_type()
              && (cos.scalar_type() == at::kFloat || cos.scalar_type() == at::kBFloat16)
              && cos.device().is_cpu() && signed_sin.device().is_cpu(),
              "rope: cos and signed_sin must be (rows, even dim), fp32 or bf16, contiguous, on the CPU");
}

template <typename T>
void rotate_into_cache(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                       const at::Tensor& signed_sin, at::Tensor& keys, at::Tensor& values, int64_t held, at::Tensor& q) {
  const int64_t S = cos.size(0), dim = cos.size(1), stride = qkv.stride(0), capacity = keys.size(2);
  const T* x = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* n = signed_sin.data_ptr<T>();
  rotate(x, stride, S, heads, dim, c, n, q.data_ptr<T>(), S * dim);
  rotate(x + heads * dim, stride, S, kv_heads, dim, c, n, keys.data_ptr<T>() + held * dim, capacity * dim);
  T* v = values.data_ptr<T>() + held * dim;
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(v + h * capacity * dim + s * dim, x + s * stride + (heads + kv_heads + h) * dim, dim * sizeof(T));
}

// The rows of one joint q/k/v product, qkv (S, (heads + 2 kv_heads) * dim), each row contiguous:
// q rotated and returned, (heads, S, dim); k rotated and v as it is written straight into a
// layer's key and value buffers (1, kv_heads, capacity, dim) at positions held .. held + S - 1.
// The same floats as rope() and a copy into the cache (kv.GrowingLayer.update), in one call
// instead of ~10 (the Llama step's q/k/v, once a layer).
at::Tensor rope_kv(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                   const at::Tensor& signed_sin, at::Tensor keys, at::Tensor values, int64_t held) {
  check_rotation(cos, signed_sin);
  const int64_t S = cos.size(0), dim = cos.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == S && qkv.size(1) == (heads + 2 * kv_heads) * dim && qkv.stride(1) == 1
              && (S == 1 || qkv.stride(0) >= qkv.size(1)) && qkv.scalar_type() == cos.scalar_type() && qkv.device().is_cpu(),
              "rope_kv: qkv must be (rows, (heads + 2 kv_heads) * dim), each row contiguous, in cos's dtype, on the CPU");
  for (const at::Tensor* buffer : {&keys, &values})
    TORCH_CHECK(buffer->dim() == 4 && buffer->size(0) == 1 && buffer->size(1) == kv_heads && buffer->size(3) == dim
                && buffer->is_contiguous() && buffer->scalar_type() == cos.scalar_type() && buffer->device().is_cpu()
                && buffer->sizes() == keys.sizes() && held >= 0 && held + S <= buffer->size(2),
                "rope_kv: keys and values must be (1, kv_heads, capacity, dim) alike, contiguous, in cos's dtype, "
                "with room for the rows after `held`");
  TORCH_CHECK(keys.data_ptr() != values.data_ptr(), "rope_kv: keys and values must be two buffers");
  at::Tensor q = at::empty({heads, S, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) rotate_into_cache<float>(qkv, heads, kv_heads, cos, signed_sin, keys, values, held, q);
  else rotate_into_cache<c10::BFloat16>(qkv, heads, kv_heads, cos, signed_sin, keys, values, held, q);
  return q;
}

// q (S, heads * dim), k (S, kv_heads * dim); cos, signed_sin (S, dim), signed_sin =
// cat(-sin[:dim/2], sin[dim/2:]) -> q, k rotated, heads first: (heads, S, dim), (kv_heads, S, dim).
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, int64_t heads, int64_t kv_heads,
                                        const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_rotation(cos, signed_sin);
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

// The first index from i on whose logit may enter a full top-k: above `threshold` (the k-th best
// so far) or NaN; V if none. Most of a vocabulary is below it, so the scan goes 8 logits at a time
// where the CPU has AVX2; what it stops at is then ranked as before.
inline int64_t next_candidate_portable(const float* x, int64_t i, int64_t V, float threshold) {
  for (; i < V; ++i)
    if (!(x[i] <= threshold)) return i;
  return V;
}

#ifdef LADECHAT_X86
__attribute__((target("avx2")))
int64_t next_candidate_avx2(const float* x, int64_t i, int64_t V, float threshold) {
  const __m256 bar = _mm256_set1_ps(threshold);
  for (; i + 8 <= V; i += 8) {
    const int above_or_nan = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), bar, _CMP_NLE_UQ));
    if (above_or_nan) return i + __builtin_ctz(above_or_nan);
  }
  return next_candidate_portable(x, i, V, threshold);
}
#endif

inline int64_t next_candidate(const float* x, int64_t i, int64_t V, float threshold) {
#ifdef LADECHAT_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return next_candidate_avx2(x, i, V, threshold);
#endif
  return next_candidate_portable(x, i, V, threshold);
}

template <typename T>
void top_row(const T* x, int64_t V, int64_t k, int64_t* out) {
  std::vector<float> best(k);
  int64_t kept = 0;
  for (int64_t i = 0; i < V; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (kept == k && (i = next_candidate(x, i, V, best[k - 1])) == V) break;
    }
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

// -- attention -----------------------------------------------------------------------------------
//
// softmax(q K^T * scale) V for each query row over the keys its mask lets it see, computed for
// that row alone: its visible keys in sequence order, each key's score by the same dot product
// (fixed lanes, then a fixed tree), e^(s - max) by one polynomial, the weights summed and the
// values weighted in the order of the visible keys. A row that sees the same keys with the same
// values therefore gets the same bits in a one-row step (plain decoding, every key visible) and
// in a lookahead step (the cache plus its ancestors among the step's rows, others masked), on
// one thread or two. torch's SDPA does not promise that: its blocks of keys and rows depend on
// how many rows and keys the step has, which moves the last bits, and on rounded activations
// (int8 codes, bf16) such a difference can turn into another token near a tie. Rows are split
// between threads, each computed whole by one.
//
//   q (1, H, R, D)  the grouped layout of attention.py: query heads stacked as rows per kv head
//   k, v (1, H, L, D)  the cache's keys and values, any stride but the last
//   mask (1, 1, R, L): bool (true: visible) or additive (0: visible); or none: causal, the last
//        `rows` keys being the rows' own (row r sees the keys up to L - rows + r % rows; a
//        one-row step sees every key, a prefill its prompt up to itself)
//
// Three paths: AVX-512 (16 lanes), AVX2 (8 lanes), portable loops (path -1: the best here); each
// deterministic, they differ from each other in the last bits (a machine runs one). D: 64 or 128
// (others keep SDPA).

struct AttendRow {
  const void* q;
  const void* k;
  const void* v;
  int64_t k_stride, v_stride;
  const int64_t* visible;  // the key indices this row sees, in order
  int64_t n;
  float scale;
  void* out;
};

// e^x for x <= 0, within ~2 ulp: 2^n p(r), r = x - n ln2 (two-part ln2), p a degree-7 polynomial
inline float exp_nonpositive(float x) {
  if (x < -87.f) return 0.f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

template <typename T>
void attend_portable(const AttendRow& row, int64_t D, float* scores) {
  const T* q = static_cast<const T*>(row.q);
  const T* k = static_cast<const T*>(row.k);
  const T* v = static_cast<const T*>(row.v);
  float top = -INFINITY;
  for (int64_t i = 0; i < row.n; ++i) {
    const T* key = k + row.visible[i] * row.k_stride;
    float lanes[LANES] = {};
    for (int64_t c = 0; c < D; c += LANES)
      for (int l = 0; l < LANES; ++l) lanes[l] = std::fma(as_float(q[c + l]), as_float(key[c + l]), lanes[l]);
    float half[LANES / 2];
    for (int width = LANES / 2; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) half[l] = lanes[l] + lanes[l + width];
      std::copy(half, half + width, lanes);
    }
    scores[i] = lanes[0] * row.scale;
    top = std::fmax(top, scores[i]);
  }
  float total = 0.f;
  for (int64_t i = 0; i < row.n; ++i) total += (scores[i] = exp_nonpositive(scores[i] - top));
  std::vector<float> acc(D, 0.f);
  for (int64_t i = 0; i < row.n; ++i) {
    const T* value = v + row.visible[i] * row.v_stride;
    for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(scores[i], as_float(value[d]), acc[d]);
  }
  const float inverse = row.n ? 1.f / total : 0.f;
  T* out = static_cast<T*>(row.out);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inverse);
}

#ifdef LADECHAT_X86
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512bw")))
#define AVX2 __attribute__((target("avx2,fma")))

AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512 inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32: the bits moved up, exact
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

AVX512 inline __m512 exp16(__m512 x) {  // exp_nonpositive's steps, 16 lanes
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ),
                             _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// 16 vectors -> lane t = the sum of v[t]'s lanes, by the same tree for every t:
// ((l0 + l2) + (l1 + l3)) within each 4 lanes, then (B0 + B1) + (B2 + B3) over the 4 blocks.
AVX512 inline __m512 sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

template <typename T, int C>  // C = D / 16
AVX512 void attend_avx512(const AttendRow& row, float* scores) {
  const T* k = static_cast<const T*>(row.k);
  const T* v = static_cast<const T*>(row.v);
  const int64_t n = row.n;
  __m512 q[C];
  for (int c = 0; c < C; ++c) q[c] = load16(static_cast<const T*>(row.q) + 16 * c);
  const __m512 scale = _mm512_set1_ps(row.scale);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {  // 16 keys' scores at a time (the last block padded with zeros)
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    __m512 dots[16];
    for (int t = 0; t < 16; ++t) {
      if (t >= count) {
        dots[t] = _mm512_setzero_ps();
        continue;
      }
      const T* key = k + row.visible[i + t] * row.k_stride;
      __m512 s = _mm512_mul_ps(q[0], load16(key));
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[c], load16(key + 16 * c), s);
      dots[t] = s;
    }
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
    const __m512 s = _mm512_mul_ps(sums16(dots), scale);
    _mm512_mask_storeu_ps(scores + i, live, s);
    top = _mm512_mask_max_ps(top, live, top, s);
  }
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + i), max)));
    _mm512_mask_storeu_ps(scores + i, live, p);
    total = _mm512_add_ps(total, p);
  }
  const float sum = _mm512_reduce_add_ps(total);
  __m512 even[C], odd[C];  // two chains of weighted values: keys 0, 2, 4.. and 1, 3, 5..
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const T* v0 = v + row.visible[i] * row.v_stride;
    const T* v1 = v + row.visible[i + 1] * row.v_stride;
    const __m512 p0 = _mm512_set1_ps(scores[i]), p1 = _mm512_set1_ps(scores[i + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = _mm512_fmadd_ps(p0, load16(v0 + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(p1, load16(v1 + 16 * c), odd[c]);
    }
  }
  if (i < n) {
    const T* v0 = v + row.visible[i] * row.v_stride;
    for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[i]), load16(v0 + 16 * c), even[c]);
  }
  const __m512 inverse = _mm512_set1_ps(n ? 1.f / sum : 0.f);
  T* out = static_cast<T*>(row.out);
  for (int c = 0; c < C; ++c) {
    float lanes[16];
    _mm512_storeu_ps(lanes, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inverse));
    for (int l = 0; l < 16; ++l) out[16 * c + l] = static_cast<T>(lanes[l]);
  }
}

AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

AVX2 inline __m256 exp8(__m256 x) {  // exp_nonpositive's steps, 8 lanes
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ), _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// 8 vectors -> lane t = the sum of v[t]'s lanes: ((l0 + l2) + (l1 + l3)) per half, then the halves.
AVX2 inline __m256 sums8(const __m256* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

template <typename T, int C>  // C = D / 8
AVX2 void attend_avx2(const AttendRow& row, float* scores) {
  const T* k = static_cast<const T*>(row.k);
  const T* v = static_cast<const T*>(row.v);
  const int64_t n = row.n;
  __m256 q[C];
  for (int c = 0; c < C; ++c) q[c] = load8(static_cast<const T*>(row.q) + 8 * c);
  const __m256 scale = _mm256_set1_ps(row.scale);
  float top = -INFINITY;
  for (int64_t i = 0; i < n; i += 8) {  // 8 keys' scores at a time (the last block padded with zeros)
    const int count = static_cast<int>(std::min<int64_t>(8, n - i));
    __m256 dots[8];
    for (int t = 0; t < 8; ++t) {
      if (t >= count) {
        dots[t] = _mm256_setzero_ps();
        continue;
      }
      const T* key = k + row.visible[i + t] * row.k_stride;
      __m256 s = _mm256_mul_ps(q[0], load8(key));
      for (int c = 1; c < C; ++c) s = _mm256_fmadd_ps(q[c], load8(key + 8 * c), s);
      dots[t] = s;
    }
    float block[8];
    _mm256_storeu_ps(block, _mm256_mul_ps(sums8(dots), scale));
    for (int t = 0; t < count; ++t) {
      scores[i + t] = block[t];
      top = std::fmax(top, block[t]);
    }
  }
  const __m256 max = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, n - i));
    float block[8] = {};
    std::copy(scores + i, scores + i + count, block);
    _mm256_storeu_ps(block, exp8(_mm256_sub_ps(_mm256_loadu_ps(block), max)));
    std::fill(block + count, block + 8, 0.f);
    std::copy(block, block + count, scores + i);
    total = _mm256_add_ps(total, _mm256_loadu_ps(block));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  const float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  __m256 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const T* v0 = v + row.visible[i] * row.v_stride;
    const T* v1 = v + row.visible[i + 1] * row.v_stride;
    const __m256 p0 = _mm256_set1_ps(scores[i]), p1 = _mm256_set1_ps(scores[i + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = _mm256_fmadd_ps(p0, load8(v0 + 8 * c), even[c]);
      odd[c] = _mm256_fmadd_ps(p1, load8(v1 + 8 * c), odd[c]);
    }
  }
  if (i < n) {
    const T* v0 = v + row.visible[i] * row.v_stride;
    for (int c = 0; c < C; ++c) even[c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[i]), load8(v0 + 8 * c), even[c]);
  }
  const __m256 inverse = _mm256_set1_ps(n ? 1.f / sum : 0.f);
  T* out = static_cast<T*>(row.out);
  for (int c = 0; c < C; ++c) {
    float values[8];
    _mm256_storeu_ps(values, _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), inverse));
    for (int l = 0; l < 8; ++l) out[8 * c + l] = static_cast<T>(values[l]);
  }
}

#undef AVX512
#undef AVX2
#endif  // LADECHAT_X86

enum AttendPath : int64_t { ATTEND_PORTABLE = 0, ATTEND_AVX2 = 1, ATTEND_AVX512 = 2 };

#ifdef LADECHAT_X86
bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
}
#else  // the portable loops only (the library's other ops are portable C++)
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif
int64_t attend_best_path() { return cpu_has_avx512() ? ATTEND_AVX512 : cpu_has_avx2() ? ATTEND_AVX2 : ATTEND_PORTABLE; }

template <typename T>
void attend_one(const AttendRow& row, int64_t D, int64_t path, float* scores) {
#ifdef LADECHAT_X86
  if (path == ATTEND_AVX512) return (D == 64 ? attend_avx512<T, 4> : attend_avx512<T, 8>)(row, scores);
  if (path == ATTEND_AVX2) return (D == 64 ? attend_avx2<T, 8> : attend_avx2<T, 16>)(row, scores);
#endif
  attend_portable<T>(row, D, scores);
}

// The indices of the keys a row sees: 0 or false hides a key, as SDPA reads the mask.
template <typename M>
int64_t visible_keys(const M* row, int64_t step, int64_t L, int64_t* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < L; ++j) {
    bool sees;
    if constexpr (std::is_same_v<M, bool>) sees = row[j * step];
    else sees = as_float(row[j * step]) == 0.f;
    if (sees) out[n++] = j;
  }
  return n;
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  double scale, int64_t rows, int64_t path) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "attend: q, k, v must be (1, heads, rows or keys, dim)");
  const int64_t H = q.size(1), R = q.size(2), D = q.size(3), L = k.size(2);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && v.size(2) == L && k.size(3) == D && v.size(3) == D
              && (D == 64 || D == 128) && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend: k and v must match q's heads and dim (64 or 128), each with its last dim contiguous");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && k.scalar_type() == q.scalar_type()
              && v.scalar_type() == q.scalar_type() && q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "attend: q, k, v must be fp32 or bf16, all one dtype, on the CPU");
  TORCH_CHECK(!mask || (mask->dim() == 4 && mask->size(0) == 1 && mask->size(1) == 1 && mask->size(2) == R
                        && mask->size(3) == L && mask->device().is_cpu()
                        && (mask->scalar_type() == at::kBool || mask->scalar_type() == q.scalar_type())),
              "attend: the mask must be (1, 1, rows, keys), bool or q's dtype, on the CPU");
  TORCH_CHECK(mask || (rows >= 1 && R % rows == 0 && rows <= L), "attend: without a mask, rows must divide q's rows");
  if (path < 0) path = attend_best_path();
  TORCH_CHECK(path == ATTEND_PORTABLE || (path == ATTEND_AVX2 && cpu_has_avx2()) || (path == ATTEND_AVX512 && cpu_has_avx512()),
              "attend: this CPU lacks the instructions of the path asked for");
  at::Tensor out = at::empty({1, H, R, D}, q.options());
  const int64_t mask_row = mask ? mask->stride(2) : 0, mask_step = mask ? mask->stride(3) : 0;
  const void* mask_data = mask ? mask->data_ptr() : nullptr;
  const auto mask_type = mask ? mask->scalar_type() : at::kBool;
  const int64_t size = q.element_size(), q_head = q.stride(1), q_row = q.stride(2), k_head = k.stride(1),
                k_key = k.stride(2), v_head = v.stride(1), v_key = v.stride(2);
  const char* qp = static_cast<const char*>(q.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const bool fp32 = q.scalar_type() == at::kFloat;
  // rows split between threads where there is enough to split: a one-row step's 9 heads over 200
  // keys cost about what waking a second thread does
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(L, 1));
  at::parallel_for(0, H * R, grain, [&](int64_t a, int64_t b) {
    std::vector<int64_t> visible(L);
    std::vector<float> scores(L + 16);
    for (int64_t hr = a; hr < b; ++hr) {
      const int64_t h = hr / R, r = hr % R;
      int64_t n = L;
      if (!mask) {
        n = L - rows + r % rows + 1;
        for (int64_t j = 0; j < n; ++j) visible[j] = j;
      } else if (mask_type == at::kBool) {
        n = visible_keys(static_cast<const bool*>(mask_data) + r * mask_row, mask_step, L, visible.data());
      } else if (mask_type == at::kFloat) {
        n = visible_keys(static_cast<const float*>(mask_data) + r * mask_row, mask_step, L, visible.data());
      } else {
        n = visible_keys(static_cast<const c10::BFloat16*>(mask_data) + r * mask_row, mask_step, L, visible.data());
      }
      const AttendRow row{qp + (h * q_head + r * q_row) * size, kp + h * k_head * size, vp + h * v_head * size,
                          k_key, v_key, visible.data(), n, static_cast<float>(scale),
                          op + (h * R + r) * D * size};
      if (fp32) attend_one<float>(row, D, path, scores.data());
      else attend_one<c10::BFloat16>(row, D, path, scores.data());
    }
  });
  return out;
}

// -- keeping a step's accepted rows -------------------------------------------------------------

// Each of a cache's key and value tensors (1, heads, positions, dim), its last dim contiguous:
// positions past + rows[i] moved down to past + i (rows ascending, so rows[i] >= i and no row is
// overwritten before it is read). kv.commit_kv's gather for every layer in one call instead of
// ~4 ops a tensor. Bytes are moved as they are, whatever the dtype.
void keep_rows(at::TensorList states, int64_t past, at::IntArrayRef rows) {
  for (size_t i = 1; i < rows.size(); ++i)
    TORCH_CHECK(rows[i] > rows[i - 1], "keep_rows: rows must be ascending");
  TORCH_CHECK(past >= 0 && (rows.empty() || rows[0] >= 0), "keep_rows: past and rows must be >= 0");
  for (const at::Tensor& t : states) {  // every tensor checked before any is changed
    // rows and heads apart in memory (a size-1 dim's stride says nothing: torch may give it any)
    TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.stride(3) == 1 && (t.size(2) == 1 || t.stride(2) >= t.size(3))
                && (t.size(1) == 1 || t.stride(1) >= t.size(2) * t.stride(2)) && t.device().is_cpu(),
                "keep_rows: states must be (1, heads, positions, dim) on the CPU, rows apart, the last dim contiguous");
    TORCH_CHECK(rows.empty() || past + rows.back() < t.size(2), "keep_rows: a row past the tensor's positions");
  }
  for (const at::Tensor& t : states) {
    char* base = static_cast<char*>(t.data_ptr());
    const int64_t size = t.element_size(), row_bytes = t.size(3) * size;
    for (int64_t h = 0; h < t.size(1); ++h) {
      char* head = base + h * t.stride(1) * size;
      for (size_t i = 0; i < rows.size(); ++i)
        if (rows[i] != static_cast<int64_t>(i))
          std::memcpy(head + (past + i) * t.stride(2) * size, head + (past + rows[i]) * t.stride(2) * size, row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(ladechat_step, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope(Tensor q, Tensor k, int heads, int kv_heads, Tensor cos, Tensor signed_sin) -> (Tensor, Tensor)",
        &rope);
  m.def("rope_kv(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor signed_sin, Tensor(a!) keys, "
        "Tensor(b!) values, int held) -> Tensor", &rope_kv);
  m.def("top_k(Tensor logits, int k) -> Tensor", &top_k);
  m.def("keep_rows(Tensor(a!)[] states, int past, int[] rows) -> ()", &keep_rows);
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int rows, int path) -> Tensor", &attend);
  m.def("attend_best_path() -> int", &attend_best_path);
}
