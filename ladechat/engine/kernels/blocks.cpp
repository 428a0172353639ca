// y = x W^T for W as a GGUF's blocks, the activations quantized to int8 as llama.cpp does for
// these blocks: ladechat's kernels for a GGUF's 4-bit and Q6_K Linear weights (engine/kernels/q4.py,
// q6.py) and its Q8_0 output layer (engine/kernels/q8.py). One library, so one compile.
//
//   q4_mm  Q4_0 / Q4_1 / Q4_K: w = scale * q + low, a code q in 0..15 per weight, a scale and low
//          per 32 weights along a row, given in one of four forms (the fp32 values are the same):
//            fp32   scale and low per 32 weights
//            fp16   scale and low per 32 weights (Q4_1: the file's own fp16 values)
//            d      Q4_0, Q5_0: the file's fp16 d per 32 weights, low = factor * d (an int8 per tile:
//                   -8, -16), exact in fp32
//            Q4_K   sc and m (6-bit integers) per 32 weights, d and -dmin (fp16) per 256: scale = d * sc,
//                   low = -dmin * m, each exact in fp32 (an fp16 times an integer below 64)
//          The compact forms are what a step streams: the file's 0.5625 (Q4_K, Q4_0) or 0.625
//          (Q4_1) bytes a weight against the fp32 form's 0.75.
//          Q5_0 / Q5_1 / Q5_K run here too: a code q in 0..31, its top bit in a plane of its own
//          (Q5_0: scale d, low -16 d; Q5_1: d, m; Q5_K: Q4_K's form), 0.69-0.75 bytes a weight.
//   q8_mm  Q8_0: w = scale * q, a code q in -128..127 per weight, an fp16 scale per 32 weights (the file's d)
//   half_mm  F16 / BF16: the weights as they are, widened to fp32 as read; fp32 activations (below)
//   q6_mm  Q6_K: w = d * sc * (q - 32), a code q in 0..63 per weight, an int8 sc per 16 weights and
//          an fp16 d per 256 weights along a row (the file's own bits: ~0.82 bytes a weight)
//   gguf_tiles  a GGUF tensor's Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K blocks -> the codes'
//               tiles below (at load)
//
// Why: torch's int4 kernel widens every code to floats for every 4 rows and multiplies in fp32
// (its vectorized path takes bf16 activations), and a float kernel for Q8_0 spends a multiply-add
// per weight and row, so a step's extra rows cost nearly a one-row step's products each. Here each
// row is quantized once per product (per 32 inputs: a = da * qa, qa int8 in -127..127,
// da = max|a| / 127), and the codes meet it in integer dot products, four multiply-adds per 32-bit
// lane in one instruction (AVX-512 VNNI's VPDPBUSD; AVX2's VPMADDUBSW + VPMADDWD). Per output and
// group of 32 inputs:
//
//   Q4:  sum_k w_k a_k = da * (scale * sum_k q_k qa_k + low * sum_k qa_k)
//   Q8:  sum_k w_k a_k = da * scale * sum_k q_k qa_k
//   Q6:  sum_k w_k a_k = da * d * (sc_0 * (S_0 - 32 A_0) + sc_1 * (S_1 - 32 A_1))
//        S_h = sum of q_k qa_k and A_h = sum of qa_k over inputs 16 h .. 16 h + 15
//
// The integer sums are exact whatever the order, and the float steps around them are the same
// fixed sequence on every path: t = scale * isum; (Q4: t = fma(low, asum, t);) y = fma(t, da, y),
// group after group (Q6: the bracket is an exact int32, |.| < 2^24 so exact as a float too, then
// t = d * float(bracket); y = fma(t, da, y)). So a row gives the same bits alone or among a step's rows, on one thread or
// two, and on the VNNI, AVX2 and portable paths alike (tests/kernels/test_q4.py, tests/kernels/test_q8.py).
//
// Layout (q4.layout, q4.layout_k and q8.kernel_layout make it), one tile per 16 outputs x 32 inputs:
//
//   Q4 codes (N / 16, K / 32, 256) uint8
//     tile byte 64 p + 4 j + i    (p 0..3, output j 0..15, i 0..3)
//        low nibble:  q[j][4 p + i]            inputs 0..15 of the group
//        high nibble: q[j][4 (p + 4) + i]      inputs 16..31
//     and scales, lows: fp32 or fp16 (N / 16, K / 32, 16), output j at j; or (Q4_K form) scales
//     uint8 (N / 16, K / 32, 24), a record of 192 bytes per 8 groups (KForm below), and lows fp16
//     (N / 16, K / 256, 32): d of output j at j, -dmin at 16 + j; or (d form) scales fp16 and
//     lows int8 (N / 16, 1, 1), the factor of each tile
//   Q5 codes (N / 16, K / 32, 320) uint8
//     tile bytes 0..255 as Q4's, holding the low 4 bits of each code
//     tile byte 256 + 8 c + b, bit t: the top bit of q[j][4 c + i], 4 j + i = 8 b + t (c 0..7)
//     and scales and lows as Q4's (fp16, fp32, the d form or the Q4_K form)
//   Q8 codes (N / 16, K / 32, 512) int8
//     tile byte 64 c + 4 j + i    (c 0..7) = q[j][4 c + i]
//     and scales fp16 (N / 16, K / 32, 16): the file's d, 34 bytes per 32 weights as in the file
//   Q6 codes (N / 16, K / 32, 416) uint8
//     tile bytes 0..255 as Q4's, holding the low 4 bits of each code
//     tile byte 256 + 64 v + 4 j + i (v 0..1): bits 2 p..2 p + 1 = the top 2 bits of q[j][4 (4 v + p) + i]
//     tile byte 384 + 16 h + j: sc of output j for inputs 16 h .. 16 h + 15 (int8)
//     and d (N / 16, K / 256, 16) fp16, the file's
//
//   so one 64-byte load (for Q4 masked or shifted) holds for 4 consecutive inputs the 4 codes of
//   each of the 16 outputs in that output's 32-bit lane:
//
//        lane j:  [ q[j][k] q[j][k+1] q[j][k+2] q[j][k+3] ]   x   [ qa[k] .. qa[k+3] ] (broadcast)
//
//   VPDPBUSD multiplies unsigned by signed bytes: Q4's codes are the unsigned side; Q8 multiplies
//   |q| (-128 reads as 128 unsigned) by qa with q's sign, the same products, so the same exact sums.
//   AVX2's VPMADDUBSW does the same and adds pairs in 16 bits: at most 2 * 128 * 127 a pair,
//   within 16 bits.
//
// Inputs must be finite (an inf or NaN activation gives unspecified codes for its group).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

// The SIMD paths are x86-64's (AVX2, AVX-512 VNNI); elsewhere (an ARM Mac, aarch64 Linux) the
// library builds with the portable loops alone, which give the same bits. LADECHAT_PORTABLE_ONLY
// builds that on x86 too (tests/kernels/test_q4.py compiles it so).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(LADECHAT_PORTABLE_ONLY)
#define LADECHAT_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define X86_ONLY(kernel) kernel
#else
#define X86_ONLY(kernel) nullptr
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int OUT = 16;                      // outputs per tile
constexpr int GROUP = 32;                    // inputs per scale and low
constexpr int Q4_TILE = OUT * GROUP / 2;  // bytes: 256
constexpr int Q5_TILE = Q4_TILE + OUT * GROUP / 8;  // bytes: 320 (Q4's and a plane of top bits)
constexpr int Q8_TILE = OUT * GROUP;      // bytes: 512
constexpr int Q6_TILE = Q4_TILE + OUT * GROUP / 4 + 2 * OUT;  // bytes: 416
constexpr int Q6_SUPER = 8;                  // groups per d (256 inputs); Q4_K's d and dmin too
constexpr int K_SCALE_BYTES = OUT + 8;       // a group's share of sc and m in the Q4_K form: 6 bits each
constexpr int64_t QUANTIZE_GRAIN = 16;       // rows quantized per thread: a step's few rows on one
constexpr int ROWS_AT_ONCE = 4;              // rows of a tile in registers at once (AVX2's 16; F16/BF16's)
// The same with AVX-512's 32: 12 rows' sums, a group's 8 code vectors and its scale and low. A step's
// rows in one pass keep their arithmetic under the weights' streaming, where a second pass over a
// tile in cache had it after.
constexpr int VNNI_ROWS = 12;
constexpr int64_t PREFETCH_BYTES = 4096;     // how far ahead of its reads a kernel asks for the codes
constexpr int64_t CHUNK_BYTES = 1 << 18;     // weights a thread takes at a time (for_tiles)

enum Path : int64_t { PORTABLE = 0, AVX2 = 1, VNNI = 2 };

// F16C (the fp16 scales' widening) read from CPUID: __builtin_cpu_supports knows it only from GCC 11
// and clang 18, and an unknown name there is a compile error. Read once: in a virtual machine CPUID
// traps to the hypervisor (10 us a call on the 2-core VMs here, BENCHMARKS.md), and every product
// checks its path.
#ifdef LADECHAT_X86
bool has_f16c() {
  static const bool f16c = [] {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }();
  return f16c;
}
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c(); }
bool has_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
         && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}
#else
bool has_avx2() { return false; }
bool has_vnni() { return false; }
#endif
int64_t best_path() { return has_vnni() ? VNNI : has_avx2() ? AVX2 : PORTABLE; }

// Activations of one row, per group of 32: codes qa, scale da and the codes' sum (as a float, exact).
struct Quantized {
  int8_t* codes;
  float* scale;
  float* sum;
};

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// The same steps on every path: amax = max |x|; da = amax / 127; qa = clamp(round-to-even(x * (1 / da))).
template <typename T>
void quantize_portable(const T* x, int64_t K, Quantized out) {
  for (int64_t g = 0; g < K / GROUP; ++g) {
    float v[GROUP];
    float amax = 0.f;
    for (int i = 0; i < GROUP; ++i) {
      v[i] = as_float(x[g * GROUP + i]);
      amax = std::fmax(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f;
    const float id = d >= FLT_MIN ? 1.f / d : 0.f;  // a denormal scale: codes 0 (1 / d would overflow)
    int sum = 0;
    for (int i = 0; i < GROUP; ++i) {
      const float r = std::fmin(127.f, std::fmax(-127.f, std::nearbyint(v[i] * id)));
      out.codes[g * GROUP + i] = static_cast<int8_t>(r);
      sum += static_cast<int>(r);
    }
    out.scale[g] = d;
    out.sum[g] = static_cast<float>(sum);
  }
}

#ifdef LADECHAT_X86
__attribute__((target("avx512f,avx512bw,avx512dq")))
void quantize_avx512(const float* x, int64_t K, Quantized out) {
  const __m512 sign = _mm512_set1_ps(-0.f), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const __m512 v0 = _mm512_loadu_ps(x + g * GROUP), v1 = _mm512_loadu_ps(x + g * GROUP + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float d = amax / 127.f;
    const __m512 id = _mm512_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v0, id), nearest))));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v1, id), nearest))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes + g * GROUP), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes + g * GROUP + 16), _mm512_cvtepi32_epi8(q1));
    out.scale[g] = d;
    out.sum[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

__attribute__((target("avx2,fma")))
void quantize_avx2(const float* x, int64_t K, Quantized out) {
  const __m256 sign = _mm256_set1_ps(-0.f), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t g = 0; g < K / GROUP; ++g) {
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + g * GROUP + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
    const float d = _mm_cvtss_f32(t4) / 127.f;
    const __m256 id = _mm256_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
    out.scale[g] = d;
    out.sum[g] = static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

#endif  // LADECHAT_X86
// One tile of 16 outputs over all K inputs for M rows: acc (M, 16) fp32.
struct Tile {
  const uint8_t* codes;  // (K / 32, 256 Q4 / 512 Q8 / 416 Q6)
  const void* scales;    // Q4: its form's (above); Q8: (K / 32, 16) fp16; Q6: d (K / 256, 16) fp16
  const void* lows;      // Q4: its form's
  const float* f32() const { return static_cast<const float*>(scales); }
  const uint16_t* f16() const { return static_cast<const uint16_t*>(scales); }
};

// 4 consecutive int8 codes as one 32-bit lane's bytes (memcpy: the codes are int8, read as int32)
struct Quad {
  const int8_t* codes;
  int32_t operator[](int k) const {
    int32_t four;
    std::memcpy(&four, codes + 4 * k, sizeof four);
    return four;
  }
};

struct Rows {
  const int8_t* codes;  // (M, K)
  const float* scale;   // (M, K / 32)
  const float* sum;     // (M, K / 32)
  int64_t M, K;
  const int32_t* halves = nullptr;  // Q6: (M, K / 32, 2) the codes' sums over inputs 0..15 and 16..31
};

// Asks the caches for the codes, scales and lows (Q4) of the group PREFETCH_BYTES of
// codes ahead: past a tile's end that is the thread's next tile (a chunk of for_tiles is consecutive in
// memory). Why: the hardware's prefetcher alone left each product waiting on memory, more so with
// other ops between the products, as in a step (measured: BENCHMARKS.md). A prefetch never
// faults, so the last groups may ask past the end of the weight.
// Into the second-level cache (PREFETCHT1), not the first: a one-row step then streams at the
// memory's rate, which into the first it did not (BENCHMARKS.md).
// SCALE_BYTES, OTHER_BYTES: the bytes per group of w.scales and of per_output (for Q4_K's lows, one
// eighth of a super-block's).
constexpr int INTO_L2 = 2;  // __builtin_prefetch's locality for PREFETCHT1
template <int TILE_BYTES, int SCALE_BYTES = OUT * 4, int OTHER_BYTES = OUT * 4>
inline void prefetch_group(const Tile& w, const void* per_output, int64_t g) {
  constexpr int64_t ahead = PREFETCH_BYTES / TILE_BYTES;  // groups
  // addresses as integers: a pointer past an array's end is undefined, an address is not
  const auto at = [](const void* base, int64_t offset) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset);
  };
  for (int line = 0; line < TILE_BYTES; line += 64) __builtin_prefetch(at(w.codes, (g + ahead) * TILE_BYTES + line), 0, INTO_L2);
  __builtin_prefetch(at(w.scales, (g + ahead) * SCALE_BYTES), 0, INTO_L2);
  if constexpr (OTHER_BYTES > 0) __builtin_prefetch(at(per_output, (g + ahead) * OTHER_BYTES), 0, INTO_L2);
}

// The codes alone PREFETCH_BYTES ahead (Q6: its d, one per 8 groups, is left to the hardware).
template <int TILE_BYTES>
inline void prefetch_codes(const Tile& w, int64_t g) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w.codes) + g * TILE_BYTES + PREFETCH_BYTES;
  for (int line = 0; line < TILE_BYTES; line += 64) __builtin_prefetch(reinterpret_cast<const char*>(ahead + line), 0, INTO_L2);
}

#ifdef LADECHAT_X86
// A Q4 (or Q6) tile's 4-bit codes per 4 inputs c of a group: q[c], 4 bytes per output lane (the
// low nibbles are inputs 0..15, the high ones 16..31). AVX2: the 8 outputs of half h.
__attribute__((target("avx512f,avx512bw")))
inline void nibbles_avx512(const uint8_t* c, __m512i q[8]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_loadu_si512(c + 64 * p);
    q[p] = _mm512_and_si512(v, nibble);
    q[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}

__attribute__((target("avx2")))
inline void nibbles_avx2(const uint8_t* c, int h, __m256i q[8]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p + 32 * h));
    q[p] = _mm256_and_si256(v, nibble);
    q[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  }
}

// A Q5 tile's top bits (bit 4 of each code) into q[c]: the 8 bytes at Q4_TILE + 8 c hold bit 4 j + i
// for input 4 c + i of output j, byte 4 j + i of q[c]'s lanes (a mask register's bit per byte).
__attribute__((target("avx512f,avx512bw")))
inline void top_bits_avx512(const uint8_t* c, __m512i q[8]) {
  for (int k = 0; k < 8; ++k) {
    uint64_t bits;
    std::memcpy(&bits, c + Q4_TILE + 8 * k, sizeof bits);
    q[k] = _mm512_or_si512(q[k], _mm512_maskz_set1_epi8(bits, 0x10));
  }
}

// The same for the 8 outputs of half h: bits 32 h .. 32 h + 31 of each word, one per byte, spread
// by a byte shuffle (byte b takes the bits' byte b / 8) and a test of bit b % 8.
__attribute__((target("avx2")))
inline void top_bits_avx2(const uint8_t* c, int h, __m256i q[8]) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);  // every bit but bit b % 8 of byte b
  const __m256i all = _mm256_set1_epi8(-1), top = _mm256_set1_epi8(0x10);
  for (int k = 0; k < 8; ++k) {
    uint32_t bits;
    std::memcpy(&bits, c + Q4_TILE + 8 * k + 4 * h, sizeof bits);
    const __m256i v = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread), others);
    q[k] = _mm256_or_si256(q[k], _mm256_and_si256(_mm256_cmpeq_epi8(v, all), top));
  }
}

#endif  // LADECHAT_X86
// The scale and low of group g of a Q4 tile for its 16 outputs, as fp32, from each form: the
// values of the fp32 form exactly (an fp16 widens exactly; d * sc and -dmin * m are exact), so the
// kernels compute the same bits from every form.
struct F32Form {
  struct State {};
  static constexpr int SCALE_BYTES = OUT * 4, LOW_BYTES = OUT * 4;
#ifdef LADECHAT_X86
  __attribute__((target("avx512f")))
  static void avx512(const Tile& w, int64_t g, State&, __m512& scale, __m512& low) {
    scale = _mm512_loadu_ps(w.f32() + g * OUT);
    low = _mm512_loadu_ps(static_cast<const float*>(w.lows) + g * OUT);
  }
  __attribute__((target("avx2,fma,f16c")))
  static void avx2(const Tile& w, int64_t g, int h, State&, __m256& scale, __m256& low) {
    scale = _mm256_loadu_ps(w.f32() + g * OUT + 8 * h);
    low = _mm256_loadu_ps(static_cast<const float*>(w.lows) + g * OUT + 8 * h);
  }
#endif
  static void portable(const Tile& w, int64_t g, int j, float& scale, float& low) {
    scale = w.f32()[g * OUT + j];
    low = static_cast<const float*>(w.lows)[g * OUT + j];
  }
};

struct F16Form {
  struct State {};
  static constexpr int SCALE_BYTES = OUT * 2, LOW_BYTES = OUT * 2;
  static const uint16_t* of(const void* p) { return static_cast<const uint16_t*>(p); }
#ifdef LADECHAT_X86
  __attribute__((target("avx512f")))
  static void avx512(const Tile& w, int64_t g, State&, __m512& scale, __m512& low) {
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(of(w.scales) + g * OUT)));
    low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(of(w.lows) + g * OUT)));
  }
  __attribute__((target("avx2,fma,f16c")))
  static void avx2(const Tile& w, int64_t g, int h, State&, __m256& scale, __m256& low) {
    scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(of(w.scales) + g * OUT + 8 * h)));
    low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(of(w.lows) + g * OUT + 8 * h)));
  }
#endif
  static void portable(const Tile& w, int64_t g, int j, float& scale, float& low) {
    scale = static_cast<float>(c10::Half(of(w.scales)[g * OUT + j], c10::Half::from_bits()));
    low = static_cast<float>(c10::Half(of(w.lows)[g * OUT + j], c10::Half::from_bits()));
  }
};

// Q4_0's and Q5_0's own form, the file's bytes: d per group, fp16, and the low d times the tile's
// factor (an int8: -8 for Q4_0, -16 for Q5_0), exact in fp32 (a power of two), so the values of the
// fp16 and fp32 forms' -8 d and -16 d.
struct DForm {
  struct State {};
  static constexpr int SCALE_BYTES = OUT * 2, LOW_BYTES = 0;
  static const uint16_t* of(const void* p) { return static_cast<const uint16_t*>(p); }
  static float factor(const Tile& w) { return static_cast<float>(*static_cast<const int8_t*>(w.lows)); }
#ifdef LADECHAT_X86
  __attribute__((target("avx512f")))
  static void avx512(const Tile& w, int64_t g, State&, __m512& scale, __m512& low) {
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(of(w.scales) + g * OUT)));
    low = _mm512_mul_ps(scale, _mm512_set1_ps(factor(w)));
  }
  __attribute__((target("avx2,fma,f16c")))
  static void avx2(const Tile& w, int64_t g, int h, State&, __m256& scale, __m256& low) {
    scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(of(w.scales) + g * OUT + 8 * h)));
    low = _mm256_mul_ps(scale, _mm256_set1_ps(factor(w)));
  }
#endif
  static void portable(const Tile& w, int64_t g, int j, float& scale, float& low) {
    scale = static_cast<float>(c10::Half(of(w.scales)[g * OUT + j], c10::Half::from_bits()));
    low = scale * factor(w);
  }
};

// The Q4_K form, the file's bytes per weight: per tile and 8 groups (256 inputs), 192 bytes of sc
// and m and 32 fp16 of d and -dmin. Their 256 values v in the order sc of group 0's 16 outputs, ..
// of group 7's, then m likewise: bytes 0..127 hold the low 4 bits of v (low nibble) and of 128 + v
// (high nibble); bytes 128..191, bits 2 s..2 s + 1 of byte b, the top 2 bits of value 64 s + b. So
// four vector ops of a kind widen the 8 groups' values to bytes at once (unpack), and each group's
// then read as in a byte-wide form. The kernels call the form per group, from group 0 on (q4_mm
// never splits K): `State` holds a super's values, unpacked at its first group.
struct KForm {
  static constexpr int SCALE_BYTES = K_SCALE_BYTES, LOW_BYTES = 2 * OUT * 2 / Q6_SUPER;
  struct State {
    alignas(64) uint8_t values[2 * Q6_SUPER * OUT];  // sc then m, 16 per group
    alignas(64) float supers[2 * OUT];                       // d, -dmin
  };
  static const uint8_t* record(const Tile& w, int64_t g) {
    return static_cast<const uint8_t*>(w.scales) + g / Q6_SUPER * Q6_SUPER * K_SCALE_BYTES;
  }
  static const uint16_t* super(const Tile& w, int64_t g) {
    return static_cast<const uint16_t*>(w.lows) + g / Q6_SUPER * 2 * OUT;
  }
#ifdef LADECHAT_X86
  __attribute__((target("avx512f,avx512bw")))
  static void unpack_avx512(const Tile& w, int64_t g, State& st) {
    const uint8_t* r = record(w, g);
    const __m512i low0 = _mm512_loadu_si512(r), low1 = _mm512_loadu_si512(r + 64), top = _mm512_loadu_si512(r + 128);
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits = _mm512_set1_epi8(0x30);
    __m512i* out = reinterpret_cast<__m512i*>(st.values);  // (lambdas do not take the function's target)
    out[0] = _mm512_or_si512(_mm512_and_si512(low0, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 4), bits));
    out[1] = _mm512_or_si512(_mm512_and_si512(low1, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 2), bits));
    out[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low0, 4), nibble), _mm512_and_si512(top, bits));
    out[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low1, 4), nibble), _mm512_and_si512(_mm512_srli_epi16(top, 2), bits));
    const uint16_t* f = super(w, g);
    _mm512_store_ps(st.supers, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f))));
    _mm512_store_ps(st.supers + OUT, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + OUT))));
  }
  __attribute__((target("avx512f,avx512bw")))
  static void avx512(const Tile& w, int64_t g, State& st, __m512& scale, __m512& low) {
    const int64_t sub = g % Q6_SUPER;
    if (sub == 0) unpack_avx512(w, g, st);
    const uint8_t* v = st.values + OUT * sub;
    scale = _mm512_mul_ps(_mm512_load_ps(st.supers), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_load_si128(reinterpret_cast<const __m128i*>(v)))));
    low = _mm512_mul_ps(_mm512_load_ps(st.supers + OUT), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_load_si128(reinterpret_cast<const __m128i*>(v + 8 * OUT)))));
  }
  __attribute__((target("avx2,fma,f16c")))
  static void unpack_avx2(const Tile& w, int64_t g, State& st) {
    const uint8_t* r = record(w, g);
    const __m256i nibble = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const __m256i* in = reinterpret_cast<const __m256i*>(r + 32 * half);
      const __m256i low0 = _mm256_loadu_si256(in), low1 = _mm256_loadu_si256(in + 2), top = _mm256_loadu_si256(in + 4);
      __m256i* out = reinterpret_cast<__m256i*>(st.values + 32 * half);  // value 64 s + 32 half + i at out[2 s][i]
      out[0] = _mm256_or_si256(_mm256_and_si256(low0, nibble), _mm256_and_si256(_mm256_slli_epi16(top, 4), bits));
      out[2] = _mm256_or_si256(_mm256_and_si256(low1, nibble), _mm256_and_si256(_mm256_slli_epi16(top, 2), bits));
      out[4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble), _mm256_and_si256(top, bits));
      out[6] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(top, 2), bits));
    }
    const uint16_t* f = super(w, g);
    for (int q = 0; q < 4; ++q)
      _mm256_store_ps(st.supers + 8 * q, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f + 8 * q))));
  }
  __attribute__((target("avx2,fma,f16c")))
  static void avx2(const Tile& w, int64_t g, int h, State& st, __m256& scale, __m256& low) {
    const int64_t sub = g % Q6_SUPER;
    if (sub == 0 && h == 0) unpack_avx2(w, g, st);
    const uint8_t* v = st.values + OUT * sub + 8 * h;
    scale = _mm256_mul_ps(_mm256_load_ps(st.supers + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)))));
    low = _mm256_mul_ps(_mm256_load_ps(st.supers + OUT + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * OUT)))));
  }
#endif
  // value v (0..255) of the super of group g, from the bytes as they lie
  static int value(const Tile& w, int64_t g, int v) {
    const uint8_t* r = record(w, g);
    const int nibbles = v < 8 * OUT ? r[v] & 0x0F : r[v - 8 * OUT] >> 4;
    return nibbles | ((r[8 * OUT + v % 64] >> (2 * (v / 64))) & 3) << 4;
  }
  static void portable(const Tile& w, int64_t g, int j, float& scale, float& low) {
    const int v = OUT * static_cast<int>(g % Q6_SUPER) + j;
    const uint16_t* f = super(w, g);
    scale = static_cast<float>(c10::Half(f[j], c10::Half::from_bits())) * static_cast<float>(value(w, g, v));
    low = static_cast<float>(c10::Half(f[OUT + j], c10::Half::from_bits())) * static_cast<float>(value(w, g, 8 * OUT + v));
  }
};

// The kernels take R rows of a tile at once (R up to MOST_ROWS, then what is left), each row's 16
// outputs in registers over all K inputs: a group's codes are loaded (and for Q4 unpacked) once
// for the R rows, and the rows' sums never go through memory. The float steps per row are the
// portable path's, in its order.
#ifdef LADECHAT_X86
// TOP: a Q5 tile (codes 0..31: Q4's nibbles and a plane of top bits), else Q4's.
template <typename Form, bool TOP = false>
struct Q4Vnni {
  static constexpr int MOST_ROWS = VNNI_ROWS;
  static constexpr int TILE = TOP ? Q5_TILE : Q4_TILE;
  template <int R>
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const float* sa = x.sum + m0 * G;
    __m512 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
    typename Form::State state;
    for (int64_t g = 0; g < G; ++g) {
      prefetch_group<TILE, Form::SCALE_BYTES, Form::LOW_BYTES>(w, w.lows, g);
      const uint8_t* c = w.codes + g * TILE;
      __m512i q[8];  // q[c]: inputs 4c..4c+3 of the group, 4 bytes per output lane
      nibbles_avx512(c, q);
      if constexpr (TOP) top_bits_avx512(c, q);
      __m512 scale, low;
      Form::avx512(w, g, state, scale, low);
      for (int r = 0; r < R; ++r) {
        const Quad a{codes + r * K + g * GROUP};
        __m512i s0 = _mm512_setzero_si512(), s1 = s0;  // two chains: the sum is exact in any order
        for (int k = 0; k < 8; k += 2) {
          s0 = _mm512_dpbusd_epi32(s0, q[k], _mm512_set1_epi32(a[k]));
          s1 = _mm512_dpbusd_epi32(s1, q[k + 1], _mm512_set1_epi32(a[k + 1]));
        }
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        const __m512 t = _mm512_fmadd_ps(low, _mm512_set1_ps(sa[r * G + g]), _mm512_mul_ps(scale, isum));
        y[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(da[r * G + g]), y[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * OUT, y[r]);
  }
};

// The same arithmetic in two halves of 8 outputs.
template <typename Form, bool TOP = false>
struct Q4Avx2 {
  static constexpr int MOST_ROWS = ROWS_AT_ONCE;
  static constexpr int TILE = TOP ? Q5_TILE : Q4_TILE;
  template <int R>
  __attribute__((target("avx2,fma,f16c")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const float* sa = x.sum + m0 * G;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 y[R][2];
    for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    typename Form::State state;
    for (int64_t g = 0; g < G; ++g) {
      prefetch_group<TILE, Form::SCALE_BYTES, Form::LOW_BYTES>(w, w.lows, g);
      const uint8_t* c = w.codes + g * TILE;
      for (int h = 0; h < 2; ++h) {
        __m256i q[8];
        nibbles_avx2(c, h, q);
        if constexpr (TOP) top_bits_avx2(c, h, q);
        __m256 scale, low;
        Form::avx2(w, g, h, state, scale, low);
        for (int r = 0; r < R; ++r) {
          const Quad a{codes + r * K + g * GROUP};
          // a 16-bit pair sum is 2 products of at most 31 * 127, and two such added: within 16 bits
          __m256i p[4];
          for (int k = 0; k < 4; ++k)
            p[k] = _mm256_add_epi16(_mm256_maddubs_epi16(q[2 * k], _mm256_set1_epi32(a[2 * k])),
                                    _mm256_maddubs_epi16(q[2 * k + 1], _mm256_set1_epi32(a[2 * k + 1])));
          const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                                             _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
          const __m256 t = _mm256_fmadd_ps(low, _mm256_set1_ps(sa[r * G + g]),
                                           _mm256_mul_ps(scale, _mm256_cvtepi32_ps(s)));
          y[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(da[r * G + g]), y[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + (m0 + r) * OUT + 8 * h, y[r][h]);
  }
};

#endif  // LADECHAT_X86
template <typename Form, bool TOP = false>
void q4_tile_portable(const Rows& x, const Tile& w, float* acc) {
  const int64_t G = x.K / GROUP;
  std::fill(acc, acc + x.M * OUT, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = w.codes + g * (TOP ? Q5_TILE : Q4_TILE);
    for (int64_t m = 0; m < x.M; ++m) {
      const int8_t* a = x.codes + m * x.K + g * GROUP;
      for (int j = 0; j < OUT; ++j) {
        int32_t isum = 0;
        for (int k = 0; k < GROUP; ++k) {
          const uint8_t byte = c[64 * (k / 4 % 4) + 4 * j + k % 4];
          int code = k < 16 ? byte & 0x0F : byte >> 4;
          if constexpr (TOP) {
            const int bit = 4 * j + k % 4;
            code |= ((c[Q4_TILE + 8 * (k / 4) + bit / 8] >> (bit % 8)) & 1) << 4;
          }
          isum += code * a[k];
        }
        float scale, low;
        Form::portable(w, g, j, scale, low);
        const float t = std::fma(low, x.sum[m * G + g], scale * static_cast<float>(isum));
        acc[m * OUT + j] = std::fma(t, x.scale[m * G + g], acc[m * OUT + j]);
      }
    }
  }
}

#ifdef LADECHAT_X86
struct Q8Vnni {
  static constexpr int MOST_ROWS = VNNI_ROWS;
  template <int R>
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const __m512i zero = _mm512_setzero_si512();
    __m512 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      prefetch_group<Q8_TILE, OUT * 2, 0>(w, w.scales, g);  // the scales once (no other per-output part)
      const uint8_t* c = w.codes + g * Q8_TILE;
      __m512i size[8];
      __mmask64 negative[8];
      for (int k = 0; k < 8; ++k) {
        const __m512i q = _mm512_loadu_si512(c + 64 * k);
        negative[k] = _mm512_movepi8_mask(q);
        size[k] = _mm512_abs_epi8(q);  // |q|, -128 as 128 unsigned
      }
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.f16() + g * OUT)));
      for (int r = 0; r < R; ++r) {
        const Quad a{codes + r * K + g * GROUP};
        __m512i s0 = _mm512_setzero_si512(), s1 = s0;
        for (int k = 0; k < 8; k += 2) {  // |q| times qa with q's sign: q qa, exactly
          const __m512i a0 = _mm512_set1_epi32(a[k]), a1 = _mm512_set1_epi32(a[k + 1]);
          s0 = _mm512_dpbusd_epi32(s0, size[k], _mm512_mask_sub_epi8(a0, negative[k], zero, a0));
          s1 = _mm512_dpbusd_epi32(s1, size[k + 1], _mm512_mask_sub_epi8(a1, negative[k + 1], zero, a1));
        }
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        y[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, isum), _mm512_set1_ps(da[r * G + g]), y[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * OUT, y[r]);
  }
};

struct Q8Avx2 {
  static constexpr int MOST_ROWS = ROWS_AT_ONCE;
  template <int R>
  __attribute__((target("avx2,fma,f16c")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 y[R][2];
    for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      prefetch_group<Q8_TILE, OUT * 2, 0>(w, w.scales, g);
      const uint8_t* c = w.codes + g * Q8_TILE;
      for (int h = 0; h < 2; ++h) {
        __m256i q[8], size[8];
        for (int k = 0; k < 8; ++k) {
          q[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * k + 32 * h));
          size[k] = _mm256_sign_epi8(q[k], q[k]);  // |q| (-128 reads as 128 unsigned)
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.f16() + g * OUT + 8 * h)));
        for (int r = 0; r < R; ++r) {
          const Quad a{codes + r * K + g * GROUP};
          __m256i s = _mm256_setzero_si256();
          for (int k = 0; k < 8; ++k)  // |q| * (qa with q's sign), pairs in 16 bits, then 32
            s = _mm256_add_epi32(s, _mm256_madd_epi16(
                _mm256_maddubs_epi16(size[k], _mm256_sign_epi8(_mm256_set1_epi32(a[k]), q[k])), ones));
          y[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(s)), _mm256_set1_ps(da[r * G + g]), y[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + (m0 + r) * OUT + 8 * h, y[r][h]);
  }
};

#endif  // LADECHAT_X86
void q8_tile_portable(const Rows& x, const Tile& w, float* acc) {
  const int64_t G = x.K / GROUP;
  std::fill(acc, acc + x.M * OUT, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* c = reinterpret_cast<const int8_t*>(w.codes + g * Q8_TILE);
    for (int64_t m = 0; m < x.M; ++m) {
      const int8_t* a = x.codes + m * x.K + g * GROUP;
      for (int j = 0; j < OUT; ++j) {
        int32_t isum = 0;
        for (int k = 0; k < GROUP; ++k) isum += c[64 * (k / 4) + 4 * j + k % 4] * a[k];
        const float t = static_cast<float>(c10::Half(w.f16()[g * OUT + j], c10::Half::from_bits())) *
                        static_cast<float>(isum);
        acc[m * OUT + j] = std::fma(t, x.scale[m * G + g], acc[m * OUT + j]);
      }
    }
  }
}

// Q6: the 6-bit codes from a tile's nibbles and top bits, per 4 inputs c (0..7), as Q4's q[c].
#ifdef LADECHAT_X86
struct Q6Vnni {
  static constexpr int MOST_ROWS = VNNI_ROWS;
  template <int R>
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const int32_t* halves = x.halves + m0 * G * 2;
    const __m512i top = _mm512_set1_epi8(0x30);
    __m512 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
    __m512 d = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      prefetch_codes<Q6_TILE>(w, g);
      const uint8_t* c = w.codes + g * Q6_TILE;
      __m512i q[8];
      nibbles_avx512(c, q);
      for (int v = 0; v < 2; ++v) {  // bits 2p..2p+1 of each byte to bits 4..5 (16-bit shifts: the mask drops what crosses)
        const __m512i h = _mm512_loadu_si512(c + Q4_TILE + 64 * v);
        q[4 * v] = _mm512_or_si512(q[4 * v], _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
        q[4 * v + 1] = _mm512_or_si512(q[4 * v + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
        q[4 * v + 2] = _mm512_or_si512(q[4 * v + 2], _mm512_and_si512(h, top));
        q[4 * v + 3] = _mm512_or_si512(q[4 * v + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
      }
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q6_TILE - 32)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q6_TILE - 16)));
      if (g % Q6_SUPER == 0)
        d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.f16() + g / Q6_SUPER * OUT)));
      for (int r = 0; r < R; ++r) {
        const Quad a{codes + r * K + g * GROUP};
        __m512i s0 = _mm512_setzero_si512(), s1 = s0;
        for (int k = 0; k < 4; ++k) {
          s0 = _mm512_dpbusd_epi32(s0, q[k], _mm512_set1_epi32(a[k]));
          s1 = _mm512_dpbusd_epi32(s1, q[k + 4], _mm512_set1_epi32(a[k + 4]));
        }
        s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * halves[(r * G + g) * 2]));
        s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * halves[(r * G + g) * 2 + 1]));
        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(sc0, s0), _mm512_mullo_epi32(sc1, s1));
        y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)), _mm512_set1_ps(da[r * G + g]), y[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * OUT, y[r]);
  }
};

struct Q6Avx2 {
  static constexpr int MOST_ROWS = ROWS_AT_ONCE;
  template <int R>
  __attribute__((target("avx2,fma,f16c")))
  static void rows(const Rows& x, const Tile& w, int64_t m0, float* acc) {
    const int64_t K = x.K, G = K / GROUP;
    const int8_t* codes = x.codes + m0 * K;
    const float* da = x.scale + m0 * G;
    const int32_t* halves = x.halves + m0 * G * 2;
    const __m256i top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256 y[R][2];
    for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      prefetch_codes<Q6_TILE>(w, g);
      const uint8_t* c = w.codes + g * Q6_TILE;
      for (int h = 0; h < 2; ++h) {
        __m256i q[8];
        nibbles_avx2(c, h, q);
        for (int v = 0; v < 2; ++v) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + Q4_TILE + 64 * v + 32 * h));
          q[4 * v] = _mm256_or_si256(q[4 * v], _mm256_and_si256(_mm256_slli_epi16(b, 4), top));
          q[4 * v + 1] = _mm256_or_si256(q[4 * v + 1], _mm256_and_si256(_mm256_slli_epi16(b, 2), top));
          q[4 * v + 2] = _mm256_or_si256(q[4 * v + 2], _mm256_and_si256(b, top));
          q[4 * v + 3] = _mm256_or_si256(q[4 * v + 3], _mm256_and_si256(_mm256_srli_epi16(b, 2), top));
        }
        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + Q6_TILE - 32 + 8 * h)));
        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + Q6_TILE - 16 + 8 * h)));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.f16() + g / Q6_SUPER * OUT + 8 * h)));
        for (int r = 0; r < R; ++r) {
          const Quad a{codes + r * K + g * GROUP};
          // a 16-bit pair sum is 2 products of at most 63 * 127, and two such added: within 16 bits
          __m256i p[4];
          for (int k = 0; k < 4; ++k)
            p[k] = _mm256_add_epi16(_mm256_maddubs_epi16(q[2 * k], _mm256_set1_epi32(a[2 * k])),
                                    _mm256_maddubs_epi16(q[2 * k + 1], _mm256_set1_epi32(a[2 * k + 1])));
          __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones));
          __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones));
          s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(32 * halves[(r * G + g) * 2]));
          s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(32 * halves[(r * G + g) * 2 + 1]));
          const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(sc0, s0), _mm256_mullo_epi32(sc1, s1));
          y[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)), _mm256_set1_ps(da[r * G + g]), y[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + (m0 + r) * OUT + 8 * h, y[r][h]);
  }
};

#endif  // LADECHAT_X86
void q6_tile_portable(const Rows& x, const Tile& w, float* acc) {
  const int64_t G = x.K / GROUP;
  std::fill(acc, acc + x.M * OUT, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = w.codes + g * Q6_TILE;
    const int8_t* sc = reinterpret_cast<const int8_t*>(c + Q6_TILE - 32);
    for (int64_t m = 0; m < x.M; ++m) {
      const int8_t* a = x.codes + m * x.K + g * GROUP;
      for (int j = 0; j < OUT; ++j) {
        int32_t half[2] = {0, 0};
        for (int k = 0; k < GROUP; ++k) {
          const int chunk = k / 4, i = k % 4;
          const uint8_t byte = c[64 * (chunk % 4) + 4 * j + i];
          const uint8_t bits = c[Q4_TILE + 64 * (chunk / 4) + 4 * j + i];
          const int q = (chunk < 4 ? byte & 0x0F : byte >> 4) | (((bits >> (2 * (chunk % 4))) & 3) << 4);
          half[k / 16] += q * a[k];
        }
        for (int h = 0; h < 2; ++h) half[h] -= 32 * x.halves[(m * G + g) * 2 + h];
        const int32_t isum = sc[j] * half[0] + sc[OUT + j] * half[1];
        const float t = static_cast<float>(c10::Half(w.f16()[g / Q6_SUPER * OUT + j], c10::Half::from_bits())) *
                        static_cast<float>(isum);
        acc[m * OUT + j] = std::fma(t, x.scale[m * G + g], acc[m * OUT + j]);
      }
    }
  }
}

// The kernel of a tile for `left` rows (1..R), its row count a compile-time constant.
template <typename Kernel, int R>
void rows_left(const Rows& x, const Tile& w, int64_t m, int64_t left, float* acc) {
  if constexpr (R > 0) {
    if (left == R) Kernel::template rows<R>(x, w, m, acc);
    else rows_left<Kernel, R - 1>(x, w, m, left, acc);
  }
}

// A tile for all M rows: Kernel::MOST_ROWS at a time, then the rest in one pass.
template <typename Kernel>
void by_rows(const Rows& x, const Tile& w, float* acc) {
  constexpr int most = Kernel::MOST_ROWS;
  int64_t m = 0;
  for (; m + most <= x.M; m += most) Kernel::template rows<most>(x, w, m, acc);
  rows_left<Kernel, most - 1>(x, w, m, x.M - m, acc);
}

using TileKernel = void (*)(const Rows&, const Tile&, float*);

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t path, int8_t* codes, float* scale, float* sum) {
  const int64_t G = K / GROUP;
  at::parallel_for(0, M, QUANTIZE_GRAIN, [&](int64_t r0, int64_t r1) {
    std::vector<float> row;
    for (int64_t m = r0; m < r1; ++m) {
      const Quantized out{codes + m * K, scale + m * G, sum + m * G};
      if constexpr (std::is_same_v<T, float>) {
#ifdef LADECHAT_X86
        if (path == VNNI) quantize_avx512(x + m * K, K, out);
        else if (path == AVX2) quantize_avx2(x + m * K, K, out);
        else
#endif
          quantize_portable(x + m * K, K, out);
      } else {  // bf16 -> fp32 is exact: the same codes as the fp32 row
        row.resize(K);
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x[m * K + k]);
#ifdef LADECHAT_X86
        if (path == VNNI) quantize_avx512(row.data(), K, out);
        else if (path == AVX2) quantize_avx2(row.data(), K, out);
        else
#endif
          quantize_portable(row.data(), K, out);
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu()
              && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be (rows, in) fp32 or bf16, contiguous, on the CPU");
  TORCH_CHECK(x.size(1) % GROUP == 0, op, ": the inputs must be a multiple of 32");
}

void check_per_tile(const at::Tensor& t, int64_t tiles, int64_t groups, at::ScalarType type, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tiles && t.size(1) == groups && t.size(2) == OUT && t.scalar_type() == type
              && t.is_contiguous() && t.device().is_cpu(), what);
}

// Tiles 0..NB-1 of a product for the threads, in chunks of about CHUNK_BYTES of weights, each thread
// taking the next chunk when done with its last (as llama.cpp shares out rows): a thread the
// hypervisor or another process holds up leaves the rest to the others, where shares fixed in advance
// had the product wait for it at the end. Which thread computes a tile changes nothing in it: one
// thread computes it whole, in one order. work(b0, b1): tiles b0..b1-1.
template <typename Work>
void for_tiles(int64_t NB, int64_t tile_bytes, const Work& work) {
  const int64_t per = std::max<int64_t>(1, CHUNK_BYTES / std::max<int64_t>(1, tile_bytes));
  const int64_t chunks = (NB + per - 1) / per;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) work(c * per, std::min(NB, (c + 1) * per));
  });
}

// The common part of q4_mm and q8_mm: the rows quantized, then tiles of outputs shared out between
// threads (for_tiles: each output computed by one thread, in one order), each tile by `kernel`.
// scales, lows (Q4): per tile along dim 0, contiguous (lows: undefined where unused).
at::Tensor run(const at::Tensor& x, const at::Tensor& codes, int64_t tile_bytes, const at::Tensor& scales,
               const at::Tensor& lows, int64_t path, const TileKernel kernels[3]) {
  TORCH_CHECK(path == PORTABLE || (path == AVX2 && has_avx2()) || (path == VNNI && has_vnni()),
              "blocks: this CPU lacks the instructions of the path asked for");
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP, NB = codes.size(0), N = NB * OUT;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> qa(M * K);
  std::vector<float> da(M * G), sa(M * G);
  if (x.scalar_type() == at::kFloat) quantize_rows(x.data_ptr<float>(), M, K, path, qa.data(), da.data(), sa.data());
  else quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, path, qa.data(), da.data(), sa.data());
  std::vector<int32_t> halves;
  if (tile_bytes == Q6_TILE) {  // each group's two halves' code sums
    halves.resize(M * G * 2);
    for (int64_t i = 0; i < M * G * 2; ++i) {
      int32_t total = 0;
      for (int k = 0; k < GROUP / 2; ++k) total += qa[i * (GROUP / 2) + k];
      halves[i] = total;
    }
  }
  const Rows rows{qa.data(), da.data(), sa.data(), M, K, halves.data()};
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  // each tile's part of scales and lows: where they start, and how many bytes a tile has
  const auto start = [](const at::Tensor& t) { return t.defined() ? static_cast<const char*>(t.data_ptr()) : nullptr; };
  const auto bytes = [NB](const at::Tensor& t) { return t.defined() && NB ? static_cast<int64_t>(t.nbytes()) / NB : 0; };
  const char *sp = start(scales), *lp = start(lows);
  const int64_t s_bytes = bytes(scales), l_bytes = bytes(lows);
  const TileKernel kernel = kernels[path];
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for_tiles(NB, G * tile_bytes, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * OUT);
    for (int64_t b = b0; b < b1; ++b) {
      const Tile tile{cp + b * G * tile_bytes, sp + b * s_bytes, lp ? lp + b * l_bytes : nullptr};
      kernel(rows, tile, acc.data());
      if (bf16) {
        c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < OUT; ++j) yp[m * N + b * OUT + j] = c10::BFloat16(acc[m * OUT + j]);  // nearest even
      } else {
        float* yp = y.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + b * OUT, acc.data() + m * OUT, OUT * sizeof(float));
      }
    }
  });
  return y;
}

// x (M, K) fp32 or bf16 -> y (M, N) in x's dtype. path: 2 VNNI, 1 AVX2, 0 portable (the same results).
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lows,
                 int64_t path) {
  check_rows(x, "q4_mm");
  const int64_t G = x.size(1) / GROUP;
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == G && (codes.size(2) == Q4_TILE || codes.size(2) == Q5_TILE)
              && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "q4_mm: codes must be (out / 16, in / 32, 256, or 320 with top bits) uint8, contiguous, on the CPU");
  const int64_t NB = codes.size(0);
  const bool top = codes.size(2) == Q5_TILE;
  if (scales.scalar_type() == at::kByte) {  // the Q4_K form
    TORCH_CHECK(G % Q6_SUPER == 0, "q4_mm: the Q4_K form needs inputs in multiples of 256");
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == NB && scales.size(1) == G && scales.size(2) == K_SCALE_BYTES
                && scales.is_contiguous() && scales.device().is_cpu(),
                "q4_mm: Q4_K scales must be (out / 16, in / 32, 24) uint8, contiguous, on the CPU");
    TORCH_CHECK(lows.dim() == 3 && lows.size(0) == NB && lows.size(1) == G / Q6_SUPER && lows.size(2) == 2 * OUT
                && lows.scalar_type() == at::kHalf && lows.is_contiguous() && lows.device().is_cpu(),
                "q4_mm: Q4_K lows must be (out / 16, in / 256, 32) fp16, contiguous, on the CPU");
    static const TileKernel kernels[3] = {q4_tile_portable<KForm>, X86_ONLY(by_rows<Q4Avx2<KForm>>), X86_ONLY(by_rows<Q4Vnni<KForm>>)};
    static const TileKernel kernels5[3] = {q4_tile_portable<KForm, true>, X86_ONLY((by_rows<Q4Avx2<KForm, true>>)),
                                           X86_ONLY((by_rows<Q4Vnni<KForm, true>>))};
    return run(x, codes, codes.size(2), scales, lows, path, top ? kernels5 : kernels);
  }
  if (lows.scalar_type() == at::kChar) {  // the Q4_0 / Q5_0 form: d, and a factor per tile
    check_per_tile(scales, NB, G, at::kHalf, "q4_mm: d must be (out / 16, in / 32, 16) fp16, contiguous, on the CPU");
    TORCH_CHECK(lows.dim() == 3 && lows.size(0) == NB && lows.size(1) == 1 && lows.size(2) == 1 && lows.is_contiguous()
                && lows.device().is_cpu(), "q4_mm: the d form's factors must be (out / 16, 1, 1) int8, on the CPU");
    static const TileKernel kernels[3] = {q4_tile_portable<DForm>, X86_ONLY(by_rows<Q4Avx2<DForm>>), X86_ONLY(by_rows<Q4Vnni<DForm>>)};
    static const TileKernel kernels5[3] = {q4_tile_portable<DForm, true>, X86_ONLY((by_rows<Q4Avx2<DForm, true>>)),
                                           X86_ONLY((by_rows<Q4Vnni<DForm, true>>))};
    return run(x, codes, codes.size(2), scales, lows, path, top ? kernels5 : kernels);
  }
  const bool half = scales.scalar_type() == at::kHalf;
  const char* what = "q4_mm: scales and lows must be (out / 16, in / 32, 16), both fp32 or both fp16, contiguous, "
                     "on the CPU";
  check_per_tile(scales, NB, G, half ? at::kHalf : at::kFloat, what);
  check_per_tile(lows, NB, G, half ? at::kHalf : at::kFloat, what);
  if (half) {
    static const TileKernel kernels[3] = {q4_tile_portable<F16Form>, X86_ONLY(by_rows<Q4Avx2<F16Form>>),
                                          X86_ONLY(by_rows<Q4Vnni<F16Form>>)};
    static const TileKernel kernels5[3] = {q4_tile_portable<F16Form, true>, X86_ONLY((by_rows<Q4Avx2<F16Form, true>>)),
                                           X86_ONLY((by_rows<Q4Vnni<F16Form, true>>))};
    return run(x, codes, codes.size(2), scales, lows, path, top ? kernels5 : kernels);
  }
  static const TileKernel kernels[3] = {q4_tile_portable<F32Form>, X86_ONLY(by_rows<Q4Avx2<F32Form>>), X86_ONLY(by_rows<Q4Vnni<F32Form>>)};
  static const TileKernel kernels5[3] = {q4_tile_portable<F32Form, true>, X86_ONLY((by_rows<Q4Avx2<F32Form, true>>)),
                                         X86_ONLY((by_rows<Q4Vnni<F32Form, true>>))};
  return run(x, codes, codes.size(2), scales, lows, path, top ? kernels5 : kernels);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t path) {
  check_rows(x, "q8_mm");
  const int64_t G = x.size(1) / GROUP;
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == G && codes.size(2) == Q8_TILE
              && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.device().is_cpu(),
              "q8_mm: codes must be (out / 16, in / 32, 512) int8, contiguous, on the CPU");
  check_per_tile(scales, codes.size(0), G, at::kHalf,
                 "q8_mm: scales must be (out / 16, in / 32, 16) fp16, contiguous, on the CPU");
  static const TileKernel kernels[3] = {q8_tile_portable, X86_ONLY(by_rows<Q8Avx2>), X86_ONLY(by_rows<Q8Vnni>)};
  return run(x, codes, Q8_TILE, scales, at::Tensor(), path, kernels);
}

// d: (out / 16, in / 256, 16) fp16 (the file's); the inputs a multiple of 256.
at::Tensor q6_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, int64_t path) {
  check_rows(x, "q6_mm");
  TORCH_CHECK(x.size(1) % (GROUP * Q6_SUPER) == 0, "q6_mm: the inputs must be a multiple of 256");
  const int64_t G = x.size(1) / GROUP;
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == G && codes.size(2) == Q6_TILE
              && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "q6_mm: codes must be (out / 16, in / 32, 416) uint8, contiguous, on the CPU");
  check_per_tile(d, codes.size(0), G / Q6_SUPER, at::kHalf,
                 "q6_mm: d must be (out / 16, in / 256, 16) fp16, contiguous, on the CPU");
  static const TileKernel kernels[3] = {q6_tile_portable, X86_ONLY(by_rows<Q6Avx2>), X86_ONLY(by_rows<Q6Vnni>)};
  return run(x, codes, Q6_TILE, d, at::Tensor(), path, kernels);
}

}  // namespace

// -- F16 and BF16 weights at their own 16 bits -----------------------------------------------------
//
// y = x W^T with W (N, K) as the file holds it, fp16 or bf16, each weight widened exactly to fp32
// as it is read, and x's rows in fp32 (bf16 rows widened): the weights' bytes are what a step
// streams (2 a weight, half of fp32's), and nothing is rounded but the fp32 sums. Per output, 16
// partial sums (lane l takes inputs k = l mod 16, in order, one fma each), then added pairwise:
// lane l + 8, then + 4, + 2, + 1. The same steps on every path (AVX-512: one register, AVX2: two,
// portable: an array), so a row's outputs have the same bits alone or among a step's rows, on any
// thread count and path.

namespace {

constexpr int LANES = 16;

template <bool BF16>
inline float widen(uint16_t h) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
}

inline float fold(float v[LANES]) {
  for (int width = LANES / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) v[l] += v[l + width];
  return v[0];
}

// R rows (m0 ..) of x (fp32, K a row) against the 16 weight rows at w: acc (M, 16).
template <bool BF16>
void half_tile_portable(const float* x, int64_t M, int64_t K, const uint16_t* w, float* acc) {
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < OUT; ++j) {
      float s[LANES] = {};
      for (int64_t k = 0; k < K; ++k) s[k % LANES] = std::fma(widen<BF16>(w[j * K + k]), x[m * K + k], s[k % LANES]);
      acc[m * OUT + j] = fold(s);
    }
}

#ifdef LADECHAT_X86
// The 8 sums of lanes l and l + 8 -> fold's result: + 4, + 2, + 1, as fold adds them.
__attribute__((target("avx2")))
inline float fold_eight(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // l + 4
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                  // l + 2
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));                              // l + 1
}

template <bool BF16>
struct HalfAvx512 {
  __attribute__((target("avx512f,avx512dq")))
  static __m512 load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
  __attribute__((target("avx512f,avx512dq")))
  static float sum(__m512 v) {
    return fold_eight(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));  // l + 8
  }
  template <int R>
  __attribute__((target("avx512f,avx512dq")))
  static void rows(const float* x, int64_t K, const uint16_t* w, int64_t m0, float* acc) {
    for (int j = 0; j < OUT; ++j) {
      __m512 s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += LANES) {
        const __m512 weights = load(w + j * K + k);
        for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(x + (m0 + r) * K + k), s[r]);
      }
      for (int r = 0; r < R; ++r) acc[(m0 + r) * OUT + j] = sum(s[r]);
    }
  }
};

template <bool BF16>
struct HalfAvx2 {
  __attribute__((target("avx2,fma,f16c")))
  static __m256 load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
  __attribute__((target("avx2,fma,f16c")))
  static float sum(__m256 low, __m256 high) { return fold_eight(_mm256_add_ps(low, high)); }  // l + 8
  template <int R>
  __attribute__((target("avx2,fma,f16c")))
  static void rows(const float* x, int64_t K, const uint16_t* w, int64_t m0, float* acc) {
    for (int j = 0; j < OUT; ++j) {
      __m256 lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += LANES) {
        const __m256 w0 = load(w + j * K + k), w1 = load(w + j * K + k + 8);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + (m0 + r) * K + k;
          lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), lo[r]);
          hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), hi[r]);
        }
      }
      for (int r = 0; r < R; ++r) acc[(m0 + r) * OUT + j] = sum(lo[r], hi[r]);
    }
  }
};

// All M rows of a tile: 4 at a time (each weight read once for the 4), then the 1-3 left.
template <typename Kernel>
void half_by_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, float* acc) {
  static_assert(ROWS_AT_ONCE == 4, "the rest below is 1-3 rows");
  int64_t m = 0;
  for (; m + ROWS_AT_ONCE <= M; m += ROWS_AT_ONCE) Kernel::template rows<ROWS_AT_ONCE>(x, K, w, m, acc);
  switch (M - m) {
    case 1: Kernel::template rows<1>(x, K, w, m, acc); break;
    case 2: Kernel::template rows<2>(x, K, w, m, acc); break;
    case 3: Kernel::template rows<3>(x, K, w, m, acc); break;
    default: break;
  }
}
#endif  // LADECHAT_X86

using HalfKernel = void (*)(const float*, int64_t, int64_t, const uint16_t*, float*);

// x (M, K) fp32 or bf16, w (N, K) fp16 or bf16 -> y (M, N) in x's dtype. path: as q4_mm's.
at::Tensor half_mm(const at::Tensor& x, const at::Tensor& w, int64_t path) {
  check_rows(x, "half_mm");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16) && w.is_contiguous()
              && w.device().is_cpu() && w.size(1) == x.size(1) && w.size(0) % OUT == 0,
              "half_mm: w must be (out, in) fp16 or bf16, contiguous, on the CPU, out a multiple of 16");
  TORCH_CHECK(path == PORTABLE || (path == AVX2 && has_avx2()) || (path == VNNI && has_vnni()),
              "blocks: this CPU lacks the instructions of the path asked for");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), NB = N / OUT;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor rows = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // bf16 -> fp32: exact
  const float* xp = rows.data_ptr<float>();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  static const HalfKernel fp16_kernels[3] = {half_tile_portable<false>, X86_ONLY(half_by_rows<HalfAvx2<false>>),
                                             X86_ONLY(half_by_rows<HalfAvx512<false>>)};
  static const HalfKernel bf16_kernels[3] = {half_tile_portable<true>, X86_ONLY(half_by_rows<HalfAvx2<true>>),
                                             X86_ONLY(half_by_rows<HalfAvx512<true>>)};
  const HalfKernel kernel = (bf16 ? bf16_kernels : fp16_kernels)[path];
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  c10::BFloat16* y_bf16 = x.scalar_type() == at::kBFloat16 ? y.data_ptr<c10::BFloat16>() : nullptr;
  float* y_fp32 = y_bf16 ? nullptr : y.data_ptr<float>();
  for_tiles(NB, OUT * K * 2, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * OUT);
    for (int64_t b = b0; b < b1; ++b) {
      kernel(xp, M, K, wp + b * OUT * K, acc.data());
      for (int64_t m = 0; m < M; ++m) {
        if (y_bf16)
          for (int j = 0; j < OUT; ++j) y_bf16[m * N + b * OUT + j] = c10::BFloat16(acc[m * OUT + j]);  // nearest even
        else
          std::memcpy(y_fp32 + m * N + b * OUT, acc.data() + m * OUT, OUT * sizeof(float));
      }
    }
  });
  return y;
}

}  // namespace

// -- a GGUF's blocks into the tiles above, at a model's first use ---------------------------------
//
// The same bytes q4.layout / q4.layout_k / q6.layout make from decoded codes (tests/kernels/test_q6.py
// compares them for every kind), straight from the file's blocks, a word at a time, where numpy
// decoded every code to a byte and reshaped them. The scales, lows and d stay numpy's (a 32nd of the bytes).

namespace {

enum BlockKind : int64_t { Q4_0 = 0, Q4_1 = 1, Q4_K = 2, Q6_K = 3, Q5_0 = 4, Q5_1 = 5, Q5_K = 6 };

// Bytes a block, and where in it the low 4 bits of its codes begin (Q4_0-like: 16 bytes a group).
constexpr int64_t block_bytes(int64_t kind) {
  return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : kind == Q4_K ? 144 : kind == Q6_K ? 210 : kind == Q5_0 ? 22
         : kind == Q5_1 ? 24 : 176;
}

// Tile bytes 64 p + 4 j .. + 3 for the row `row`, group g: the low 4 bits of the codes of inputs
// 4 p + i in the low nibbles, of 16 + 4 p + i in the high ones, four bytes at once. Q4_0 and Q4_1
// hold their nibbles so already; Q4_K's group 2c + h is nibble h of its 32-byte chunk c; Q6_K's
// group of 32 is nibble m / 2 of the 32 bytes at 64 half + 32 (m % 2) of its ql (weights
// 128 half + 32 m + l, the layout gguf's dequantize reads).
inline void tile_word(const uint8_t* row, int64_t kind, int64_t g, int p, uint8_t* out) {
  constexpr uint32_t LOW = 0x0F0F0F0Fu;
  if (kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1) {  // Q5_0, Q5_1: after d (m) and qh
    const int64_t at = kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : kind == Q5_0 ? 6 : 8;
    std::memcpy(out, row + g * block_bytes(kind) + at + 4 * p, 4);
    return;
  }
  const int64_t sub = g % Q6_SUPER;
  const uint8_t* qs;
  int shift;
  if (kind == Q4_K || kind == Q5_K) {  // Q5_K: Q4_K's header, then 32 bytes of top bits
    qs = row + (g / Q6_SUPER) * block_bytes(kind) + (kind == Q4_K ? 16 : 48) + 32 * (sub / 2);
    shift = 4 * (sub % 2);
  } else {  // Q6_K's low 4 bits: the 32 weights of group `sub` share their half and quarter m
    const int64_t half = sub / 4, m = sub % 4;
    qs = row + (g / Q6_SUPER) * 210 + 64 * half + 32 * (m % 2);
    shift = 4 * (m / 2);
  }
  uint32_t first, second;  // inputs 4 p .. 4 p + 3 and 16 + 4 p ..
  std::memcpy(&first, qs + 4 * p, 4);
  std::memcpy(&second, qs + 16 + 4 * p, 4);
  const uint32_t word = ((first >> shift) & LOW) | (((second >> shift) & LOW) << 4);
  std::memcpy(out, &word, 4);
}

// Q6_K tile bytes 256 + 64 v + 4 j .. + 3 for the row `row`, group g: bits 2 p of byte i hold the
// top 2 bits of input 16 v + 4 p + i.
inline void q6_top_word(const uint8_t* row, int64_t g, int v, uint8_t* out) {
  const int64_t sub = g % Q6_SUPER, half = sub / 4, m = sub % 4;
  const uint8_t* qh = row + (g / Q6_SUPER) * 210 + 128 + 32 * half + 16 * v;
  uint32_t word = 0;
  for (int p = 0; p < 4; ++p) {
    uint32_t top;
    std::memcpy(&top, qh + 4 * p, 4);
    word |= ((top >> (2 * m)) & 0x03030303u) << (2 * p);
  }
  std::memcpy(out, &word, 4);
}

// The top bits (bit 4 of each code) of group g of the row `row`, bit k for input k: Q5_0's and
// Q5_1's qh as it is (a little-endian uint32); Q5_K's bit `sub` of qh's byte k, its group `sub`.
inline uint32_t q5_top_bits(const uint8_t* row, int64_t kind, int64_t g) {
  uint32_t bits = 0;
  if (kind != Q5_K) {
    std::memcpy(&bits, row + g * block_bytes(kind) + (kind == Q5_0 ? 2 : 4), 4);
    return bits;
  }
  const int64_t sub = g % Q6_SUPER;
  const uint8_t* qh = row + (g / Q6_SUPER) * 176 + 16;
  for (int k = 0; k < GROUP; ++k) bits |= static_cast<uint32_t>((qh[k] >> sub) & 1) << k;
  return bits;
}

// Q5 tile bytes Q4_TILE + 8 c .. + 7: bit 4 j + i holds the top bit of input 4 c + i of output j.
inline void q5_top_plane(const uint32_t bits[OUT], uint8_t* out) {
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < OUT; j += 2)
      out[8 * c + j / 2] = static_cast<uint8_t>(((bits[j] >> (4 * c)) & 0xF) | (((bits[j + 1] >> (4 * c)) & 0xF) << 4));
}

// order: the file's row of each output row (llama.cpp's q and k rows are permuted), or none; out:
// where the tiles go (a part of one allocation for all of a model's tiles), or none for a new tensor.
at::Tensor gguf_tiles(const at::Tensor& data, int64_t kind, int64_t rows, int64_t cols,
                      const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& into) {
  TORCH_CHECK(kind >= Q4_0 && kind <= Q5_K, "gguf_tiles: unknown block kind");
  const int64_t weights = kind == Q4_K || kind == Q6_K || kind == Q5_K ? 256 : 32;
  const int64_t bytes = block_bytes(kind);
  const bool five = kind == Q5_0 || kind == Q5_1 || kind == Q5_K;
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu()
              && rows % OUT == 0 && cols % weights == 0 && data.size(0) == rows && data.size(1) == cols / weights * bytes,
              "gguf_tiles: the blocks must be (rows, bytes a row) uint8, contiguous, rows a multiple of 16");
  const int64_t tiles = rows / OUT, groups = cols / GROUP, tile_bytes = kind == Q6_K ? Q6_TILE : five ? Q5_TILE : Q4_TILE;
  TORCH_CHECK(!order || (order->scalar_type() == at::kLong && order->dim() == 1 && order->numel() == rows
                         && order->is_contiguous() && order->device().is_cpu()),
              "gguf_tiles: the order must be one int64 file row per row");
  const int64_t* file_row = order ? order->data_ptr<int64_t>() : nullptr;
  if (file_row)
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(file_row[r] >= 0 && file_row[r] < rows, "gguf_tiles: a row out of range");
  TORCH_CHECK(!into || (into->scalar_type() == at::kByte && into->is_contiguous() && into->device().is_cpu()
                        && into->numel() == tiles * groups * tile_bytes),
              "gguf_tiles: the output must be contiguous uint8 of the tiles' size");
  at::Tensor out = into ? into->view({tiles, groups, tile_bytes}) : at::empty({tiles, groups, tile_bytes}, data.options());
  const uint8_t* in = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = data.size(1);
  const auto source = [&](int64_t r) { return in + (file_row ? file_row[r] : r) * row_bytes; };
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* tile = dst + (t * groups + g) * tile_bytes;
        uint32_t top[OUT];
        for (int j = 0; j < OUT; ++j) {  // four bytes of output j at a time: a word of the group's codes
          const uint8_t* row = source(t * OUT + j);
          for (int p = 0; p < 4; ++p) tile_word(row, kind, g, p, tile + 64 * p + 4 * j);
          if (kind == Q6_K)
            for (int v = 0; v < 2; ++v) q6_top_word(row, g, v, tile + Q4_TILE + 64 * v + 4 * j);
          if (five) top[j] = q5_top_bits(row, kind, g);
        }
        if (five) q5_top_plane(top, tile + Q4_TILE);
        if (kind != Q6_K) continue;
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < OUT; ++j) {
            const uint8_t* block = source(t * OUT + j) + (g / Q6_SUPER) * 210;
            tile[Q4_TILE + 128 + 16 * h + j] = block[192 + 2 * (g % Q6_SUPER) + h];
          }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ladechat_blocks, m) {
  m.def("gguf_tiles(Tensor data, int kind, int rows, int cols, Tensor? order, Tensor(a!)? into) -> Tensor", &gguf_tiles);
  m.def("q4_mm(Tensor x, Tensor codes, Tensor scales, Tensor lows, int path) -> Tensor", &q4_mm);
  m.def("q8_mm(Tensor x, Tensor codes, Tensor scales, int path) -> Tensor", &q8_mm);
  m.def("q6_mm(Tensor x, Tensor codes, Tensor d, int path) -> Tensor", &q6_mm);
  m.def("half_mm(Tensor x, Tensor w, int path) -> Tensor", &half_mm);
  m.def("best_path() -> int", &best_path);
}
