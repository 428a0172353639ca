// y = x W^T for W in GGUF's Q8_0 blocks (w = d * q: an int8 code q per weight, an fp32 scale d per
// 32 weights along a row), without a dense copy of W: ladechat's kernel for a GGUF's output layer
// (engine/model/q8.py builds and calls it). Codes are read once per step whatever its rows, so a
// step reads a quarter of the bytes of fp32 weights and half of bf16 ones.
//
// Layout (made by q8.py): codes (N / 16, K, 16) int8, the 16 outputs of a block next to each other
// for each input k; scales (N / 16, K / 32, 16) fp32. Per block of 16 outputs and group of 32
// inputs the codes are widened to fp32 once, then every row runs the same fixed sequence of fused
// multiply-adds (lanes = the 16 outputs; four partial sums over k mod 4, added in a fixed order,
// times the scale): a row's result does not depend on how many rows the step has, so a lookahead
// step computes exactly what a one-row step does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int OUT = 16;    // outputs per block
constexpr int GROUP = 32;  // inputs per scale

__attribute__((target("avx512f")))
void block_avx512(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, float* out) {
  alignas(64) float w[GROUP][OUT];
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(out + m * OUT, _mm512_setzero_ps());
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const int8_t* c = codes + g * GROUP * OUT;
    for (int k = 0; k < GROUP; ++k)
      _mm512_store_ps(w[k], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + k * OUT)))));
    const __m512 d = _mm512_loadu_ps(scales + g * OUT);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K + g * GROUP;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int k = 0; k < GROUP; k += 4) {
        a0 = _mm512_fmadd_ps(_mm512_load_ps(w[k]), _mm512_set1_ps(xr[k]), a0);
        a1 = _mm512_fmadd_ps(_mm512_load_ps(w[k + 1]), _mm512_set1_ps(xr[k + 1]), a1);
        a2 = _mm512_fmadd_ps(_mm512_load_ps(w[k + 2]), _mm512_set1_ps(xr[k + 2]), a2);
        a3 = _mm512_fmadd_ps(_mm512_load_ps(w[k + 3]), _mm512_set1_ps(xr[k + 3]), a3);
      }
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      _mm512_storeu_ps(out + m * OUT, _mm512_fmadd_ps(d, dot, _mm512_loadu_ps(out + m * OUT)));
    }
  }
}

// The same arithmetic in two halves of 8 lanes: bitwise the AVX-512 path's results.
__attribute__((target("avx2,fma")))
void block_avx2(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, float* out) {
  alignas(32) float w[GROUP][OUT];
  for (int64_t i = 0; i < M * OUT; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const int8_t* c = codes + g * GROUP * OUT;
    for (int k = 0; k < GROUP; ++k)
      for (int h = 0; h < OUT; h += 8)
        _mm256_store_ps(w[k] + h, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + k * OUT + h)))));
    for (int h = 0; h < OUT; h += 8) {
      const __m256 d = _mm256_loadu_ps(scales + g * OUT + h);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K + g * GROUP;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = 0; k < GROUP; k += 4) {
          a0 = _mm256_fmadd_ps(_mm256_load_ps(w[k] + h), _mm256_set1_ps(xr[k]), a0);
          a1 = _mm256_fmadd_ps(_mm256_load_ps(w[k + 1] + h), _mm256_set1_ps(xr[k + 1]), a1);
          a2 = _mm256_fmadd_ps(_mm256_load_ps(w[k + 2] + h), _mm256_set1_ps(xr[k + 2]), a2);
          a3 = _mm256_fmadd_ps(_mm256_load_ps(w[k + 3] + h), _mm256_set1_ps(xr[k + 3]), a3);
        }
        const __m256 dot = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        float* o = out + m * OUT + h;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(d, dot, _mm256_loadu_ps(o)));
      }
    }
  }
}

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// x (M, K) fp32 or bf16 -> y (M, N) fp32. wide: the AVX-512 path (else AVX2; the same results).
at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu()
              && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "q8_0 mm: x must be (rows, in) fp32 or bf16, contiguous, on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == K && codes.size(2) == OUT && K % GROUP == 0
              && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_0 mm: codes must be (out / 16, in, 16) int8 with in a multiple of 32");
  const int64_t NB = codes.size(0), G = K / GROUP;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == NB && scales.size(1) == G && scales.size(2) == OUT
              && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "q8_0 mm: scales must be (out / 16, in / 32, 16) fp32");
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), "q8_0 mm: codes and scales must be on the CPU");
  TORCH_CHECK(wide ? has_avx512() : has_avx2(), "q8_0 mm: this CPU lacks the instructions of the path asked for");
  const at::Tensor rows = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // bf16 -> fp32 is exact
  at::Tensor y = at::empty({M, NB * OUT}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const float* xp = rows.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t N = NB * OUT;
  // blocks of outputs split between threads: each output is computed by one thread, in one order
  at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * OUT);
    for (int64_t b = b0; b < b1; ++b) {
      if (wide) block_avx512(xp, M, K, cp + b * K * OUT, sp + b * G * OUT, acc.data());
      else block_avx2(xp, M, K, cp + b * K * OUT, sp + b * G * OUT, acc.data());
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + b * OUT, acc.data() + m * OUT, OUT * sizeof(float));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(ladechat_q8_0, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scales, bool wide) -> Tensor", &mm);
  m.def("has_avx512() -> bool", &has_avx512);
  m.def("has_avx2() -> bool", &has_avx2);
}
