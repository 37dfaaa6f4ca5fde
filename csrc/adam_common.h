// Definitions shared by the CPU Adam kernels (csrc/cpu_adam.cpp, csrc/cpu_adam_compact.cpp):
// enums (mirrored in infinity/ops/_adam_native.py), the host-side scalars, the portable
// fp32 <-> bf16/fp16 conversions, the scalar and vector Adam(W) element math and the vector
// bf16 rounding. No Python or torch headers anywhere in csrc/.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define INF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace inf_adam {

// ---- public enums (mirrored in infinity/ops/_adam_native.py) ---------------------------------
enum Dtype : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };
enum Capability : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
enum Error : int {
  kOk = 0,
  kErrNullPointer = -1,
  kErrGradDtype = -2,
  kErrOutDtype = -3,
  kErrNegativeLength = -4,
  kErrCapabilityUnsupported = -5,
  kErrCapabilityInvalid = -6,
};

// Bytes per element of a gradient / working-copy dtype (0 for kNone).
constexpr int dtype_size(int d) { return d == kF32 ? 4 : (d == kNone ? 0 : 2); }

// Host-side scalars, computed once per call in double and rounded to fp32 like torch does.
struct Coeffs {
  float grad_multiplier;
  float decay;        // 1 - lr*wd (AdamW)
  float weight_decay; // wd (classic Adam)
  float lerp_coeff;   // 1 - beta1, or (1 - beta1) - 1 when that weight is >= 0.5
  bool lerp_small;    // |1 - beta1| < 0.5: m + w*(g - m), else g + (w - 1)*(g - m)
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float step_size;    // lr / bias_correction1
  bool adamw;
  bool has_weight_decay;
};

inline Coeffs make_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                          int adamw, double bias_correction1, double bias_correction2_sqrt,
                          double grad_multiplier) {
  Coeffs c;
  c.grad_multiplier = static_cast<float>(grad_multiplier);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.weight_decay = static_cast<float>(weight_decay);
  const double lerp_weight = 1.0 - beta1;
  c.lerp_small = std::fabs(lerp_weight) < 0.5;
  // torch: coeff = w (or w - 1) rounded to fp32 (ATen computes w - 1 on the fp32 vector).
  c.lerp_coeff = c.lerp_small ? static_cast<float>(lerp_weight)
                              : static_cast<float>(lerp_weight) - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.adamw = adamw != 0;
  c.has_weight_decay = weight_decay != 0.0;
  return c;
}

// ---- scalar conversions (portable; used by the scalar paths) ---------------------------------
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN -> quiet NaN (as c10)
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = f32_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// IEEE half <-> float, exact and round-to-nearest-even (after Maratyszcza's FP16 library).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float exp_scale = bits_f32(0x7800000u);  // 2^-112
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * exp_scale;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(result);
}
inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = bits_f32(0x77800000u);   // 2^112
  const float scale_to_zero = bits_f32(0x08800000u);  // 2^-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// ---- scalar element math ----------------------------------------------------------------------
template <int GD>
inline float scalar_load_grad(const void* g, int64_t i) {
  if constexpr (GD == kF32) return static_cast<const float*>(g)[i];
  if constexpr (GD == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if constexpr (GD == kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return 0.f;
}

template <int OD>
inline void scalar_store_out(void* out, int64_t i, float x) {
  if constexpr (OD == kF32) static_cast<float*>(out)[i] = x;
  if constexpr (OD == kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  if constexpr (OD == kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
}

// One element's moments (grad not yet multiplied): weight decay applied, mo and vo set;
// returns the parameter after a decoupled decay. Shared by every format's scalar step.
inline float scalar_adam_moments(const Coeffs& c, float grad, float param, float mi, float vi,
                                 float& mo, float& vo) {
  grad = grad * c.grad_multiplier;
  if (c.has_weight_decay) {
    if (c.adamw) {
      param = param * c.decay;
    } else {
      grad = std::fma(param, c.weight_decay, grad);
    }
  }
  const float diff = grad - mi;
  mo = c.lerp_small ? std::fma(c.lerp_coeff, diff, mi) : std::fma(c.lerp_coeff, diff, grad);
  vo = std::fma(c.one_minus_beta2 * grad, grad, vi * c.beta2);
  return param;
}

// One element of Adam(W) (grad not yet multiplied); returns the new param, sets mo and vo.
inline float scalar_adam(const Coeffs& c, float grad, float param, float mi, float vi, float& mo,
                         float& vo) {
  param = scalar_adam_moments(c, grad, param, mi, vi, mo, vo);
  const float denom = std::sqrt(vo) / c.bc2_sqrt + c.eps;
  return param - (c.step_size * mo) / denom;
}

// ---- AVX-512 ----------------------------------------------------------------------------------
struct V512 {
  __m512 gmul, decay, wd, lerp, b2, omb2, bc2s, eps, step;
};

INF_TARGET_AVX512 inline V512 make_v512(const Coeffs& c) {
  return V512{_mm512_set1_ps(c.grad_multiplier), _mm512_set1_ps(c.decay),
              _mm512_set1_ps(c.weight_decay),    _mm512_set1_ps(c.lerp_coeff),
              _mm512_set1_ps(c.beta2),           _mm512_set1_ps(c.one_minus_beta2),
              _mm512_set1_ps(c.bc2_sqrt),        _mm512_set1_ps(c.eps),
              _mm512_set1_ps(c.step_size)};
}

INF_TARGET_AVX512 inline __m256i avx512_f32_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7FC0), r);
  return _mm512_cvtepi32_epi16(r);
}

// Gradient loads / working-copy stores of 16 lanes at element i, masked (by k) or not, the
// unmasked stores optionally non-temporal.
template <int GD, bool MASKED>
INF_TARGET_AVX512 inline __m512 avx512_load_grad(const void* g, int64_t i, __mmask16 k) {
  if constexpr (GD == kF32) {
    const float* src = static_cast<const float*>(g) + i;
    return MASKED ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(g) + i;
    const __m256i h = MASKED ? _mm256_maskz_loadu_epi16(k, src)
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if constexpr (GD == kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <int OD, bool MASKED, bool NT>
INF_TARGET_AVX512 inline void avx512_store_out(void* out, int64_t i, __mmask16 k, __m512 x) {
  if constexpr (OD == kF32) {
    float* dst = static_cast<float*>(out) + i;
    if constexpr (MASKED) {
      _mm512_mask_storeu_ps(dst, k, x);
    } else if constexpr (NT) {
      _mm512_stream_ps(dst, x);
    } else {
      _mm512_storeu_ps(dst, x);
    }
  } else if constexpr (OD == kBF16 || OD == kF16) {
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    __m256i h;
    if constexpr (OD == kBF16) {
      h = avx512_f32_to_bf16(x);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if constexpr (MASKED) {
      _mm256_mask_storeu_epi16(dst, k, h);
    } else if constexpr (NT) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
  }
}

// 16 elements of Adam(W), the operations of scalar_adam; returns the new param.
INF_TARGET_AVX512 inline __m512 avx512_adam(const Coeffs& s, const V512& c, __m512 grad,
                                            __m512 param, __m512 mi, __m512 vi, __m512& mo,
                                            __m512& vo) {
  grad = _mm512_mul_ps(grad, c.gmul);
  if (s.has_weight_decay) {
    if (s.adamw) {
      param = _mm512_mul_ps(param, c.decay);
    } else {
      grad = _mm512_fmadd_ps(param, c.wd, grad);
    }
  }
  const __m512 diff = _mm512_sub_ps(grad, mi);
  mo = _mm512_fmadd_ps(c.lerp, diff, s.lerp_small ? mi : grad);
  vo = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, grad), grad, _mm512_mul_ps(vi, c.b2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vo), c.bc2s), c.eps);
  return _mm512_sub_ps(param, _mm512_div_ps(_mm512_mul_ps(c.step, mo), denom));
}

// ---- AVX2 + FMA + F16C ------------------------------------------------------------------------
struct V256 {
  __m256 gmul, decay, wd, lerp, b2, omb2, bc2s, eps, step;
};

INF_TARGET_AVX2 inline V256 make_v256(const Coeffs& c) {
  return V256{_mm256_set1_ps(c.grad_multiplier), _mm256_set1_ps(c.decay),
              _mm256_set1_ps(c.weight_decay),    _mm256_set1_ps(c.lerp_coeff),
              _mm256_set1_ps(c.beta2),           _mm256_set1_ps(c.one_minus_beta2),
              _mm256_set1_ps(c.bc2_sqrt),        _mm256_set1_ps(c.eps),
              _mm256_set1_ps(c.step_size)};
}

INF_TARGET_AVX2 inline __m128i avx2_f32_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, ordered);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Gradient loads / working-copy stores of 8 lanes at an explicit address (optionally
// non-temporal stores).
template <int GD>
INF_TARGET_AVX2 inline __m256 avx2_load_grad(const void* g) {
  if constexpr (GD == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g));
  } else {
    const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(g));
    if constexpr (GD == kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <int OD, bool NT>
INF_TARGET_AVX2 inline void avx2_store_out(void* out, __m256 x) {
  if constexpr (OD == kF32) {
    if constexpr (NT) {
      _mm256_stream_ps(static_cast<float*>(out), x);
    } else {
      _mm256_storeu_ps(static_cast<float*>(out), x);
    }
  } else if constexpr (OD == kBF16 || OD == kF16) {
    __m128i h;
    if constexpr (OD == kBF16) {
      h = avx2_f32_to_bf16(x);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if constexpr (NT) {
      _mm_stream_si128(static_cast<__m128i*>(out), h);
    } else {
      _mm_storeu_si128(static_cast<__m128i*>(out), h);
    }
  }
}

// 8 elements of Adam(W), the operations of scalar_adam; returns the new param.
INF_TARGET_AVX2 inline __m256 avx2_adam(const Coeffs& s, const V256& c, __m256 grad,
                                        __m256 param, __m256 mi, __m256 vi, __m256& mo,
                                        __m256& vo) {
  grad = _mm256_mul_ps(grad, c.gmul);
  if (s.has_weight_decay) {
    if (s.adamw) {
      param = _mm256_mul_ps(param, c.decay);
    } else {
      grad = _mm256_fmadd_ps(param, c.wd, grad);
    }
  }
  const __m256 diff = _mm256_sub_ps(grad, mi);
  mo = _mm256_fmadd_ps(c.lerp, diff, s.lerp_small ? mi : grad);
  vo = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, grad), grad, _mm256_mul_ps(vi, c.b2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vo), c.bc2s), c.eps);
  return _mm256_sub_ps(param, _mm256_div_ps(_mm256_mul_ps(c.step, mo), denom));
}

}  // namespace inf_adam
