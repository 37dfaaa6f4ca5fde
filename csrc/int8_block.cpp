// Block-wise symmetric int8 quantization of frozen weights (infinity/ops/int8_block.py): blocks
// of `blocksize` consecutive elements, one fp32 absmax per block, code = round(x * scale)
// clamped to [-127, 127] with scale = (1 / safe) * 127 (safe: the absmax, or 1 when it is 0 or
// NaN) -- the operations, roundings and order of the PyTorch definition
// (`round(x * (127.0 / safe)).clamp(-127, 127)`, where `127.0 / t` is `t.reciprocal() * 127.0`),
// so every path here gives its bits:
//   absmax: NaN (canonical quiet NaN) if any element is NaN, else max |x|;
//   round:  to nearest, ties to even; a NaN product (NaN input, or inf * 0) -> code 0.
// Dequantization: code * (absmax * (1 / 127)) in fp32 (the scale rounded to fp32 first, as
// PyTorch's `absmax * (1.0 / 127.0)`), fp32 or bf16 out (round to nearest even).
// Scalar, AVX2 and AVX-512 paths, chosen at run time (inf_cpu_capability()), quantization from
// fp32 / bf16 / fp16 pieces (csrc/quant_pieces.h), threaded. No Python or torch headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "adam_common.h"
#include "common.h"
#include "quant_pieces.h"

namespace {

using inf_quant::BlockMax;
using inf_quant::block_max_avx2;
using inf_quant::block_max_avx512;
using inf_quant::block_max_scalar;
using inf_adam::kAVX2;
using inf_adam::kAVX512;
using inf_adam::kScalar;

std::atomic<int64_t> g_calls[2][3];  // [quantize, dequantize][capability]
constexpr int kOutF32 = 0;
constexpr int kOutBF16 = 1;
const float kInv127 = static_cast<float>(1.0 / 127.0);  // as torch rounds the Python scalar

struct QuantOut {
  int8_t* codes;
  float* absmax;
};

struct BlockScale {
  float absmax;
  float scale;
};

inline BlockScale block_scale(float mx, bool nan) {
  const float absmax = nan ? std::nanf("") : mx;
  const float safe = absmax > 0.f ? absmax : 1.0f;  // NaN -> 1, as torch.where(absmax > 0, ...)
  const float recip = 1.0f / safe;
  return {absmax, recip * 127.0f};
}

inline int8_t code_of(float x, float scale) {
  const float y = x * scale;
  if (std::isnan(y)) return 0;
  const float r = std::nearbyint(y);
  return static_cast<int8_t>(r < -127.f ? -127.f : (r > 127.f ? 127.f : r));
}

void quantize_block_scalar(void* ctx, const float* x, int64_t count, int64_t b, int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_scalar(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  o.absmax[b] = s.absmax;
  for (int64_t i = 0; i < count; ++i) o.codes[i0 + i] = code_of(x[i], s.scale);
}

// rounded, clamped codes of 8 / 16 products as int32; NaN products -> 0
INF_TARGET_AVX2 inline __m256i avx2_codes(__m256 y) {
  const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  const __m256i q = _mm256_cvtps_epi32(c);
  return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)), q);
}

INF_TARGET_AVX2 void quantize_block_avx2(void* ctx, const float* x, int64_t count, int64_t b,
                                         int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_avx2(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  int64_t i = 0;
  o.absmax[b] = s.absmax;
  int8_t* codes = o.codes + i0;
  const __m256 scale = _mm256_set1_ps(s.scale);
  for (; i + 16 <= count; i += 16) {
    const __m256i c0 = avx2_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
    const __m256i c1 = avx2_codes(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), scale));
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  }
  for (; i < count; ++i) codes[i] = code_of(x[i], s.scale);
}

INF_TARGET_AVX512 void quantize_block_avx512(void* ctx, const float* x, int64_t count,
                                             int64_t b, int64_t i0) {
  const QuantOut& o = *static_cast<const QuantOut*>(ctx);
  const BlockMax m = block_max_avx512(x, count);
  const BlockScale s = block_scale(m.mx, m.nan);
  int64_t i = 0;
  o.absmax[b] = s.absmax;
  int8_t* codes = o.codes + i0;
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (i = 0; i < count; i += 16) {
    const __mmask16 k = count - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                        : static_cast<__mmask16>((1u << (count - i)) - 1u);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), scale);
    const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    const __m512i c = _mm512_maskz_mov_epi32(~_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), q);
    _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(c));
  }
}

// ---- dequantization: code * (absmax * (1 / 127)), fp32 or bf16 (rounded once) out ------------
struct DequantJob {
  const int8_t* codes;
  const float* absmax;
  void* out;
  int out_dtype;
  int64_t n;
  int64_t blocksize;
  int cap;
  std::vector<int64_t> bounds;
};

inline void dequant_scalar(const DequantJob& j, int64_t i0, int64_t i1, float s) {
  for (int64_t i = i0; i < i1; ++i) {
    const float v = static_cast<float>(j.codes[i]) * s;
    if (j.out_dtype == kOutF32) {
      static_cast<float*>(j.out)[i] = v;
    } else {
      static_cast<uint16_t*>(j.out)[i] = inf_adam::f32_to_bf16(v);
    }
  }
}

INF_TARGET_AVX2 void dequant_avx2(const DequantJob& j, int64_t i0, int64_t i1, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(j.codes + i));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s);
    if (j.out_dtype == kOutF32) {
      _mm256_storeu_ps(static_cast<float*>(j.out) + i, v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(j.out) + i),
                       inf_adam::avx2_f32_to_bf16(v));
    }
  }
  dequant_scalar(j, i, i1, scale);
}

INF_TARGET_AVX512 void dequant_avx512(const DequantJob& j, int64_t i0, int64_t i1, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 k = i1 - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>((1u << (i1 - i)) - 1u);
    const __m128i c = _mm_maskz_loadu_epi8(k, j.codes + i);
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), s);
    if (j.out_dtype == kOutF32) {
      _mm512_mask_storeu_ps(static_cast<float*>(j.out) + i, k, v);
    } else {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(j.out) + i, k,
                               inf_adam::avx512_f32_to_bf16(v));
    }
  }
}

void dequant_blocks(const DequantJob& j, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * j.blocksize;
    const int64_t i1 = std::min(j.n, i0 + j.blocksize);
    const float scale = j.absmax[b] * kInv127;
    if (j.cap == kAVX512) {
      dequant_avx512(j, i0, i1, scale);
    } else if (j.cap == kAVX2) {
      dequant_avx2(j, i0, i1, scale);
    } else {
      dequant_scalar(j, i0, i1, scale);
    }
  }
}

}  // namespace

// Quantizes pieces (csrc/quant_pieces.h) as one run of n = sum(total) values: codes[n] (int8),
// absmax[ceil(n / blocksize)] (fp32). blocksize: positive.
INF_API int inf_int8_quantize_pieces(const void* const* src, const int32_t* dtype,
                                     const int64_t* valid, const int64_t* total,
                                     int64_t n_pieces, int64_t blocksize, int8_t* codes,
                                     float* absmax) {
  if (blocksize <= 0) return inf_quant::kErrBlocksize;
  inf_quant::Pieces pieces;
  pieces.src = src;
  pieces.dtype = dtype;
  pieces.valid = valid;
  pieces.total = total;
  pieces.count = n_pieces;
  const int rc = inf_quant::check_pieces(pieces, blocksize);
  if (rc != inf_quant::kOk) return rc;
  if (pieces.start.back() == 0) return inf_quant::kOk;
  if (codes == nullptr || absmax == nullptr) return inf_quant::kErrNull;
  const int cap = inf_cpu_capability();
  g_calls[0][cap].fetch_add(1, std::memory_order_relaxed);
  QuantOut out{codes, absmax};
  inf_quant::run(pieces, blocksize, cap,
                 cap == kAVX512 ? &quantize_block_avx512
                 : cap == kAVX2 ? &quantize_block_avx2
                                : &quantize_block_scalar,
                 &out);
  return inf_quant::kOk;
}

// Dequantizes n codes into out (out_dtype 0: fp32, 1: bf16): code * (absmax[block] * (1/127)).
INF_API int inf_int8_dequantize(const int8_t* codes, const float* absmax, int64_t n,
                                int64_t blocksize, void* out, int out_dtype) {
  if (n < 0) return inf_quant::kErrLength;
  if (blocksize <= 0) return inf_quant::kErrBlocksize;
  if (out_dtype != kOutF32 && out_dtype != kOutBF16) return inf_quant::kErrDtype;
  if (n == 0) return inf_quant::kOk;
  if (codes == nullptr || absmax == nullptr || out == nullptr) return inf_quant::kErrNull;
  const int cap = inf_cpu_capability();
  g_calls[1][cap].fetch_add(1, std::memory_order_relaxed);
  DequantJob j{codes, absmax, out, out_dtype, n, blocksize, cap, {}};
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  int64_t tasks = n >= (1 << 18) ? std::max(1, inf_get_num_threads()) : 1;
  tasks = std::min<int64_t>(tasks, blocks);
  if (tasks <= 1) {
    dequant_blocks(j, 0, blocks);
    return inf_quant::kOk;
  }
  j.bounds.resize(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) j.bounds[t] = blocks * t / tasks;
  inf_cpu::run_on_pool(
      static_cast<int>(tasks),
      [](void* c, int t) {
        const DequantJob& x = *static_cast<const DequantJob*>(c);
        dequant_blocks(x, x.bounds[t], x.bounds[t + 1]);
      },
      &j);
  return inf_quant::kOk;
}

// Calls of kernel (0 quantize, 1 dequantize) that ran on each capability (0 scalar, 1 avx2,
// 2 avx512).
INF_API int64_t inf_int8_calls(int kernel, int capability) {
  if (kernel < 0 || kernel > 1 || capability < kScalar || capability > kAVX512) return -1;
  return g_calls[kernel][capability].load();
}
