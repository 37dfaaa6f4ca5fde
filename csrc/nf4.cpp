// NF4 (4-bit NormalFloat, Dettmers et al. 2023, "QLoRA") block-wise quantization of frozen
// weights, in bitsandbytes' layout: blocks of `blocksize` consecutive elements, one fp32 absmax
// per block; each element is the index (0..15) of the nearest of the 16 NF4 levels to
// x / absmax; two codes per byte, the even element in the high nibble (bitsandbytes packs them
// so). Dequantization: value = level[code] * absmax (one fp32 product, as bitsandbytes).
//
// Quantization (at fill time): x * (1 / absmax) compared with the 15 fp32 midpoints between
// neighbouring levels (a value above a midpoint takes the upper level); NaN -> code 7 (0.0); a
// block whose absmax is 0, infinite or NaN -> all codes 7. Scalar, AVX2 and AVX-512 paths (the
// 15 comparisons vectorised, codes packed by a multiply-add), from fp32, bf16 or fp16 pieces
// (csrc/quant_pieces.h); every path computes the same fp32 product and comparisons.
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
#include "quant_pieces.h"

namespace {

using inf_quant::BlockMax;
using inf_quant::block_max_avx2;
using inf_quant::block_max_avx512;
using inf_quant::block_max_scalar;

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
  float v16[16];  // the same, and +inf: one 16-lane table
  constexpr Midpoints() : v(), v16() {
    for (int i = 0; i < 15; ++i) v[i] = v16[i] = midpoint(i);
    v16[15] = __builtin_inff();
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
  const uint8_t* codes_in = nullptr;
  const float* absmax_in = nullptr;
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

// ---- quantization: one block of fp32 values (csrc/quant_pieces.h hands them over) ----------
struct QuantOut {
  uint8_t* codes;
  float* absmax;
};

// The block's absmax as the scalar rule has it: NaN (the canonical quiet NaN) if any element is
// NaN, else max |x| (+0 for a block of zeros); inv = 1 / absmax, ok: absmax > 0 and finite.
struct BlockScale {
  float scale;
  float inv;
  bool ok;
};
inline BlockScale block_scale(float mx, bool nan) {
  const float scale = nan ? std::nanf("") : mx;
  return {scale, scale > 0.f ? 1.0f / scale : 0.f, scale > 0.f && std::isfinite(scale)};
}

// Codes of x[i .. count) (i even) by the scalar rule; the last of an odd count fills the high
// nibble only (its byte's low nibble stays 0).
inline void quantize_tail(const float* x, int64_t i, int64_t count, const BlockScale& s,
                          uint8_t* codes) {
  for (; i + 1 < count; i += 2) {
    const int hi = s.ok ? nearest_level(x[i] * s.inv) : 7;
    const int lo = s.ok ? nearest_level(x[i + 1] * s.inv) : 7;
    codes[i >> 1] = static_cast<uint8_t>((hi << 4) | lo);
  }
  if (i < count) {
    const int hi = s.ok ? nearest_level(x[i] * s.inv) : 7;
    codes[i >> 1] = static_cast<uint8_t>(hi << 4);
  }
}

void quantize_block_scalar(void* ctx, const float* x, int64_t count, int64_t b, int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_scalar(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  o.absmax[b] = s.scale;
  quantize_tail(x, 0, count, s, o.codes + (i0 >> 1));
}

// 16 int32 codes -> 8 packed bytes (the even element in the high nibble): byte pairs (c0, c1)
// -> c0 * 16 + c1 by one unsigned x signed multiply-add, then narrowed.
INF_TARGET_AVX2 inline void pack16(__m128i bytes16, uint8_t* dst) {
  const __m128i pairs = _mm_maddubs_epi16(bytes16, _mm_set1_epi16(0x0110));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(pairs, pairs));
}

INF_TARGET_AVX2 inline __m256i avx2_codes(__m256 y) {
  __m256i code = _mm256_setzero_si256();
  for (int m = 0; m < 15; ++m) {  // a true compare is -1: subtracting counts it
    code = _mm256_sub_epi32(
        code, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(kMid.v[m]), _CMP_GT_OQ)));
  }
  const __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(code), _mm256_castsi256_ps(_mm256_set1_epi32(7)), nan));
}

INF_TARGET_AVX2 void quantize_block_avx2(void* ctx, const float* x, int64_t count, int64_t b,
                                         int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_avx2(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  int64_t i = 0;
  o.absmax[b] = s.scale;
  uint8_t* codes = o.codes + (i0 >> 1);
  if (s.ok) {
    const __m256 inv = _mm256_set1_ps(s.inv);
    for (; i + 16 <= count; i += 16) {
      const __m256i c0 = avx2_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
      const __m256i c1 = avx2_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);
      pack16(_mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)),
             codes + (i >> 1));
    }
  }
  quantize_tail(x, i, count, s, codes);
}

INF_TARGET_AVX512 void quantize_block_avx512(void* ctx, const float* x, int64_t count,
                                             int64_t b, int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_avx512(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  int64_t i = 0;
  o.absmax[b] = s.scale;
  uint8_t* codes = o.codes + (i0 >> 1);
  if (s.ok) {
    const __m512 inv = _mm512_set1_ps(s.inv);
    const __m512 mids = _mm512_loadu_ps(kMid.v16);
    for (; i + 16 <= count; i += 16) {
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), inv);
      // #{midpoints < y} by binary search over the ascending midpoints: step s tests
      // mid[code + s - 1] (at most mid[14]); the same count as the 15 comparisons
      __m512i code = _mm512_setzero_si512();
      for (int step = 8; step >= 1; step >>= 1) {
        const __m512 m =
            _mm512_permutexvar_ps(_mm512_add_epi32(code, _mm512_set1_epi32(step - 1)), mids);
        code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(y, m, _CMP_GT_OQ), code,
                                     _mm512_set1_epi32(step));
      }
      code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q),
                                   _mm512_set1_epi32(7));
      pack16(_mm512_cvtepi32_epi8(code), codes + (i >> 1));
    }
  }
  quantize_tail(x, i, count, s, codes);
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

// Quantizes pieces (csrc/quant_pieces.h: n_pieces sources of fp32 / bf16 / fp16, dtype codes 0 /
// 1 / 2, `valid` elements read of `total`, the rest zeros; every piece but the last a whole
// number of blocks) as one run of n = sum(total) values: absmax[ceil(n / blocksize)], packed
// codes[ceil(n / 2)] (high nibble first). blocksize: a positive even number (bitsandbytes:
// 64 .. 4096).
INF_API int inf_nf4_quantize_pieces(const void* const* src, const int32_t* dtype,
                                    const int64_t* valid, const int64_t* total, int64_t n_pieces,
                                    int64_t blocksize, uint8_t* codes, float* absmax) {
  if (blocksize <= 0 || (blocksize & 1)) return kErrBlocksize;
  inf_quant::Pieces pieces;
  pieces.src = src;
  pieces.dtype = dtype;
  pieces.valid = valid;
  pieces.total = total;
  pieces.count = n_pieces;
  const int rc = inf_quant::check_pieces(pieces, blocksize);
  if (rc != kOk) return rc;
  const int64_t n = pieces.start.back();
  if (n == 0) return kOk;
  if (codes == nullptr || absmax == nullptr) return kErrNull;
  const int cap = inf_cpu_capability();
  g_calls[0][cap].fetch_add(1, std::memory_order_relaxed);
  if (n & 1) codes[n >> 1] = 0;  // the unused low nibble of an odd count
  QuantOut out{codes, absmax};
  inf_quant::run(pieces, blocksize, cap,
                 cap == kAVX512 ? &quantize_block_avx512
                 : cap == kAVX2 ? &quantize_block_avx2
                                : &quantize_block_scalar,
                 &out);
  return kOk;
}

// Quantizes n fp32 values (one piece, all valid).
INF_API int inf_nf4_quantize(const float* x, int64_t n, int64_t blocksize, uint8_t* codes,
                             float* absmax) {
  if (n < 0) return kErrLength;
  if (n > 0 && x == nullptr) return kErrNull;
  const void* src = x;
  const int32_t dtype = inf_adam::kF32;
  return inf_nf4_quantize_pieces(&src, &dtype, &n, &n, 1, blocksize, codes, absmax);
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
