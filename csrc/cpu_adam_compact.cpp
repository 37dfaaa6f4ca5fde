// CPU Adam / AdamW with compact optimizer states (opt-in): the fp32 master weights stay fp32,
// the two moments are stored
//   (a) as bfloat16 (round to nearest even), 4 bytes of state per parameter instead of 8, or
//   (b) as 8-bit codes, block-wise quantized like bitsandbytes' 8-bit Adam: per block of 256
//       elements one fp32 absmax scale per moment, a signed dynamic map for exp_avg and an
//       unsigned one for exp_avg_sq; 2 + 8/256 bytes per parameter.
// Gradients fp32/bf16/fp16 in, optional working copy fp32/bf16/fp16 out, in the same pass, as
// inf_adam_step (csrc/cpu_adam.cpp), whose math (FMAs included, in the same order) and
// host-side scalars these kernels share: given the same fp32 moments they produce bitwise the
// same parameter. The moments are widened to fp32, updated, the parameter is updated with the
// unrounded fp32 moments, and only then are the moments rounded / re-quantized for storage.
//
// Every kernel works on blocks of 256 elements (the quantization block; the bf16 kernel uses the
// same blocking for its driver): full blocks in place, the last partial block on zero-padded
// stack copies. Threads split the work on block boundaries, so any thread count gives bitwise
// the same result, and the AVX-512, AVX2+FMA and scalar paths agree bitwise with each other
// (same operations, and the nearest-code search is an exact count of thresholds).
//
// Path selection, thread count and the worker pool are the ones of inf_adam_step
// (inf_cpu_capability(), INFINITY_CPU_CAPABILITY, inf_set_cpu_capability, inf_set_num_threads).
// GCC 12 reports its own _mm512_undefined_ps() (`__m512 __Y = __Y;`) inside the intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "adam_common.h"
#include "common.h"

namespace {

// ---- shared with csrc/cpu_adam.cpp (csrc/adam_common.h) -----------------------------------------
using inf_adam::Coeffs;
using inf_adam::V256;
using inf_adam::V512;
using inf_adam::avx2_adam;
using inf_adam::avx2_f32_to_bf16;
using inf_adam::avx2_load_grad;
using inf_adam::avx2_store_out;
using inf_adam::avx512_adam;
using inf_adam::avx512_f32_to_bf16;
using inf_adam::avx512_load_grad;
using inf_adam::avx512_store_out;
using inf_adam::bf16_to_f32;
using inf_adam::dtype_size;
using inf_adam::f32_to_bf16;
using inf_adam::make_coeffs;
using inf_adam::make_v256;
using inf_adam::make_v512;
using inf_adam::scalar_adam;
using inf_adam::scalar_load_grad;
using inf_adam::scalar_store_out;
using inf_adam::kNone;
using inf_adam::kF32;
using inf_adam::kBF16;
using inf_adam::kF16;
using inf_adam::kScalar;
using inf_adam::kAVX2;
using inf_adam::kAVX512;
using inf_adam::kOk;
using inf_adam::kErrNullPointer;
using inf_adam::kErrGradDtype;
using inf_adam::kErrOutDtype;
using inf_adam::kErrNegativeLength;

enum Kernel : int { kKernelBF16Moments = 0, kKernel8bit = 1 };
enum Signedness : int { kUnsigned = 0, kSigned = 1 };  // index into QMaps tables

constexpr int kBlock = 256;                      // quantization block (elements)
constexpr int64_t kSingleThreadBelow = 1 << 16;  // elements
constexpr int64_t kMinPerThread = 1 << 15;       // elements

// ---- dynamic quantization maps ------------------------------------------------------------------
// Dynamic tree quantization (Dettmers, "8-bit approximations for parallelism in deep learning",
// 2016; used block-wise for optimizer states in Dettmers et al., "8-bit optimizers via block-wise
// quantization", 2022). A code is read as
//     [sign] [e zero bits] [one indicator bit] [f fraction bits]
// The run of e zeros is a decimal exponent, the fraction bits pick one of 2^f equal bins of
// [0.1, 1] (the value is the bin's midpoint k), so the value is
//     sign * 10^-e * (0.1 + 0.9 * (k + 0.5) / 2^f).
// Small magnitudes (many zeros) get few fraction bits, large ones many: a range of 5.5e-7 .. 1
// with the finest steps near the block's absmax. With 8 bits and e limited to 0..6:
//   signed   (exp_avg):    f = 6 - e  -> 64+32+...+1 = 127 magnitudes per sign; of the two
//                          all-zero patterns, +0 is 0 and -0 is repurposed as +1.0 (the block's
//                          largest positive element is exact);
//   unsigned (exp_avg_sq): no sign, that bit is one more fraction bit: f = 7 - e -> 254 values,
//                          plus 0 and 1.0.
// 256 values each, computed in double, rounded once to fp32 and sorted ascending; a code is the
// index into the sorted table. These are the values bitsandbytes' create_dynamic_map(signed)
// builds (max_exponent_bits=7). infinity/ops/adam_compact.py builds the same table in Python
// with the same double operations (the tests check they are equal).
// Nearest code: thr[i] = fp32 midpoint of map[i] and map[i+1]; code(x) = #{i : thr[i] <= x}
// (binary search over the sorted thresholds; at an exact tie the upper code; NaN -> code 0).
struct QMaps {
  alignas(64) float map[2][kBlock];
  alignas(64) float thr[2][kBlock];     // 255 midpoints, thr[255] = +inf (padding)
  alignas(64) float by8[2][8][32];      // by8[j][c] = thr[8c + j]: 32-entry tables (AVX-512)
  alignas(32) float by32[2][4][8];      // by32[r][c] = thr[32c + 8r + 7]: 8-entry tables (AVX2)
};

void build_dynamic_map(bool is_signed, float* out) {
  static constexpr double kTenE[7] = {1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6};  // exact
  double values[kBlock];
  int k = 0;
  for (int e = 0; e < 7; ++e) {
    const int count = 1 << ((is_signed ? 6 : 7) - e);
    const double ten_e = kTenE[e];
    for (int j = 0; j < count; ++j) {
      const double value = (0.1 + 0.9 * ((j + 0.5) / count)) / ten_e;
      values[k++] = value;
      if (is_signed) values[k++] = -value;
    }
  }
  values[k++] = 0.0;
  values[k++] = 1.0;
  std::sort(values, values + k);
  for (int i = 0; i < kBlock; ++i) out[i] = static_cast<float>(values[i]);
}

QMaps build_qmaps() {
  QMaps q;
  for (int s = 0; s < 2; ++s) {
    build_dynamic_map(s == kSigned, q.map[s]);
    for (int i = 0; i + 1 < kBlock; ++i) q.thr[s][i] = 0.5f * (q.map[s][i] + q.map[s][i + 1]);
    q.thr[s][kBlock - 1] = std::numeric_limits<float>::infinity();
    for (int j = 0; j < 8; ++j) {
      for (int c = 0; c < 32; ++c) q.by8[s][j][c] = q.thr[s][8 * c + j];
    }
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 8; ++c) q.by32[s][r][c] = q.thr[s][32 * c + 8 * r + 7];
    }
  }
  return q;
}

const QMaps& qmaps() {
  static const QMaps q = build_qmaps();  // thread-safe initialization
  return q;
}

// ---- jobs ---------------------------------------------------------------------------------------
// One block (up to 256 elements) at explicit addresses: the arrays, or padded stack copies.
struct Span {
  float* p;
  const void* g;
  void* m;         // bf16 moments or 8-bit codes
  void* v;
  float* m_scale;  // 8-bit: this block's absmax (read, then overwritten); else null
  float* v_scale;
  void* out;       // null when no working copy
  int count;       // valid elements; the block functions may process all 256 (padded) lanes
};

struct Job;
using BlockFn = void (*)(const Job&, const Span&);
using RangeFn = void (*)(const Job&, int64_t block_begin, int64_t block_end);

struct Job {
  float* p = nullptr;
  const void* g = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  void* out = nullptr;
  int64_t n = 0;
  int gsize = 4, msize = 2, osize = 0;
  Coeffs c{};
  const QMaps* q = nullptr;
  BlockFn block = nullptr;
  RangeFn range = nullptr;
  // inf_q8_quantize / inf_q8_dequantize
  const float* x = nullptr;
  const uint8_t* codes_in = nullptr;
  const float* scale_in = nullptr;
  uint8_t* codes = nullptr;
  float* scale = nullptr;
  float* y = nullptr;
  int sign = kSigned;
  void (*quantize)(const float* buf, const QMaps& q, int sign, uint8_t* codes, float* absmax) =
      nullptr;
  std::vector<int64_t> bounds;  // task t runs blocks [bounds[t], bounds[t+1])
};

// The last, partial block: zero-padded stack copies in, the valid elements copied back.
void step_padded(const Job& job, const Span& s) {
  alignas(64) float p[kBlock] = {};
  alignas(64) unsigned char g[kBlock * 4] = {};
  alignas(64) unsigned char m[kBlock * 2] = {};
  alignas(64) unsigned char v[kBlock * 2] = {};
  alignas(64) unsigned char out[kBlock * 4] = {};
  const size_t count = static_cast<size_t>(s.count);
  std::memcpy(p, s.p, count * 4);
  std::memcpy(g, s.g, count * job.gsize);
  std::memcpy(m, s.m, count * job.msize);
  std::memcpy(v, s.v, count * job.msize);
  const Span t{p, g, m, v, s.m_scale, s.v_scale, s.out != nullptr ? out : nullptr, s.count};
  job.block(job, t);
  std::memcpy(s.p, p, count * 4);
  std::memcpy(s.m, m, count * job.msize);
  std::memcpy(s.v, v, count * job.msize);
  if (s.out != nullptr) std::memcpy(s.out, out, count * job.osize);
}

void step_range(const Job& job, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i = b * kBlock;
    const Span s{job.p + i,
                 static_cast<const char*>(job.g) + i * job.gsize,
                 static_cast<char*>(job.m) + i * job.msize,
                 static_cast<char*>(job.v) + i * job.msize,
                 job.m_scale != nullptr ? job.m_scale + b : nullptr,
                 job.v_scale != nullptr ? job.v_scale + b : nullptr,
                 job.out != nullptr ? static_cast<char*>(job.out) + i * job.osize : nullptr,
                 static_cast<int>(std::min<int64_t>(kBlock, job.n - i))};
    if (s.count == kBlock) {
      job.block(job, s);
    } else {
      step_padded(job, s);
    }
  }
}

void run_task(void* ctx, int t) {
  const Job& job = *static_cast<const Job*>(ctx);
  job.range(job, job.bounds[t], job.bounds[t + 1]);
}

void run_job(Job& job) {
  const int64_t blocks = (job.n + kBlock - 1) / kBlock;
  int64_t tasks = 1;
  if (job.n >= kSingleThreadBelow) {
    tasks = std::max<int64_t>(1, std::min<int64_t>(inf_get_num_threads(), job.n / kMinPerThread));
  }
  tasks = std::min(tasks, blocks);
  job.bounds.resize(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) job.bounds[t] = blocks * t / tasks;
  if (tasks <= 1) {
    job.range(job, 0, blocks);
  } else {
    inf_cpu::run_on_pool(static_cast<int>(tasks), &run_task, &job);
  }
}

// ---- scalar path --------------------------------------------------------------------------------
template <int GD, int OD>
void scalar_bf16m_block(const Job& job, const Span& s) {
  uint16_t* m = static_cast<uint16_t*>(s.m);
  uint16_t* v = static_cast<uint16_t*>(s.v);
  for (int i = 0; i < s.count; ++i) {
    float mo, vo;
    const float param = scalar_adam(job.c, scalar_load_grad<GD>(s.g, i), s.p[i],
                                    bf16_to_f32(m[i]), bf16_to_f32(v[i]), mo, vo);
    s.p[i] = param;
    m[i] = f32_to_bf16(mo);
    v[i] = f32_to_bf16(vo);
    if constexpr (OD != kNone) scalar_store_out<OD>(s.out, i, param);
  }
}

// code(x) = #{i : thr[i] <= x}, by an 8-step binary search (thr has 255 sorted entries).
inline int scalar_nearest_code(const float* thr, float x) {
  int idx = 0;
  for (int step = 128; step >= 1; step >>= 1) {
    idx += step & -static_cast<int>(x >= thr[idx + step - 1]);  // branch-free
  }
  return idx;
}

// absmax of 256 values (NaN if any is NaN), then the nearest code of each value / absmax.
void scalar_quantize_block(const float* buf, const QMaps& q, int sign, uint8_t* codes,
                           float* absmax) {
  float mx = 0.f;
  bool nan = false;
  for (int i = 0; i < kBlock; ++i) {
    const float a = std::fabs(buf[i]);
    if (std::isnan(a)) {
      nan = true;
    } else if (a > mx) {
      mx = a;
    }
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : mx;
  *absmax = scale;
  const float div = scale == 0.0f ? 1.0f : scale;
  const float* thr = q.thr[sign];
  for (int i = 0; i < kBlock; ++i) {
    codes[i] = static_cast<uint8_t>(scalar_nearest_code(thr, buf[i] / div));
  }
}

template <int GD, int OD>
void scalar_q8_block(const Job& job, const Span& s) {
  const QMaps& q = *job.q;
  const uint8_t* mq = static_cast<const uint8_t*>(s.m);
  const uint8_t* vq = static_cast<const uint8_t*>(s.v);
  const float ma = *s.m_scale;
  const float va = *s.v_scale;
  alignas(64) float mbuf[kBlock] = {};
  alignas(64) float vbuf[kBlock] = {};
  for (int i = 0; i < s.count; ++i) {
    const float mi = q.map[kSigned][mq[i]] * ma;
    const float vi = q.map[kUnsigned][vq[i]] * va;
    const float param =
        scalar_adam(job.c, scalar_load_grad<GD>(s.g, i), s.p[i], mi, vi, mbuf[i], vbuf[i]);
    s.p[i] = param;
    if constexpr (OD != kNone) scalar_store_out<OD>(s.out, i, param);
  }
  alignas(64) uint8_t codes[kBlock];
  scalar_quantize_block(mbuf, q, kSigned, codes, s.m_scale);
  std::memcpy(s.m, codes, static_cast<size_t>(s.count));
  scalar_quantize_block(vbuf, q, kUnsigned, codes, s.v_scale);
  std::memcpy(s.v, codes, static_cast<size_t>(s.count));
}

// ---- vector paths: shared, ISA-independent ------------------------------------------------------
using QuantizeFn = void (*)(const float*, const QMaps&, int, uint8_t*, float*);

// The end of a vector 8-bit block: the updated fp32 moments of all 256 lanes (mbuf, vbuf) are
// re-quantized into the block's codes and absmax; padding lanes are zeroed first so they do not
// enter the absmax.
template <QuantizeFn QUANTIZE>
void requantize(const Span& s, const QMaps& q, float* mbuf, float* vbuf) {
  if (s.count < kBlock) {
    std::fill(mbuf + s.count, mbuf + kBlock, 0.f);
    std::fill(vbuf + s.count, vbuf + kBlock, 0.f);
  }
  QUANTIZE(mbuf, q, kSigned, static_cast<uint8_t*>(s.m), s.m_scale);
  QUANTIZE(vbuf, q, kUnsigned, static_cast<uint8_t*>(s.v), s.v_scale);
}

// ---- AVX-512 path -------------------------------------------------------------------------------
INF_TARGET_AVX512 inline __m512 avx512_bf16_to_f32(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int GD, int OD>
INF_TARGET_AVX512 void avx512_bf16m_block(const Job& job, const Span& s) {
  const V512 c = make_v512(job.c);
  uint16_t* m = static_cast<uint16_t*>(s.m);
  uint16_t* v = static_cast<uint16_t*>(s.v);
  for (int i = 0; i < kBlock; i += 16) {
    __m512 mo, vo;
    const __m512 param =
        avx512_adam(job.c, c, avx512_load_grad<GD, false>(s.g, i, 0), _mm512_loadu_ps(s.p + i),
                    avx512_bf16_to_f32(m + i), avx512_bf16_to_f32(v + i), mo, vo);
    _mm512_storeu_ps(s.p + i, param);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + i), avx512_f32_to_bf16(mo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), avx512_f32_to_bf16(vo));
    if constexpr (OD != kNone) avx512_store_out<OD, false, false>(s.out, i, 0, param);
  }
}

INF_TARGET_AVX512 void avx512_quantize_block(const float* buf, const QMaps& q, int sign,
                                             uint8_t* codes, float* absmax) {
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int i = 0; i < kBlock; i += 16) {
    const __m512 x = _mm512_loadu_ps(buf + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    mx = _mm512_max_ps(_mm512_abs_ps(x), mx);  // a NaN first operand yields the second
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx);
  *absmax = scale;
  const __m512 div = _mm512_set1_ps(scale == 0.0f ? 1.0f : scale);
  // The binary search without gathers: 32-entry tables (two registers, one vpermt2ps per
  // lookup). Steps 128..8 visit only thr[8c + 7] (table 7, index c); after them the code is
  // 8c + j, and steps 4, 2, 1 visit thr[8c + 3], thr[8c + j + 1], thr[8c + j]: tables 3,
  // {1, 5} and {0, 2, 4, 6}, indexed by c and selected by the bits of j found so far.
  const float(*by8)[32] = q.by8[sign];
  __m512 lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    lo[j] = _mm512_load_ps(by8[j]);
    hi[j] = _mm512_load_ps(by8[j] + 16);
  }
  for (int i = 0; i < kBlock; i += 16) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(buf + i), div);
    __m512i c = _mm512_setzero_si512();
    for (int step = 16; step >= 1; step >>= 1) {
      const __m512i at = _mm512_add_epi32(c, _mm512_set1_epi32(step - 1));
      const __m512 t = _mm512_permutex2var_ps(lo[7], at, hi[7]);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ), c,
                                _mm512_set1_epi32(step));
    }
    const __mmask16 b2 =
        _mm512_cmp_ps_mask(x, _mm512_permutex2var_ps(lo[3], c, hi[3]), _CMP_GE_OQ);
    const __m512 t1 = _mm512_mask_blend_ps(b2, _mm512_permutex2var_ps(lo[1], c, hi[1]),
                                           _mm512_permutex2var_ps(lo[5], c, hi[5]));
    const __mmask16 b1 = _mm512_cmp_ps_mask(x, t1, _CMP_GE_OQ);
    const __m512 t0a = _mm512_mask_blend_ps(b1, _mm512_permutex2var_ps(lo[0], c, hi[0]),
                                            _mm512_permutex2var_ps(lo[2], c, hi[2]));
    const __m512 t0b = _mm512_mask_blend_ps(b1, _mm512_permutex2var_ps(lo[4], c, hi[4]),
                                            _mm512_permutex2var_ps(lo[6], c, hi[6]));
    const __mmask16 b0 = _mm512_cmp_ps_mask(x, _mm512_mask_blend_ps(b2, t0a, t0b), _CMP_GE_OQ);
    __m512i idx = _mm512_slli_epi32(c, 3);
    idx = _mm512_mask_add_epi32(idx, b2, idx, _mm512_set1_epi32(4));
    idx = _mm512_mask_add_epi32(idx, b1, idx, _mm512_set1_epi32(2));
    idx = _mm512_mask_add_epi32(idx, b0, idx, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(idx));
  }
}

// table[idx] for 16 indices in 0..255 without a gather: eight 32-entry lookups (vpermt2ps on
// the low 5 bits), then a selection by bits 5, 6 and 7.
INF_TARGET_AVX512 inline __m512 avx512_lookup256(const float* table, __m512i idx) {
  __m512 r[8];
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_permutex2var_ps(_mm512_load_ps(table + 32 * k), idx,
                                  _mm512_load_ps(table + 32 * k + 16));
  }
  const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
  for (int k = 0; k < 4; ++k) r[k] = _mm512_mask_blend_ps(b5, r[2 * k], r[2 * k + 1]);
  for (int k = 0; k < 2; ++k) r[k] = _mm512_mask_blend_ps(b6, r[2 * k], r[2 * k + 1]);
  return _mm512_mask_blend_ps(b7, r[0], r[1]);
}

template <int GD, int OD>
INF_TARGET_AVX512 void avx512_q8_block(const Job& job, const Span& s) {
  const V512 c = make_v512(job.c);
  const QMaps& q = *job.q;
  const uint8_t* mq = static_cast<const uint8_t*>(s.m);
  const uint8_t* vq = static_cast<const uint8_t*>(s.v);
  const __m512 ma = _mm512_set1_ps(*s.m_scale);
  const __m512 va = _mm512_set1_ps(*s.v_scale);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 16) {
    const __m512i mc =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mq + i)));
    const __m512i vc =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vq + i)));
    const __m512 mi = _mm512_mul_ps(avx512_lookup256(q.map[kSigned], mc), ma);
    const __m512 vi = _mm512_mul_ps(avx512_lookup256(q.map[kUnsigned], vc), va);
    __m512 mo, vo;
    const __m512 param = avx512_adam(job.c, c, avx512_load_grad<GD, false>(s.g, i, 0),
                                     _mm512_loadu_ps(s.p + i), mi, vi, mo, vo);
    _mm512_storeu_ps(s.p + i, param);
    _mm512_store_ps(mbuf + i, mo);
    _mm512_store_ps(vbuf + i, vo);
    if constexpr (OD != kNone) avx512_store_out<OD, false, false>(s.out, i, 0, param);
  }
  requantize<&avx512_quantize_block>(s, q, mbuf, vbuf);
}

// ---- AVX2 path ----------------------------------------------------------------------------------
INF_TARGET_AVX2 inline __m256 avx2_bf16_to_f32(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int GD, int OD>
INF_TARGET_AVX2 void avx2_bf16m_block(const Job& job, const Span& s) {
  const V256 c = make_v256(job.c);
  const char* g = static_cast<const char*>(s.g);
  char* out = static_cast<char*>(s.out);
  uint16_t* m = static_cast<uint16_t*>(s.m);
  uint16_t* v = static_cast<uint16_t*>(s.v);
  for (int i = 0; i < kBlock; i += 8) {
    __m256 mo, vo;
    const __m256 param = avx2_adam(job.c, c, avx2_load_grad<GD>(g + i * dtype_size(GD)),
                                   _mm256_loadu_ps(s.p + i), avx2_bf16_to_f32(m + i),
                                   avx2_bf16_to_f32(v + i), mo, vo);
    _mm256_storeu_ps(s.p + i, param);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + i), avx2_f32_to_bf16(mo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + i), avx2_f32_to_bf16(vo));
    if constexpr (OD != kNone) avx2_store_out<OD, false>(out + i * dtype_size(OD), param);
  }
}

INF_TARGET_AVX2 void avx2_quantize_block(const float* buf, const QMaps& q, int sign,
                                         uint8_t* codes, float* absmax) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) {
    const __m256 x = _mm256_loadu_ps(buf + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mx = _mm256_max_ps(_mm256_and_ps(x, abs_mask), mx);  // a NaN first operand yields the second
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float scale = _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN()
                                                   : _mm_cvtss_f32(m4);
  *absmax = scale;
  const __m256 div = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
  // Steps 128..32 visit thr[32c + 31], step 16 thr[32c + 15], step 8 thr[32c + 7 or 23]:
  // 8-entry tables indexed by c (one vpermps each); steps 4, 2, 1 gather from thr.
  const __m256 row0 = _mm256_load_ps(q.by32[sign][0]);
  const __m256 row1 = _mm256_load_ps(q.by32[sign][1]);
  const __m256 row2 = _mm256_load_ps(q.by32[sign][2]);
  const __m256 row3 = _mm256_load_ps(q.by32[sign][3]);
  const float* thr = q.thr[sign];
  for (int i = 0; i < kBlock; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(buf + i), div);
    __m256i c = _mm256_setzero_si256();
    for (int step = 4; step >= 1; step >>= 1) {
      const __m256 t =
          _mm256_permutevar8x32_ps(row3, _mm256_add_epi32(c, _mm256_set1_epi32(step - 1)));
      const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(x, t, _CMP_GE_OQ));
      c = _mm256_add_epi32(c, _mm256_and_si256(ge, _mm256_set1_epi32(step)));
    }
    const __m256 ge16 = _mm256_cmp_ps(x, _mm256_permutevar8x32_ps(row1, c), _CMP_GE_OQ);
    const __m256 t8 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(row0, c),
                                       _mm256_permutevar8x32_ps(row2, c), ge16);
    const __m256 ge8 = _mm256_cmp_ps(x, t8, _CMP_GE_OQ);
    __m256i idx = _mm256_slli_epi32(c, 5);
    idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(ge16),
                                                 _mm256_set1_epi32(16)));
    idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(ge8),
                                                 _mm256_set1_epi32(8)));
    for (int step = 4; step >= 1; step >>= 1) {
      const __m256 t =
          _mm256_i32gather_ps(thr, _mm256_add_epi32(idx, _mm256_set1_epi32(step - 1)), 4);
      const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(x, t, _CMP_GE_OQ));
      idx = _mm256_add_epi32(idx, _mm256_and_si256(ge, _mm256_set1_epi32(step)));
    }
    const __m128i w =
        _mm_packus_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
  }
}

template <int GD, int OD>
INF_TARGET_AVX2 void avx2_q8_block(const Job& job, const Span& s) {
  const V256 c = make_v256(job.c);
  const char* g = static_cast<const char*>(s.g);
  char* out = static_cast<char*>(s.out);
  const QMaps& q = *job.q;
  const uint8_t* mq = static_cast<const uint8_t*>(s.m);
  const uint8_t* vq = static_cast<const uint8_t*>(s.v);
  const __m256 ma = _mm256_set1_ps(*s.m_scale);
  const __m256 va = _mm256_set1_ps(*s.v_scale);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 8) {
    const __m256i mc =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mq + i)));
    const __m256i vc =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vq + i)));
    const __m256 mi = _mm256_mul_ps(_mm256_i32gather_ps(q.map[kSigned], mc, 4), ma);
    const __m256 vi = _mm256_mul_ps(_mm256_i32gather_ps(q.map[kUnsigned], vc, 4), va);
    __m256 mo, vo;
    const __m256 param = avx2_adam(job.c, c, avx2_load_grad<GD>(g + i * dtype_size(GD)),
                                   _mm256_loadu_ps(s.p + i), mi, vi, mo, vo);
    _mm256_storeu_ps(s.p + i, param);
    _mm256_store_ps(mbuf + i, mo);
    _mm256_store_ps(vbuf + i, vo);
    if constexpr (OD != kNone) avx2_store_out<OD, false>(out + i * dtype_size(OD), param);
  }
  requantize<&avx2_quantize_block>(s, q, mbuf, vbuf);
}

// ---- dispatch -----------------------------------------------------------------------------------
template <int K, int GD, int OD>
BlockFn pick(int cap) {
  if constexpr (K == kKernelBF16Moments) {
    if (cap == kAVX512) return &avx512_bf16m_block<GD, OD>;
    if (cap == kAVX2) return &avx2_bf16m_block<GD, OD>;
    return &scalar_bf16m_block<GD, OD>;
  } else {
    if (cap == kAVX512) return &avx512_q8_block<GD, OD>;
    if (cap == kAVX2) return &avx2_q8_block<GD, OD>;
    return &scalar_q8_block<GD, OD>;
  }
}

template <int K, int GD>
BlockFn pick_out(int cap, int od) {
  switch (od) {
    case kF32: return pick<K, GD, kF32>(cap);
    case kBF16: return pick<K, GD, kBF16>(cap);
    case kF16: return pick<K, GD, kF16>(cap);
    default: return pick<K, GD, kNone>(cap);
  }
}

template <int K>
BlockFn select_block(int cap, int gd, int od) {
  switch (gd) {
    case kF32: return pick_out<K, kF32>(cap, od);
    case kBF16: return pick_out<K, kBF16>(cap, od);
    default: return pick_out<K, kF16>(cap, od);
  }
}

QuantizeFn select_quantize(int cap) {
  if (cap == kAVX512) return &avx512_quantize_block;
  if (cap == kAVX2) return &avx2_quantize_block;
  return &scalar_quantize_block;
}

std::atomic<int64_t> g_calls[2][3];

int check_dtypes(int g_dtype, void* out, int& out_dtype) {
  if (g_dtype != kF32 && g_dtype != kBF16 && g_dtype != kF16) return kErrGradDtype;
  if (out == nullptr) out_dtype = kNone;
  if (out_dtype != kNone && out_dtype != kF32 && out_dtype != kBF16 && out_dtype != kF16) {
    return kErrOutDtype;
  }
  return kOk;
}

void quantize_range(const Job& job, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i = b * kBlock;
    const int64_t count = std::min<int64_t>(kBlock, job.n - i);
    if (count == kBlock) {
      job.quantize(job.x + i, *job.q, job.sign, job.codes + i, job.scale + b);
    } else {
      alignas(64) float buf[kBlock] = {};
      alignas(64) uint8_t codes[kBlock];
      std::memcpy(buf, job.x + i, static_cast<size_t>(count) * 4);
      job.quantize(buf, *job.q, job.sign, codes, job.scale + b);
      std::memcpy(job.codes + i, codes, static_cast<size_t>(count));
    }
  }
}

void dequantize_range(const Job& job, int64_t b0, int64_t b1) {
  const float* map = job.q->map[job.sign];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * kBlock;
    const int64_t i1 = std::min<int64_t>(i0 + kBlock, job.n);
    const float scale = job.scale_in[b];
    for (int64_t i = i0; i < i1; ++i) job.y[i] = map[job.codes_in[i]] * scale;
  }
}

}  // namespace

// ---- C ABI --------------------------------------------------------------------------------------
// Error codes are those of inf_adam_step (inf_adam_strerror describes them).

// One Adam/AdamW step with bf16 moments: p (fp32) updated in place, m and v (bfloat16 bits)
// widened, updated in fp32 and stored rounded to nearest even; optional working copy into out.
// Arguments otherwise exactly as inf_adam_step.
INF_API int inf_adam_step_bf16m(float* p, const void* g, int g_dtype, uint16_t* m, uint16_t* v,
                                void* out, int out_dtype, int64_t n, double lr, double beta1,
                                double beta2, double eps, double weight_decay, int adamw,
                                double bias_correction1, double bias_correction2_sqrt,
                                double grad_multiplier) {
  if (n < 0) return kErrNegativeLength;
  const int err = check_dtypes(g_dtype, out, out_dtype);
  if (err != kOk) return err;
  if (n == 0) return kOk;
  if (p == nullptr || g == nullptr || m == nullptr || v == nullptr) return kErrNullPointer;
  const int cap = inf_cpu_capability();
  g_calls[kKernelBF16Moments][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.p = p;
  job.g = g;
  job.m = m;
  job.v = v;
  job.out = out;
  job.n = n;
  job.gsize = dtype_size(g_dtype);
  job.msize = 2;
  job.osize = dtype_size(out_dtype);
  job.c = make_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                      bias_correction2_sqrt, grad_multiplier);
  job.block = select_block<kKernelBF16Moments>(cap, g_dtype, out_dtype);
  job.range = &step_range;
  run_job(job);
  return kOk;
}

// One Adam/AdamW step with 8-bit block-wise quantized moments. m_codes/v_codes: n codes each
// (signed / unsigned dynamic map); m_absmax/v_absmax: ceil(n/256) fp32 scales each. Per block:
// dequantize (map[code] * absmax), update in fp32, update p with the fp32 moments, then store
// the new absmax and the nearest codes. All-zero codes with zero scales are a zero state.
// Non-finite gradients poison the block (its absmax becomes NaN or inf).
INF_API int inf_adam_step_q8(float* p, const void* g, int g_dtype, uint8_t* m_codes,
                             float* m_absmax, uint8_t* v_codes, float* v_absmax, void* out,
                             int out_dtype, int64_t n, double lr, double beta1, double beta2,
                             double eps, double weight_decay, int adamw,
                             double bias_correction1, double bias_correction2_sqrt,
                             double grad_multiplier) {
  if (n < 0) return kErrNegativeLength;
  const int err = check_dtypes(g_dtype, out, out_dtype);
  if (err != kOk) return err;
  if (n == 0) return kOk;
  if (p == nullptr || g == nullptr || m_codes == nullptr || m_absmax == nullptr ||
      v_codes == nullptr || v_absmax == nullptr) {
    return kErrNullPointer;
  }
  const int cap = inf_cpu_capability();
  g_calls[kKernel8bit][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.p = p;
  job.g = g;
  job.m = m_codes;
  job.v = v_codes;
  job.m_scale = m_absmax;
  job.v_scale = v_absmax;
  job.out = out;
  job.n = n;
  job.gsize = dtype_size(g_dtype);
  job.msize = 1;
  job.osize = dtype_size(out_dtype);
  job.c = make_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                      bias_correction2_sqrt, grad_multiplier);
  job.q = &qmaps();
  job.block = select_block<kKernel8bit>(cap, g_dtype, out_dtype);
  job.range = &step_range;
  run_job(job);
  return kOk;
}

INF_API int inf_q8_block_size() { return kBlock; }

// The 256-entry dynamic map (sorted ascending): is_signed != 0 for exp_avg, 0 for exp_avg_sq.
INF_API int inf_q8_dynamic_map(int is_signed, float* out) {
  if (out == nullptr) return kErrNullPointer;
  std::memcpy(out, qmaps().map[is_signed != 0 ? kSigned : kUnsigned], kBlock * sizeof(float));
  return kOk;
}

// Block-wise quantization of n fp32 values (the kernel's own re-quantization): absmax per block
// of 256 into absmax[ceil(n/256)], nearest codes into codes[n].
INF_API int inf_q8_quantize(const float* x, int64_t n, int is_signed, uint8_t* codes,
                            float* absmax) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return kOk;
  if (x == nullptr || codes == nullptr || absmax == nullptr) return kErrNullPointer;
  Job job;
  job.n = n;
  job.x = x;
  job.codes = codes;
  job.scale = absmax;
  job.sign = is_signed != 0 ? kSigned : kUnsigned;
  job.q = &qmaps();
  job.quantize = select_quantize(inf_cpu_capability());
  job.range = &quantize_range;
  run_job(job);
  return kOk;
}

// out[i] = map[codes[i]] * absmax[i / 256] (fp32 product, as in the kernel).
INF_API int inf_q8_dequantize(const uint8_t* codes, const float* absmax, int64_t n,
                              int is_signed, float* out) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return kOk;
  if (codes == nullptr || absmax == nullptr || out == nullptr) return kErrNullPointer;
  Job job;
  job.n = n;
  job.codes_in = codes;
  job.scale_in = absmax;
  job.y = out;
  job.sign = is_signed != 0 ? kSigned : kUnsigned;
  job.q = &qmaps();
  job.range = &dequantize_range;
  run_job(job);
  return kOk;
}

// Number of calls of kernel (0: bf16 moments, 1: 8-bit) that ran on each capability.
INF_API int64_t inf_adam_compact_calls(int kernel, int capability) {
  if (kernel < kKernelBF16Moments || kernel > kKernel8bit) return -1;
  if (capability < kScalar || capability > kAVX512) return -1;
  return g_calls[kernel][capability].load();
}
