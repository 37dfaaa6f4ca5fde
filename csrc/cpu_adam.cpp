// CPU Adam / AdamW: fp32 master weights and moments updated in place, fp32/bf16/fp16 gradients,
// optional working copy (fp32/bf16/fp16) written in the same pass.
//
// One kernel per ISA (AVX-512 F/BW/VL, AVX2+FMA+F16C, scalar), each carrying its own target
// attribute (the library is built without -march), one dispatch point chosen at run time from
// cpuid, an env override (INFINITY_CPU_CAPABILITY=avx512|avx2|scalar) and a setter for tests.
//
// The math mirrors torch's fused AdamW CPU kernel (ATen/native/cpu/FusedAdamKernel.cpp) in
// order and rounding, all in fp32 with host-side scalars computed in double. GCC builds that
// kernel with -ffp-contract=fast, which fuses `a*b + c` into an FMA; we write those FMAs
// explicitly (every path, scalar included) so nothing is left for the compiler to contract:
//   g  = g * grad_multiplier
//   Adam:  g = fma(p, wd, g)     AdamW: p = p * (1 - lr*wd)
//   m  = lerp(m, g, 1 - beta1)   (fma(w, g - m, m) for w < 0.5, fma(w - 1, g - m, g) otherwise)
//   v  = fma((1 - beta2)*g, g, v*beta2)
//   d  = sqrt(v) / bias_correction2_sqrt + eps
//   p  = p - (step_size*m) / d   with step_size = lr / bias_correction1
// Vector tails run the same vector code (masked on AVX-512, through padded stack buffers on
// AVX2), so every element gets bitwise the same result whatever the chunking: multi-threaded
// runs equal single-threaded ones exactly.
// GCC 12 reports its own _mm512_undefined_ps() (`__m512 __Y = __Y;`) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "common.h"
#include "cpu_adam_threadpool.h"

#define INF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define INF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

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

struct Job {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;
  Coeffs c;
  void (*chunk)(const Job&, int64_t begin, int64_t end);
  std::vector<int64_t> bounds;  // task t runs [bounds[t], bounds[t+1])
};

// ---- scalar conversions (portable; used by the scalar path) ----------------------------------
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

// ---- scalar kernel ----------------------------------------------------------------------------
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

template <int GD, int OD, bool NT>
void scalar_chunk(const Job& job, int64_t begin, int64_t end) {
  const Coeffs c = job.c;
  float* __restrict p = job.p;
  float* __restrict m = job.m;
  float* __restrict v = job.v;
  for (int64_t i = begin; i < end; ++i) {
    float grad = scalar_load_grad<GD>(job.g, i) * c.grad_multiplier;
    float param = p[i];
    if (c.has_weight_decay) {
      if (c.adamw) {
        param = param * c.decay;
      } else {
        grad = std::fma(param, c.weight_decay, grad);
      }
    }
    const float mi = m[i];
    const float diff = grad - mi;
    const float mo = c.lerp_small ? std::fma(c.lerp_coeff, diff, mi)
                                  : std::fma(c.lerp_coeff, diff, grad);
    const float vo = std::fma(c.one_minus_beta2 * grad, grad, v[i] * c.beta2);
    const float denom = std::sqrt(vo) / c.bc2_sqrt + c.eps;
    const float update = (c.step_size * mo) / denom;
    param = param - update;
    m[i] = mo;
    v[i] = vo;
    p[i] = param;
    if constexpr (OD != kNone) scalar_store_out<OD>(job.out, i, param);
  }
}

// ---- AVX-512 kernel ---------------------------------------------------------------------------
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

template <int GD, int OD, bool MASKED, bool NT>
INF_TARGET_AVX512 inline void avx512_block(const Job& job, const V512& c, int64_t i,
                                           __mmask16 k) {
  float* pp = job.p + i;
  float* mp = job.m + i;
  float* vp = job.v + i;
  __m512 grad = _mm512_mul_ps(avx512_load_grad<GD, MASKED>(job.g, i, k), c.gmul);
  __m512 param = MASKED ? _mm512_maskz_loadu_ps(k, pp) : _mm512_loadu_ps(pp);
  if (job.c.has_weight_decay) {
    if (job.c.adamw) {
      param = _mm512_mul_ps(param, c.decay);
    } else {
      grad = _mm512_fmadd_ps(param, c.wd, grad);
    }
  }
  const __m512 mi = MASKED ? _mm512_maskz_loadu_ps(k, mp) : _mm512_loadu_ps(mp);
  const __m512 vi = MASKED ? _mm512_maskz_loadu_ps(k, vp) : _mm512_loadu_ps(vp);
  const __m512 diff = _mm512_sub_ps(grad, mi);
  const __m512 mo = _mm512_fmadd_ps(c.lerp, diff, job.c.lerp_small ? mi : grad);
  const __m512 vo = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, grad), grad, _mm512_mul_ps(vi, c.b2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vo), c.bc2s), c.eps);
  param = _mm512_sub_ps(param, _mm512_div_ps(_mm512_mul_ps(c.step, mo), denom));
  if constexpr (MASKED) {
    _mm512_mask_storeu_ps(mp, k, mo);
    _mm512_mask_storeu_ps(vp, k, vo);
    _mm512_mask_storeu_ps(pp, k, param);
  } else {
    _mm512_storeu_ps(mp, mo);
    _mm512_storeu_ps(vp, vo);
    _mm512_storeu_ps(pp, param);
  }
  if constexpr (OD != kNone) avx512_store_out<OD, MASKED, NT>(job.out, i, k, param);
}

constexpr int out_size(int od) { return od == kF32 ? 4 : (od == kNone ? 0 : 2); }

template <int GD, int OD, bool NT>
INF_TARGET_AVX512 void avx512_chunk(const Job& job, int64_t begin, int64_t end) {
  constexpr int64_t W = 16;
  const V512 c = make_v512(job.c);
  int64_t i = begin;
  if constexpr (NT) {
    // Peel a masked head so the streaming stores of `out` are vector aligned.
    constexpr uintptr_t align = W * out_size(OD);
    const uintptr_t addr = reinterpret_cast<uintptr_t>(job.out) + i * out_size(OD);
    const int64_t head = std::min<int64_t>(
        end - i, static_cast<int64_t>(((align - addr % align) % align) / out_size(OD)));
    if (head > 0) {
      avx512_block<GD, OD, true, false>(job, c, i, static_cast<__mmask16>((1u << head) - 1));
      i += head;
    }
  }
#pragma GCC unroll 2
  for (; i + W <= end; i += W) avx512_block<GD, OD, false, NT>(job, c, i, 0xFFFF);
  if (i < end) {
    avx512_block<GD, OD, true, false>(job, c, i, static_cast<__mmask16>((1u << (end - i)) - 1));
  }
  if constexpr (NT) _mm_sfence();
}

// ---- AVX2 kernel ------------------------------------------------------------------------------
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

// 8 elements at explicit addresses (the arrays, or padded stack copies for heads and tails).
template <int GD, int OD, bool NT>
INF_TARGET_AVX2 inline void avx2_block(const Coeffs& s, const V256& c, float* pp, const void* gp,
                                       float* mp, float* vp, void* op) {
  __m256 grad = _mm256_mul_ps(avx2_load_grad<GD>(gp), c.gmul);
  __m256 param = _mm256_loadu_ps(pp);
  if (s.has_weight_decay) {
    if (s.adamw) {
      param = _mm256_mul_ps(param, c.decay);
    } else {
      grad = _mm256_fmadd_ps(param, c.wd, grad);
    }
  }
  const __m256 mi = _mm256_loadu_ps(mp);
  const __m256 vi = _mm256_loadu_ps(vp);
  const __m256 diff = _mm256_sub_ps(grad, mi);
  const __m256 mo = _mm256_fmadd_ps(c.lerp, diff, s.lerp_small ? mi : grad);
  const __m256 vo = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, grad), grad, _mm256_mul_ps(vi, c.b2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vo), c.bc2s), c.eps);
  param = _mm256_sub_ps(param, _mm256_div_ps(_mm256_mul_ps(c.step, mo), denom));
  _mm256_storeu_ps(mp, mo);
  _mm256_storeu_ps(vp, vo);
  _mm256_storeu_ps(pp, param);
  if constexpr (OD != kNone) avx2_store_out<OD, NT>(op, param);
}

// Fewer than 8 elements: run the same vector code on zero-padded stack copies.
template <int GD, int OD>
INF_TARGET_AVX2 void avx2_partial(const Job& job, const V256& c, int64_t i, int64_t count) {
  alignas(32) float p[8] = {0}, m[8] = {0}, v[8] = {0}, o32[8] = {0};
  alignas(32) float g32[8] = {0};
  alignas(32) uint16_t g16[8] = {0}, o16[8] = {0};
  const size_t fbytes = static_cast<size_t>(count) * 4;
  const size_t hbytes = static_cast<size_t>(count) * 2;
  std::memcpy(p, job.p + i, fbytes);
  std::memcpy(m, job.m + i, fbytes);
  std::memcpy(v, job.v + i, fbytes);
  const void* gp;
  if constexpr (GD == kF32) {
    std::memcpy(g32, static_cast<const float*>(job.g) + i, fbytes);
    gp = g32;
  } else {
    std::memcpy(g16, static_cast<const uint16_t*>(job.g) + i, hbytes);
    gp = g16;
  }
  void* op = (OD == kF32) ? static_cast<void*>(o32) : static_cast<void*>(o16);
  avx2_block<GD, OD, false>(job.c, c, p, gp, m, v, op);
  std::memcpy(job.p + i, p, fbytes);
  std::memcpy(job.m + i, m, fbytes);
  std::memcpy(job.v + i, v, fbytes);
  if constexpr (OD == kF32) std::memcpy(static_cast<float*>(job.out) + i, o32, fbytes);
  if constexpr (OD == kBF16 || OD == kF16) {
    std::memcpy(static_cast<uint16_t*>(job.out) + i, o16, hbytes);
  }
}

template <int GD, int OD, bool NT>
INF_TARGET_AVX2 void avx2_chunk(const Job& job, int64_t begin, int64_t end) {
  constexpr int64_t W = 8;
  constexpr int gsize = GD == kF32 ? 4 : 2;
  constexpr int osize = out_size(OD);
  const V256 c = make_v256(job.c);
  int64_t i = begin;
  if constexpr (NT) {
    constexpr uintptr_t align = W * osize;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(job.out) + i * osize;
    const int64_t head = std::min<int64_t>(
        end - i, static_cast<int64_t>(((align - addr % align) % align) / osize));
    if (head > 0) {
      avx2_partial<GD, OD>(job, c, i, head);
      i += head;
    }
  }
  const char* g = static_cast<const char*>(job.g);
  char* out = static_cast<char*>(job.out);
#pragma GCC unroll 2
  for (; i + W <= end; i += W) {
    avx2_block<GD, OD, NT>(job.c, c, job.p + i, g + i * gsize, job.m + i, job.v + i,
                           OD == kNone ? nullptr : out + i * osize);
  }
  if (i < end) avx2_partial<GD, OD>(job, c, i, end - i);
  if constexpr (NT) _mm_sfence();
}

// ---- dispatch table ---------------------------------------------------------------------------
using ChunkFn = void (*)(const Job&, int64_t, int64_t);

// [capability][grad dtype][out: none, f32, bf16, f16][non-temporal]
template <int GD, int OD>
constexpr ChunkFn pick(int cap, bool nt) {
  if (cap == kAVX512) return nt ? &avx512_chunk<GD, OD, true> : &avx512_chunk<GD, OD, false>;
  if (cap == kAVX2) return nt ? &avx2_chunk<GD, OD, true> : &avx2_chunk<GD, OD, false>;
  return &scalar_chunk<GD, OD, false>;
}

template <int GD>
ChunkFn pick_out(int cap, int od, bool nt) {
  switch (od) {
    case kF32: return pick<GD, kF32>(cap, nt);
    case kBF16: return pick<GD, kBF16>(cap, nt);
    case kF16: return pick<GD, kF16>(cap, nt);
    default: return pick<GD, kNone>(cap, false);
  }
}

ChunkFn select_chunk(int cap, int gd, int od, bool nt) {
  switch (gd) {
    case kF32: return pick_out<kF32>(cap, od, nt);
    case kBF16: return pick_out<kBF16>(cap, od, nt);
    default: return pick_out<kF16>(cap, od, nt);
  }
}

// ---- capability & threads ---------------------------------------------------------------------
int detect_best_capability() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return kAVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return kAVX2;
  }
  return kScalar;
}

std::once_flag g_init_once;
int g_best = kScalar;
std::atomic<int> g_capability{kScalar};
int g_env_status = 0;  // 0 none/ok, 1 requested ISA unsupported (fell back), 2 unknown name
std::atomic<int> g_num_threads{0};  // 0 = default (usable CPUs)
std::atomic<int64_t> g_calls[3];

void init_once() {
  std::call_once(g_init_once, [] {
    g_best = detect_best_capability();
    int cap = g_best;
    const char* env = std::getenv("INFINITY_CPU_CAPABILITY");
    if (env != nullptr && env[0] != '\0') {
      int requested = -1;
      if (std::strcmp(env, "avx512") == 0) requested = kAVX512;
      else if (std::strcmp(env, "avx2") == 0) requested = kAVX2;
      else if (std::strcmp(env, "scalar") == 0) requested = kScalar;
      else if (std::strcmp(env, "auto") == 0 || std::strcmp(env, "torch") == 0) requested = g_best;
      if (requested < 0) {
        g_env_status = 2;
      } else if (requested > g_best) {
        g_env_status = 1;
      } else {
        cap = requested;
      }
    }
    g_capability.store(cap);
  });
}

inf_cpu::ThreadPool* g_pool = nullptr;
std::mutex g_pool_mu;

void reset_pool_in_child() { g_pool = nullptr; }  // the parent's workers do not exist here

inf_cpu::ThreadPool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr) {
    static std::once_flag atfork_once;
    std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, &reset_pool_in_child); });
    g_pool = new inf_cpu::ThreadPool();  // intentionally never freed: workers live until exit
  }
  return *g_pool;
}

int effective_threads() {
  const int n = g_num_threads.load();
  return n > 0 ? n : inf_cpu::usable_cpus();
}

constexpr int64_t kSingleThreadBelow = 1 << 16;  // elements
constexpr int64_t kMinPerThread = 1 << 15;       // elements
constexpr int64_t kStreamingFrom = 1 << 20;      // elements: `out` written with NT stores

void run_task(void* ctx, int t) {
  const Job& job = *static_cast<const Job*>(ctx);
  job.chunk(job, job.bounds[t], job.bounds[t + 1]);
}

}  // namespace

// ---- C ABI ------------------------------------------------------------------------------------

INF_API const char* inf_adam_strerror(int code) {
  switch (code) {
    case kOk: return "ok";
    case kErrNullPointer: return "a required pointer is NULL";
    case kErrGradDtype: return "unsupported gradient dtype (expected 0=fp32, 1=bf16, 2=fp16)";
    case kErrOutDtype: return "unsupported out dtype (expected -1=none, 0=fp32, 1=bf16, 2=fp16)";
    case kErrNegativeLength: return "negative element count";
    case kErrCapabilityUnsupported: return "this CPU does not support the requested capability";
    case kErrCapabilityInvalid: return "unknown capability (expected 0=scalar, 1=avx2, 2=avx512)";
    default: return "unknown error";
  }
}

INF_API int inf_cpu_capability() {
  init_once();
  return g_capability.load();
}

INF_API int inf_cpu_best_capability() {
  init_once();
  return g_best;
}

INF_API int inf_cpu_capability_env_status() {
  init_once();
  return g_env_status;
}

INF_API int inf_set_cpu_capability(int capability) {
  init_once();
  if (capability < kScalar || capability > kAVX512) return kErrCapabilityInvalid;
  if (capability > g_best) return kErrCapabilityUnsupported;
  g_capability.store(capability);
  return kOk;
}

// Number of inf_adam_step calls that ran on each capability (tests check which path ran).
INF_API int64_t inf_adam_calls(int capability) {
  if (capability < kScalar || capability > kAVX512) return -1;
  return g_calls[capability].load();
}

// n <= 0 restores the default: the number of CPUs in this process's affinity mask.
INF_API int inf_set_num_threads(int n) {
  g_num_threads.store(n > 0 ? n : 0);
  return kOk;
}

INF_API int inf_get_num_threads() { return effective_threads(); }

// One Adam/AdamW step over n elements, in place on p, m, v; optional working copy into out.
// bias_correction1 = 1 - beta1^step, bias_correction2_sqrt = sqrt(1 - beta2^step), in double.
INF_API int inf_adam_step(float* p, const void* g, int g_dtype, float* m, float* v, void* out,
                          int out_dtype, int64_t n, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int adamw, double bias_correction1,
                          double bias_correction2_sqrt, double grad_multiplier) {
  init_once();
  if (n < 0) return kErrNegativeLength;
  if (g_dtype != kF32 && g_dtype != kBF16 && g_dtype != kF16) return kErrGradDtype;
  if (out == nullptr) out_dtype = kNone;
  if (out_dtype != kNone && out_dtype != kF32 && out_dtype != kBF16 && out_dtype != kF16) {
    return kErrOutDtype;
  }
  if (n == 0) return kOk;
  if (p == nullptr || g == nullptr || m == nullptr || v == nullptr) return kErrNullPointer;

  const int cap = g_capability.load();
  g_calls[cap].fetch_add(1, std::memory_order_relaxed);

  Job job;
  job.p = p;
  job.g = g;
  job.m = m;
  job.v = v;
  job.out = out;
  Coeffs& c = job.c;
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

  const bool nt = out_dtype != kNone && n >= kStreamingFrom &&
                  reinterpret_cast<uintptr_t>(out) % out_size(out_dtype) == 0;
  job.chunk = select_chunk(cap, g_dtype, out_dtype, nt);

  int tasks = 1;
  if (n >= kSingleThreadBelow) {
    tasks = static_cast<int>(std::min<int64_t>(effective_threads(), n / kMinPerThread));
    tasks = std::max(tasks, 1);
  }
  // Chunk boundaries on cache lines of p: the first boundary-able index is where p+i is 64 B
  // aligned, and every chunk length after it is a multiple of 16 floats.
  const uintptr_t paddr = reinterpret_cast<uintptr_t>(p);
  const int64_t first = paddr % 4 == 0 ? static_cast<int64_t>(((64 - paddr % 64) % 64) / 4) : 0;
  if (first >= n) tasks = 1;
  job.bounds.resize(tasks + 1);
  job.bounds[0] = 0;
  job.bounds[tasks] = n;
  const int64_t span = n - first;
  for (int t = 1; t < tasks; ++t) {
    const int64_t cut = static_cast<int64_t>(static_cast<__int128>(span) * t / tasks);
    job.bounds[t] = first + (cut & ~static_cast<int64_t>(15));
  }
  if (tasks == 1) {
    job.chunk(job, 0, n);
  } else {
    pool().run(tasks, &run_task, &job);
  }
  return kOk;
}

// ---- finiteness check (the optimizer skips a step whose gradients hold inf/nan) --------------
namespace {

// One read-only pass; an element is non-finite when its exponent bits are all ones. The loop
// vectorizes; target_clones picks the widest ISA at load time.
__attribute__((target_clones("avx512f", "avx2", "default"))) uint32_t any_nonfinite_f32(
    const uint32_t* x, int64_t n) {
  uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= static_cast<uint32_t>((x[i] & 0x7F800000u) == 0x7F800000u);
  return acc;
}

struct FiniteJob {
  const uint32_t* x;
  std::vector<int64_t> bounds;
  std::vector<uint32_t> found;
};

void run_finite_task(void* ctx, int t) {
  auto& job = *static_cast<FiniteJob*>(ctx);
  job.found[t] = any_nonfinite_f32(job.x + job.bounds[t], job.bounds[t + 1] - job.bounds[t]);
}

}  // namespace

// 1 when every one of the n fp32 values is finite, 0 when one is inf or nan, <0 on bad input.
INF_API int inf_all_finite_f32(const float* data, int64_t n) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return 1;
  if (data == nullptr) return kErrNullPointer;
  FiniteJob job;
  job.x = reinterpret_cast<const uint32_t*>(data);
  int tasks = 1;
  if (n >= kSingleThreadBelow) {
    tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(effective_threads(),
                                                                    n / kMinPerThread)));
  }
  job.bounds.resize(tasks + 1);
  job.found.assign(tasks, 0);
  for (int t = 0; t <= tasks; ++t) job.bounds[t] = static_cast<int64_t>(
      static_cast<__int128>(n) * t / tasks);
  if (tasks == 1) {
    run_finite_task(&job, 0);
  } else {
    pool().run(tasks, &run_finite_task, &job);
  }
  for (uint32_t f : job.found) {
    if (f) return 0;
  }
  return 1;
}

// ---- the pool, shared with the other CPU kernels (csrc/cpu_adam_compact.cpp) -----------------
void inf_cpu::run_on_pool(int ntasks, TaskFn fn, void* ctx) {
  if (ntasks <= 1) {
    fn(ctx, 0);
  } else {
    pool().run(ntasks, fn, ctx);
  }
}
