// NF4 (4-bit NormalFloat, Dettmers et al. 2023, "QLoRA") block-wise quantization of frozen
// weights, in bitsandbytes' layout: blocks of `blocksize` consecutive elements, one fp32 absmax
// per block; each element is the index (0..15) of the nearest of the 16 NF4 levels to
// x / absmax; two codes per byte, the even element in the high nibble (bitsandbytes packs them
// so). Dequantization: value = level[code] * absmax (one fp32 product, as bitsandbytes).
//
// Quantization (at fill time): x * (1 / absmax) compared with the 15 fp32 midpoints between
// neighbouring levels (a value above a midpoint takes the upper level); NaN -> code 7 (0.0).
// Dequantization (at fetch, the hot path): scalar, AVX2 (two 8-entry vpermps per 8 values and a
// blend on the code's high bit) and AVX-512 (one 16-entry vpermps); bf16 output on both vector
// paths by byte shuffles of a per-block table (pshufb); chosen at run time like the
// Adam kernels (inf_cpu_capability(), INFINITY_CPU_CAPABILITY); threads split on block
// boundaries. Every path computes the same fp32 product, so they agree bitwise. Output fp32 or
// bf16 (round to nearest even, the product rounded once more).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_common.h"
#include "common.h"

namespace {

using inf_adam::f32_to_bf16;
using inf_adam::kAVX2;
using inf_adam::kAVX512;
using inf_adam::kScalar;

// bitsandbytes' NF4 levels (its kernels' float constants), ascending.
alignas(64) constexpr float kLevels[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

constexpr int kOk = 0;
constexpr int kErrNull = -1;
constexpr int kErrLength = -4;
constexpr int kErrBlocksize = -7;
constexpr int kErrDtype = -3;
constexpr int kOutF32 = 0;
constexpr int kOutBF16 = 1;

std::atomic<int64_t> g_calls[2][3];  // [quantize, dequantize][capability]

constexpr float midpoint(int i) {  // between level i and i + 1, in double, rounded once
  return static_cast<float>(0.5 * (static_cast<double>(kLevels[i]) + kLevels[i + 1]));
}

// the midpoints as a table built at compile time (the comparisons below unroll over it)
struct Midpoints {
  float v[15];
  constexpr Midpoints() : v() {
    for (int i = 0; i < 15; ++i) v[i] = midpoint(i);
  }
};
constexpr Midpoints kMid{};

inline int nearest_level(float y) {  // #{midpoints < y}: above a midpoint takes the upper level
  if (std::isnan(y)) return 7;
  int code = 0;
  for (int i = 0; i < 15; ++i) code += y > kMid.v[i] ? 1 : 0;
  return code;
}

struct Job {
  const float* x = nullptr;
  const uint8_t* codes_in = nullptr;
  const float* absmax_in = nullptr;
  uint8_t* codes = nullptr;
  float* absmax = nullptr;
  void* out = nullptr;
  int out_dtype = kOutF32;
  int64_t n = 0;
  int64_t blocksize = 64;
  int cap = kScalar;
  std::vector<int64_t> bounds;  // task t: blocks [bounds[t], bounds[t+1])
};

// Element i's code (nibble) in the packed array.
inline int code_at(const uint8_t* packed, int64_t i) {
  const uint8_t b = packed[i >> 1];
  return (i & 1) ? (b & 0x0F) : (b >> 4);
}

void quantize_blocks(const Job& job, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * job.blocksize;
    const int64_t i1 = std::min(job.n, i0 + job.blocksize);
    float mx = 0.f;
    bool nan = false;
    for (int64_t i = i0; i < i1; ++i) {
      const float a = std::fabs(job.x[i]);
      if (std::isnan(a)) {
        nan = true;
      } else if (a > mx) {
        mx = a;
      }
    }
    const float scale = nan ? std::nanf("") : mx;
    job.absmax[b] = scale;
    const float inv = scale > 0.f ? 1.0f / scale : 0.f;
    const bool ok = scale > 0.f && std::isfinite(scale);
    // i0 is even (blocks hold an even count): whole bytes, the even element in the high nibble
    int64_t i = i0;
    for (; i + 1 < i1; i += 2) {
      const int hi = ok ? nearest_level(job.x[i] * inv) : 7;
      const int lo = ok ? nearest_level(job.x[i + 1] * inv) : 7;
      job.codes[i >> 1] = static_cast<uint8_t>((hi << 4) | lo);
    }
    if (i < i1) {  // the last element of an odd count: its byte's low nibble stays 0
      const int hi = ok ? nearest_level(job.x[i] * inv) : 7;
      job.codes[i >> 1] = static_cast<uint8_t>(hi << 4);
    }
  }
}

inline void store_scalar(void* out, int dtype, int64_t i, float v) {
  if (dtype == kOutF32) {
    static_cast<float*>(out)[i] = v;
  } else {
    static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
  }
}

void dequantize_scalar(const Job& job, int64_t i0, int64_t i1, float scale) {
  for (int64_t i = i0; i < i1; ++i) {
    store_scalar(job.out, job.out_dtype, i, kLevels[code_at(job.codes_in, i)] * scale);
  }
}

// 16 codes of 8 packed bytes at element i (i even) -> two __m256i of 8 int32 codes each.
INF_TARGET_AVX2 inline void avx2_unpack16(const uint8_t* packed, int64_t i, __m256i& lo,
                                          __m256i& hi) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + (i >> 1)));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i inter = _mm_unpacklo_epi8(high, low);  // element order: hi0 lo0 hi1 lo1 ...
  lo = _mm256_cvtepu8_epi32(inter);
  hi = _mm256_cvtepu8_epi32(_mm_srli_si128(inter, 8));
}

INF_TARGET_AVX2 inline __m256 avx2_levels(__m256i code) {
  const __m256 lo = _mm256_load_ps(kLevels);
  const __m256 hi = _mm256_load_ps(kLevels + 8);
  const __m256 a = _mm256_permutevar8x32_ps(lo, code);
  const __m256 b = _mm256_permutevar8x32_ps(hi, code);
  const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));  // bit 3 -> sign bit
  return _mm256_blendv_ps(a, b, upper);
}

INF_TARGET_AVX2 inline void avx2_store(void* out, int dtype, int64_t i, __m256 v) {
  if (dtype == kOutF32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     inf_adam::avx2_f32_to_bf16(v));
  }
}

INF_TARGET_AVX2 void dequantize_avx2(const Job& job, int64_t i0, int64_t i1, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = i0;
  if (i & 1) {  // odd start (a block size that is odd): one element to reach a byte boundary
    store_scalar(job.out, job.out_dtype, i, kLevels[code_at(job.codes_in, i)] * scale);
    ++i;
  }
  for (; i + 16 <= i1; i += 16) {
    __m256i lo, hi;
    avx2_unpack16(job.codes_in, i, lo, hi);
    avx2_store(job.out, job.out_dtype, i, _mm256_mul_ps(avx2_levels(lo), s));
    avx2_store(job.out, job.out_dtype, i + 8, _mm256_mul_ps(avx2_levels(hi), s));
  }
  dequantize_scalar(job, i, i1, scale);
}

INF_TARGET_AVX512 void dequantize_avx512(const Job& job, int64_t i0, int64_t i1, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 levels = _mm512_load_ps(kLevels);
  int64_t i = i0;
  if (i & 1) {
    store_scalar(job.out, job.out_dtype, i, kLevels[code_at(job.codes_in, i)] * scale);
    ++i;
  }
  for (; i + 16 <= i1; i += 16) {
    const __m128i bytes =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(job.codes_in + (i >> 1)));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m512i code = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(high, low));
    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(code, levels), s);
    if (job.out_dtype == kOutF32) {
      _mm512_storeu_ps(static_cast<float*>(job.out) + i, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(job.out) + i),
                          inf_adam::avx512_f32_to_bf16(v));
    }
  }
  dequantize_scalar(job, i, i1, scale);
}

// bf16 output by byte shuffles: a block's 16 possible outputs (level * absmax, rounded to bf16
// once, as the other paths) split into a low-byte and a high-byte table; 16 codes look up both
// with pshufb and interleave into 16 bf16 values. The same bits as the arithmetic paths.
INF_TARGET_AVX2 void dequantize_bf16_shuffle(const Job& job, int64_t i0, int64_t i1,
                                             float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m128i b0 = inf_adam::avx2_f32_to_bf16(_mm256_mul_ps(_mm256_load_ps(kLevels), s));
  const __m128i b1 = inf_adam::avx2_f32_to_bf16(_mm256_mul_ps(_mm256_load_ps(kLevels + 8), s));
  const __m128i byte = _mm_set1_epi16(0xFF);
  const __m128i lo_t = _mm_packus_epi16(_mm_and_si128(b0, byte), _mm_and_si128(b1, byte));
  const __m128i hi_t = _mm_packus_epi16(_mm_srli_epi16(b0, 8), _mm_srli_epi16(b1, 8));
  const __m128i nib = _mm_set1_epi8(0x0F);
  uint16_t* out = static_cast<uint16_t*>(job.out);
  int64_t i = i0;
  if (i & 1) {
    store_scalar(job.out, job.out_dtype, i, kLevels[code_at(job.codes_in, i)] * scale);
    ++i;
  }
  for (; i + 32 <= i1; i += 32) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(job.codes_in + (i >> 1)));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
    const __m128i low = _mm_and_si128(bytes, nib);
    const __m128i c0 = _mm_unpacklo_epi8(high, low);  // codes of elements i .. i+15
    const __m128i c1 = _mm_unpackhi_epi8(high, low);  // i+16 .. i+31
    const __m128i l0 = _mm_shuffle_epi8(lo_t, c0), h0 = _mm_shuffle_epi8(hi_t, c0);
    const __m128i l1 = _mm_shuffle_epi8(lo_t, c1), h1 = _mm_shuffle_epi8(hi_t, c1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi8(l0, h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 8), _mm_unpackhi_epi8(l0, h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 16), _mm_unpacklo_epi8(l1, h1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 24), _mm_unpackhi_epi8(l1, h1));
  }
  dequantize_scalar(job, i, i1, scale);
}

void dequantize_blocks(const Job& job, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * job.blocksize;
    const int64_t i1 = std::min(job.n, i0 + job.blocksize);
    const float scale = job.absmax_in[b];
    if (job.cap != kScalar && job.out_dtype == kOutBF16) {
      dequantize_bf16_shuffle(job, i0, i1, scale);
    } else if (job.cap == kAVX512) {
      dequantize_avx512(job, i0, i1, scale);
    } else if (job.cap == kAVX2) {
      dequantize_avx2(job, i0, i1, scale);
    } else {
      dequantize_scalar(job, i0, i1, scale);
    }
  }
}

void run(Job& job, void (*range)(const Job&, int64_t, int64_t)) {
  const int64_t blocks = (job.n + job.blocksize - 1) / job.blocksize;
  int64_t tasks = job.n >= (1 << 18) ? std::max(1, inf_get_num_threads()) : 1;
  // task boundaries on even blocks: two tasks never write the same packed byte
  tasks = std::min<int64_t>(tasks, std::max<int64_t>(1, blocks / 2));
  job.bounds.resize(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) job.bounds[t] = (blocks * t / tasks) & ~int64_t{1};
  job.bounds[tasks] = blocks;
  struct Ctx {
    Job* job;
    void (*range)(const Job&, int64_t, int64_t);
  } ctx{&job, range};
  if (tasks <= 1) {
    range(job, 0, blocks);
    return;
  }
  inf_cpu::run_on_pool(
      static_cast<int>(tasks),
      [](void* c, int t) {
        const Ctx& x = *static_cast<const Ctx*>(c);
        x.range(*x.job, x.job->bounds[t], x.job->bounds[t + 1]);
      },
      &ctx);
}

}  // namespace

// The 16 NF4 levels (fp32, ascending) into out[16].
INF_API int inf_nf4_levels(float* out) {
  if (out == nullptr) return kErrNull;
  std::memcpy(out, kLevels, sizeof(kLevels));
  return kOk;
}

// Quantizes n fp32 values: absmax[ceil(n / blocksize)], packed codes[ceil(n / 2)] (high nibble
// first). blocksize: a positive even number (bitsandbytes: 64 .. 4096).
INF_API int inf_nf4_quantize(const float* x, int64_t n, int64_t blocksize, uint8_t* codes,
                             float* absmax) {
  if (n < 0) return kErrLength;
  if (blocksize <= 0 || (blocksize & 1)) return kErrBlocksize;
  if (n == 0) return kOk;
  if (x == nullptr || codes == nullptr || absmax == nullptr) return kErrNull;
  const int cap = inf_cpu_capability();
  g_calls[0][cap].fetch_add(1, std::memory_order_relaxed);
  if (n & 1) codes[n >> 1] = 0;  // the unused low nibble of an odd count
  Job job;
  job.x = x;
  job.codes = codes;
  job.absmax = absmax;
  job.n = n;
  job.blocksize = blocksize;
  job.cap = cap;
  run(job, &quantize_blocks);
  return kOk;
}

// Dequantizes n values into out (out_dtype 0: fp32, 1: bf16): level[code] * absmax[block].
INF_API int inf_nf4_dequantize(const uint8_t* codes, const float* absmax, int64_t n,
                               int64_t blocksize, void* out, int out_dtype) {
  if (n < 0) return kErrLength;
  if (blocksize <= 0 || (blocksize & 1)) return kErrBlocksize;
  if (out_dtype != kOutF32 && out_dtype != kOutBF16) return kErrDtype;
  if (n == 0) return kOk;
  if (codes == nullptr || absmax == nullptr || out == nullptr) return kErrNull;
  const int cap = inf_cpu_capability();
  g_calls[1][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.codes_in = codes;
  job.absmax_in = absmax;
  job.out = out;
  job.out_dtype = out_dtype;
  job.n = n;
  job.blocksize = blocksize;
  job.cap = cap;
  run(job, &dequantize_blocks);
  return kOk;
}

// Calls of kernel (0 quantize, 1 dequantize) that ran on each capability.
INF_API int64_t inf_nf4_calls(int kernel, int capability) {
  if (kernel < 0 || kernel > 1 || capability < kScalar || capability > kAVX512) return -1;
  return g_calls[kernel][capability].load();
}
