// bf16 master weights for the CPU Adam kernels (opt-in, infinity.optim ``master=``):
//   bf16_sr:    the master is stored as bfloat16; the fp32 result of a step is rounded to bf16
//               *stochastically*: 16 pseudo-random bits are added to the fp32 bit pattern
//               below bit 16 and the low half is dropped, so a value between two bf16
//               neighbours goes up with probability (distance to the lower one) / (their gap):
//               unbiased in expectation. 2 bytes per parameter.
//   bf16_kahan: the master is a bf16 pair (hi, comp) whose value is hi + comp (fp32 sum):
//               hi = round-to-nearest-even(p), comp = RNE(p - hi) (p - hi is exact in fp32),
//               which keeps ~16 significant bits. 4 bytes per parameter, deterministic.
// A step is "widen the master to fp32 (inf_bf16_master_widen), run the Adam kernel of the
// moment format on it (inf_adam_step / _bf16m / _q8 unchanged), round it back
// (inf_bf16_master_round)", which also writes the working copy from the stored master.
//
// Random bits: a counter-based hash of (seed, step, global element index j), no state:
//   key = splitmix64(seed ^ splitmix64(step)), k1 = low 32 bits, k2 = high 32 bits
//   h   = lowbias32(lowbias32(lo32(j) ^ k1) ^ hi32(j) ^ k2);  bits added = h >> 16
// so the rounding of an element depends only on (seed, step, j): any thread count, any split of
// the array into calls (given the right index offset) and every ISA path give the same bits.
// infinity/ops/bf16_master.py computes the same hash in PyTorch (the fallback, the tests).
//
// Paths: AVX-512, AVX2 (+FMA/F16C for the fp16 working copy) and scalar, chosen like the other
// kernels (inf_cpu_capability(), with its override); all produce bitwise the same output.
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

using inf_adam::bf16_to_f32;
using inf_adam::bits_f32;
using inf_adam::dtype_size;
using inf_adam::f32_bits;
using inf_adam::f32_to_bf16;
using inf_adam::f32_to_f16;
using inf_adam::kAVX2;
using inf_adam::kAVX512;
using inf_adam::kBF16;
using inf_adam::kErrNegativeLength;
using inf_adam::kErrNullPointer;
using inf_adam::kErrOutDtype;
using inf_adam::kF16;
using inf_adam::kF32;
using inf_adam::kNone;
using inf_adam::kOk;
using inf_adam::kScalar;

enum Mode : int { kModeSR = 0, kModeKahan = 1 };
constexpr int kErrMode = -7;  // not one of inf_adam_strerror's codes: described by the caller

constexpr int64_t kGrain = 256;                  // task boundaries are multiples of this
constexpr int64_t kSingleThreadBelow = 1 << 16;  // elements
constexpr int64_t kMinPerThread = 1 << 15;       // elements

// ---- hash -----------------------------------------------------------------------------------
constexpr uint32_t kMul1 = 0x7feb352dU;
constexpr uint32_t kMul2 = 0x846ca68bU;

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

inline uint32_t sr_hash(uint32_t k1, uint32_t k2, uint64_t j) {
  return lowbias32(lowbias32(static_cast<uint32_t>(j) ^ k1) ^ static_cast<uint32_t>(j >> 32) ^
                   k2);
}

// ---- scalar element math --------------------------------------------------------------------
inline uint16_t bf16_sr(float f, uint32_t h) {
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((f32_bits(f) + (h >> 16)) >> 16);
}

// Kahan pair of p: hi = RNE(p), comp = RNE(p - hi); comp = 0 where p - hi is not finite
// (p infinite, or p rounding to an infinite hi).
inline void kahan_split(float p, uint16_t& hi, uint16_t& comp) {
  hi = f32_to_bf16(p);
  const float d = p - bf16_to_f32(hi);
  comp = std::isfinite(d) ? f32_to_bf16(d) : 0;
}

inline void store_out(void* out, int od, int64_t i, float x) {
  if (od == kF32) static_cast<float*>(out)[i] = x;
  if (od == kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  if (od == kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
}

struct Job {
  // round
  const float* p = nullptr;
  uint16_t* master = nullptr;
  uint16_t* comp = nullptr;
  void* out = nullptr;
  int od = kNone;
  int mode = kModeSR;
  uint32_t k1 = 0, k2 = 0;
  uint64_t index0 = 0;
  // widen
  const uint16_t* wm = nullptr;
  const uint16_t* wc = nullptr;
  float* wout = nullptr;
  int64_t n = 0;
  void (*range)(const Job&, int64_t, int64_t) = nullptr;
  std::vector<int64_t> bounds;
};

void scalar_round(const Job& job, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float p = job.p[i];
    float value;
    if (job.mode == kModeSR) {
      const uint16_t m = bf16_sr(p, sr_hash(job.k1, job.k2, job.index0 + static_cast<uint64_t>(i)));
      job.master[i] = m;
      value = bf16_to_f32(m);
    } else {
      uint16_t hi, comp;
      kahan_split(p, hi, comp);
      job.master[i] = hi;
      job.comp[i] = comp;
      value = bf16_to_f32(hi) + bf16_to_f32(comp);
    }
    if (job.out != nullptr) store_out(job.out, job.od, i, value);
  }
}

void scalar_widen(const Job& job, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float m = bf16_to_f32(job.wm[i]);
    job.wout[i] = job.wc != nullptr ? m + bf16_to_f32(job.wc[i]) : m;
  }
}

// True when lo32(index0 + i + w - 1) wraps past lo32(index0 + i) (the vector lanes then do not
// share hi32; such vectors go through the scalar code).
inline bool wraps(uint64_t j, int w) {
  return static_cast<uint32_t>(j) > 0xFFFFFFFFu - static_cast<uint32_t>(w - 1);
}

// ---- AVX-512 --------------------------------------------------------------------------------
INF_TARGET_AVX512 inline __m512i avx512_lowbias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMul2)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

INF_TARGET_AVX512 inline __m512 avx512_bf16_load(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// RNE to bf16 with NaN -> 0x7FC0, as 32-bit lanes (the caller narrows).
INF_TARGET_AVX512 inline __m512i avx512_rne32(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  return _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7FC0), r);
}

INF_TARGET_AVX512 inline __m512 avx512_from32(__m512i h) {  // bf16 in 32-bit lanes -> f32
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

INF_TARGET_AVX512 void avx512_round(const Job& job, int64_t i0, int64_t i1) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i k1 = _mm512_set1_epi32(static_cast<int>(job.k1));
  const __m512i k2 = _mm512_set1_epi32(static_cast<int>(job.k2));
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const uint64_t j = job.index0 + static_cast<uint64_t>(i);
    if (job.mode == kModeSR && wraps(j, 16)) {
      scalar_round(job, i, i + 16);
      continue;
    }
    const __m512 p = _mm512_loadu_ps(job.p + i);
    __m512 value;
    if (job.mode == kModeSR) {
      const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(j))), iota);
      __m512i h = avx512_lowbias32(_mm512_xor_si512(lo, k1));
      h = _mm512_xor_si512(h, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(j >> 32))));
      h = avx512_lowbias32(_mm512_xor_si512(h, k2));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_srli_epi32(h, 16)), 16);
      const __mmask16 ordered = _mm512_cmp_ps_mask(p, p, _CMP_ORD_Q);
      r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7FC0), r);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(job.master + i), _mm512_cvtepi32_epi16(r));
      value = avx512_from32(r);
    } else {
      const __m512i hi = avx512_rne32(p);
      const __m512 hf = avx512_from32(hi);
      const __m512 d = _mm512_sub_ps(p, hf);
      // finite d: |d| < inf (d - d == 0 is false for inf and NaN)
      const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(d, d), _mm512_setzero_ps(), _CMP_EQ_OQ);
      const __m512i comp = _mm512_maskz_mov_epi32(finite, avx512_rne32(d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(job.master + i), _mm512_cvtepi32_epi16(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(job.comp + i), _mm512_cvtepi32_epi16(comp));
      value = _mm512_add_ps(hf, avx512_from32(comp));
    }
    if (job.od == kF32) {
      _mm512_storeu_ps(static_cast<float*>(job.out) + i, value);
    } else if (job.od == kBF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(job.out) + i),
                          _mm512_cvtepi32_epi16(avx512_rne32(value)));
    } else if (job.od == kF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(job.out) + i),
                          _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  scalar_round(job, i, i1);
}

INF_TARGET_AVX512 void avx512_widen(const Job& job, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    __m512 x = avx512_bf16_load(job.wm + i);
    if (job.wc != nullptr) x = _mm512_add_ps(x, avx512_bf16_load(job.wc + i));
    _mm512_storeu_ps(job.wout + i, x);
  }
  scalar_widen(job, i, i1);
}

// ---- AVX2 -----------------------------------------------------------------------------------
INF_TARGET_AVX2 inline __m256i avx2_lowbias32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

INF_TARGET_AVX2 inline __m256 avx2_bf16_load(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INF_TARGET_AVX2 inline __m256i avx2_rne32(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
  return _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, ordered);
}

INF_TARGET_AVX2 inline __m256 avx2_from32(__m256i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

INF_TARGET_AVX2 inline __m128i avx2_narrow(__m256i r) {  // 8 lanes of 0..0xFFFF -> 8 x u16
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

INF_TARGET_AVX2 void avx2_round(const Job& job, int64_t i0, int64_t i1) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i k1 = _mm256_set1_epi32(static_cast<int>(job.k1));
  const __m256i k2 = _mm256_set1_epi32(static_cast<int>(job.k2));
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const uint64_t j = job.index0 + static_cast<uint64_t>(i);
    if (job.mode == kModeSR && wraps(j, 8)) {
      scalar_round(job, i, i + 8);
      continue;
    }
    const __m256 p = _mm256_loadu_ps(job.p + i);
    __m256 value;
    if (job.mode == kModeSR) {
      const __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(j))), iota);
      __m256i h = avx2_lowbias32(_mm256_xor_si256(lo, k1));
      h = _mm256_xor_si256(h, _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(j >> 32))));
      h = avx2_lowbias32(_mm256_xor_si256(h, k2));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_srli_epi32(h, 16)), 16);
      const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_ORD_Q));
      r = _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, ordered);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(job.master + i), avx2_narrow(r));
      value = avx2_from32(r);
    } else {
      const __m256i hi = avx2_rne32(p);
      const __m256 hf = avx2_from32(hi);
      const __m256 d = _mm256_sub_ps(p, hf);
      const __m256i finite = _mm256_castps_si256(
          _mm256_cmp_ps(_mm256_sub_ps(d, d), _mm256_setzero_ps(), _CMP_EQ_OQ));
      const __m256i comp = _mm256_and_si256(finite, avx2_rne32(d));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(job.master + i), avx2_narrow(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(job.comp + i), avx2_narrow(comp));
      value = _mm256_add_ps(hf, avx2_from32(comp));
    }
    if (job.od == kF32) {
      _mm256_storeu_ps(static_cast<float*>(job.out) + i, value);
    } else if (job.od == kBF16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(job.out) + i),
                       avx2_narrow(avx2_rne32(value)));
    } else if (job.od == kF16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(job.out) + i),
                       _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  scalar_round(job, i, i1);
}

INF_TARGET_AVX2 void avx2_widen(const Job& job, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 x = avx2_bf16_load(job.wm + i);
    if (job.wc != nullptr) x = _mm256_add_ps(x, avx2_bf16_load(job.wc + i));
    _mm256_storeu_ps(job.wout + i, x);
  }
  scalar_widen(job, i, i1);
}

// ---- driver ---------------------------------------------------------------------------------
void run_task(void* ctx, int t) {
  const Job& job = *static_cast<const Job*>(ctx);
  job.range(job, job.bounds[t], job.bounds[t + 1]);
}

void run_job(Job& job) {
  const int64_t grains = (job.n + kGrain - 1) / kGrain;
  int64_t tasks = 1;
  if (job.n >= kSingleThreadBelow) {
    tasks = std::max<int64_t>(1, std::min<int64_t>(inf_get_num_threads(), job.n / kMinPerThread));
  }
  tasks = std::min(tasks, grains);
  job.bounds.resize(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) job.bounds[t] = std::min(job.n, grains * t / tasks * kGrain);
  if (tasks <= 1) {
    job.range(job, 0, job.n);
  } else {
    inf_cpu::run_on_pool(static_cast<int>(tasks), &run_task, &job);
  }
}

std::atomic<int64_t> g_calls[2][3];  // [0 widen, 1 round][capability]

}  // namespace

// ---- C ABI ------------------------------------------------------------------------------------
// The 32-bit hash of (seed, step, j) whose high 16 bits bf16_sr adds (for tests / references).
INF_API uint32_t inf_sr_hash(uint64_t seed, uint64_t step, uint64_t j) {
  const uint64_t key = splitmix64(seed ^ splitmix64(step));
  return sr_hash(static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), j);
}

// out[i] = f32(master[i]) (+ f32(comp[i]) when comp is not null; an exact fp32 sum for
// Kahan pairs whose parts are at most 16 binades apart, else rounded to nearest).
INF_API int inf_bf16_master_widen(const uint16_t* master, const uint16_t* comp, float* out,
                                  int64_t n) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return kOk;
  if (master == nullptr || out == nullptr) return kErrNullPointer;
  const int cap = inf_cpu_capability();
  g_calls[0][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.wm = master;
  job.wc = comp;
  job.wout = out;
  job.n = n;
  job.range = cap == kAVX512 ? &avx512_widen : (cap == kAVX2 ? &avx2_widen : &scalar_widen);
  run_job(job);
  return kOk;
}

// Stores fp32 values p[0..n) as bf16 masters: mode 0 (SR) into master (comp must be null),
// element i rounded with the hash of (seed, step, index0 + i); mode 1 (Kahan) into
// master + comp. Optional working copy out (out_dtype fp32/bf16/fp16; kNone or a null out for
// none) = the stored value (SR: the bf16 master; Kahan: f32(hi) + f32(comp)), rounded to
// nearest even into its dtype.
INF_API int inf_bf16_master_round(const float* p, uint16_t* master, uint16_t* comp, int mode,
                                  uint64_t seed, uint64_t step, uint64_t index0, void* out,
                                  int out_dtype, int64_t n) {
  if (n < 0) return kErrNegativeLength;
  if (mode != kModeSR && mode != kModeKahan) return kErrMode;
  if (out == nullptr) out_dtype = kNone;
  if (out_dtype != kNone && out_dtype != kF32 && out_dtype != kBF16 && out_dtype != kF16) {
    return kErrOutDtype;
  }
  if (n == 0) return kOk;
  if (p == nullptr || master == nullptr) return kErrNullPointer;
  if ((mode == kModeKahan) != (comp != nullptr)) return kErrMode;
  const int cap = inf_cpu_capability();
  g_calls[1][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.p = p;
  job.master = master;
  job.comp = comp;
  job.out = out_dtype == kNone ? nullptr : out;
  job.od = out_dtype;
  job.mode = mode;
  const uint64_t key = splitmix64(seed ^ splitmix64(step));
  job.k1 = static_cast<uint32_t>(key);
  job.k2 = static_cast<uint32_t>(key >> 32);
  job.index0 = index0;
  job.n = n;
  job.range = cap == kAVX512 ? &avx512_round : (cap == kAVX2 ? &avx2_round : &scalar_round);
  run_job(job);
  return kOk;
}

// Number of calls of kernel (0: widen, 1: round) that ran on each capability.
INF_API int64_t inf_bf16_master_calls(int kernel, int capability) {
  if (kernel < 0 || kernel > 1 || capability < kScalar || capability > kAVX512) return -1;
  return g_calls[kernel][capability].load();
}
