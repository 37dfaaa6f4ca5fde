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
// (same operations: the quantization's level rule and the moment guard are fp32 products and
// compares that each path computes alike).
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
// Quantization (value -> code) without a search. The map is a decimal exponent (decade e) and a
// linear fraction, so the nearest code is found arithmetically, from per-map level tables:
//   level L = #{lim[j] * absmax <= |x|, j = 0..6}: lim are the fp32 midpoints between
//     neighbouring decades (decade 6 | 5, ..., 1 | 0) and between decade 0's top value and 1.0;
//     L = 0..6 is decade 6 - L, L = 7 is the value 1.0;
//   k = clamp(trunc(|x| * (S[L] / absmax) - O[L]), 0, kmax[L]) is the bin inside the decade (the
//     values are bin midpoints, so the nearest value is the bin that holds x: S = 10^e 2^f / 0.9,
//     O = 0.1 * 2^f / 0.9; the clamp takes the spill-over at the decade's edges);
//   code = pos[L] + k for x >= 0, neg[L] - k for x < 0 (signed map; -1.0 is not in it, level 7
//     of a negative x is the lowest code);
//   zero: signed: |x| < zlim * absmax (the midpoint between 0 and the smallest value); unsigned
//     (exp_avg_sq): x <= 0 only, so a positive second moment never becomes 0 (the smallest code
//     is its floor; see the moment guard below); NaN -> code 0. A zero absmax: every code is
//     0's code; a NaN absmax: every code is 0.
// Every path (scalar, AVX2, AVX-512, the PyTorch fallback in infinity/ops/adam_compact.py)
// computes the same fp32 products (the per-block lim * absmax and S / absmax, then |x| * s - O)
// and so the same codes. Up to fp32 rounding at a midpoint this is the nearest code.
struct QLevels {
  alignas(64) float lim[8];      // 7 level boundaries (lim[7] unused)
  alignas(64) float S[16];       // per level (8 used; 16 wide for the AVX-512 permutes)
  alignas(64) float O[16];
  alignas(64) int32_t kmax[16];
  alignas(64) int32_t pos[16];
  alignas(64) int32_t neg[16];
  float zlim;                    // signed: zero below zlim * absmax
  int32_t zero_code;
};

struct DecadeTable {
  alignas(32) float A[8];
  alignas(32) float B[8];
};

struct QMaps {
  alignas(64) float map[2][kBlock];
  QLevels lv[2];
  DecadeTable dec[2];
};

// The map's values by decade, as fp32 arithmetic: decade e holds 2^f values (f = 6 - e signed,
// 7 - e unsigned), value k = fma(B[f], k, A[f]) with A[f] = fp32((0.1 + 0.45 / 2^f) / 10^e) and
// B[f] = fp32(0.9 / 2^f / 10^e): the bin midpoints of [0.1, 1] / 10^e. One formula, so the AVX2
// path computes a code's value instead of gathering it from the table (and equals the table).
DecadeTable build_decades(bool is_signed) {
  static constexpr double kTenE[7] = {1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6};  // exact
  const int bits = is_signed ? 6 : 7;
  DecadeTable t{};
  for (int f = 0; f < 8; ++f) {
    const int e = bits - f;
    if (e < 0 || e > 6) continue;
    t.A[f] = static_cast<float>((0.1 + 0.45 / (1 << f)) / kTenE[e]);
    t.B[f] = static_cast<float>(0.9 / (1 << f) / kTenE[e]);
  }
  return t;
}

// Sorted ascending: signed: -decade 0 .. -decade 6, 0, decade 6 .. decade 0, 1.0 (the negative
// zero pattern of the dynamic tree code re-used); unsigned: 0, decade 6 .. decade 0, 1.0.
void build_dynamic_map(bool is_signed, float* out) {
  const DecadeTable t = build_decades(is_signed);
  const int bits = is_signed ? 6 : 7;
  int pos = is_signed ? 128 : 1;
  for (int e = 6; e >= 0; --e) {
    const int f = bits - e;
    for (int k = 0; k < (1 << f); ++k) {
      const float value = std::fma(t.B[f], static_cast<float>(k), t.A[f]);
      out[pos + k] = value;
      if (is_signed) out[254 - pos - k] = -value;
    }
    pos += 1 << f;
  }
  out[is_signed ? 127 : 0] = 0.0f;
  out[kBlock - 1] = 1.0f;
}

// The level tables of one map (its fp32 values for the boundaries, double for the bins).
QLevels build_levels(bool is_signed, const float* map) {
  static constexpr double kTenE[7] = {1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6};
  QLevels lv{};
  const int bits = is_signed ? 6 : 7;
  int base = is_signed ? 128 : 1;  // the first positive code of decade 6
  for (int L = 0; L < 7; ++L) {
    const int e = 6 - L;
    const int count = 1 << (bits - e);
    lv.S[L] = static_cast<float>(kTenE[e] * count / 0.9);
    lv.O[L] = static_cast<float>(0.1 * count / 0.9);
    lv.kmax[L] = count - 1;
    lv.pos[L] = base;
    lv.neg[L] = is_signed ? 254 - base : 0;
    base += count;  // the first code of the next decade (or 1.0's)
    lv.lim[L] = static_cast<float>(0.5 * (static_cast<double>(map[base - 1]) + map[base]));
  }
  lv.S[7] = 0.f;
  lv.O[7] = 0.f;
  lv.kmax[7] = 0;
  lv.pos[7] = kBlock - 1;  // 1.0
  lv.neg[7] = 0;           // signed: the lowest value (-0.99297)
  lv.zlim = static_cast<float>(0.5 * static_cast<double>(map[is_signed ? 128 : 1]));
  lv.zero_code = is_signed ? 127 : 0;
  return lv;
}

QMaps build_qmaps() {
  QMaps q;
  for (int s = 0; s < 2; ++s) {
    build_dynamic_map(s == kSigned, q.map[s]);
    q.lv[s] = build_levels(s == kSigned, q.map[s]);
    q.dec[s] = build_decades(s == kSigned);
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
  float m_bound = 0.f;     // 8-bit: the moment guard's bound (inf_adam_step_q8g)
  float m_bound_sq = 0.f;  // m_bound * m_bound (fp32)
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

// ---- quantization: shared block set-up --------------------------------------------------------
// absmax of 256 values (NaN if any is NaN), as every path computes it.
inline float scalar_absmax(const float* buf) {
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
  return nan ? std::numeric_limits<float>::quiet_NaN() : mx;
}

// A block whose absmax is 0 (every code is 0's) or NaN (every code 0): true when handled.
inline bool degenerate_block(const QLevels& lv, float absmax, uint8_t* codes) {
  if (absmax > 0.f) return false;  // positive, +inf included
  std::memset(codes, absmax == 0.f ? lv.zero_code : 0, kBlock);
  return true;
}

// The per-block constants of the level rule, computed the same way for every path.
struct BlockConsts {
  alignas(32) float lim[8];  // lim[j] * absmax (7 used)
  alignas(32) float sc[8];   // S[L] / absmax
  float zlim;                // zlim * absmax
};

inline BlockConsts block_consts(const QLevels& lv, float absmax) {
  BlockConsts k;
  for (int j = 0; j < 8; ++j) {
    k.lim[j] = lv.lim[j] * absmax;
    k.sc[j] = lv.S[j] / absmax;
  }
  k.zlim = lv.zlim * absmax;
  return k;
}

// cvttps2dq: truncation, 0x80000000 for NaN and out-of-range values.
inline int32_t cvtt(float t) {
  if (!(t > -2147483648.0f && t < 2147483648.0f)) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(t);
}

template <bool SIGNED>
inline int scalar_code(const QLevels& lv, const BlockConsts& k, float x) {
  if (std::isnan(x)) return 0;
  const float a = std::fabs(x);
  int level = 0;
  for (int j = 0; j < 7; ++j) level += a >= k.lim[j] ? 1 : 0;
  int32_t bin = cvtt(a * k.sc[level] - lv.O[level]);
  bin = bin > 0 ? bin : 0;
  bin = bin < lv.kmax[level] ? bin : lv.kmax[level];
  int code = (SIGNED && x < 0.f) ? lv.neg[level] - bin : lv.pos[level] + bin;
  if (SIGNED ? a < k.zlim : x <= 0.f) code = lv.zero_code;
  return code;
}

// absmax of 256 values, then each value's code by the level rule.
void scalar_quantize_block(const float* buf, const QMaps& q, int sign, uint8_t* codes,
                           float* absmax) {
  const float scale = scalar_absmax(buf);
  *absmax = scale;
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const BlockConsts k = block_consts(lv, scale);
  for (int i = 0; i < kBlock; ++i) {
    codes[i] = static_cast<uint8_t>(sign == kSigned ? scalar_code<true>(lv, k, buf[i])
                                                    : scalar_code<false>(lv, k, buf[i]));
  }
}

// The moment guard of the 8-bit step (see inf_adam_step_q8g): where m*m > bound^2 * v, m becomes
// copysign(sqrt(v) * bound, m); every path computes these same fp32 products. A NaN or an
// overflowing bound^2 * v (no bound) compares false and leaves m as it is.
inline float scalar_guard(float m, float v, float bound, float bound_sq) {
  if (m * m > bound_sq * v) return std::copysign(std::sqrt(v) * bound, m);
  return m;
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
    const float vi = q.map[kUnsigned][vq[i]] * va;
    const float mi = scalar_guard(q.map[kSigned][mq[i]] * ma, vi, job.m_bound, job.m_bound_sq);
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
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const BlockConsts k = block_consts(lv, scale);
  const __m512 lim = _mm512_castps256_ps512(_mm256_load_ps(k.lim));
  const __m512 lim3 = _mm512_set1_ps(k.lim[3]);
  const __m512 sc = _mm512_castps256_ps512(_mm256_load_ps(k.sc));  // levels 0..7
  const __m512 off = _mm512_load_ps(lv.O);
  const __m512i kmax = _mm512_load_si512(lv.kmax);
  const __m512i pos = _mm512_load_si512(lv.pos);
  const __m512i neg = _mm512_load_si512(lv.neg);
  const __m512 zlim = _mm512_set1_ps(k.zlim);
  const __m512i zero_code = _mm512_set1_epi32(lv.zero_code);
  const __m512i one = _mm512_set1_epi32(1);
  const bool is_signed = sign == kSigned;
  for (int i = 0; i < kBlock; i += 16) {
    const __m512 x = _mm512_loadu_ps(buf + i);
    const __m512 a = _mm512_abs_ps(x);
    // level = #{j < 7 : lim[j] <= a} by a binary search over the sorted lim (3 compares)
    __m512i level = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(a, lim3, _CMP_GE_OQ),
                                           _mm512_set1_epi32(4));
    level = _mm512_mask_add_epi32(
        level,
        _mm512_cmp_ps_mask(a, _mm512_permutexvar_ps(_mm512_add_epi32(level, one), lim),
                           _CMP_GE_OQ),
        level, _mm512_set1_epi32(2));
    level = _mm512_mask_add_epi32(
        level, _mm512_cmp_ps_mask(a, _mm512_permutexvar_ps(level, lim), _CMP_GE_OQ), level, one);
    const __m512 t = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(level, sc)),
                                   _mm512_permutexvar_ps(level, off));
    __m512i bin = _mm512_max_epi32(_mm512_cvttps_epi32(t), _mm512_setzero_si512());
    bin = _mm512_min_epi32(bin, _mm512_permutexvar_epi32(level, kmax));
    __m512i code = _mm512_add_epi32(_mm512_permutexvar_epi32(level, pos), bin);
    __mmask16 zero;
    if (is_signed) {
      const __m512i ncode = _mm512_sub_epi32(_mm512_permutexvar_epi32(level, neg), bin);
      code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ),
                                     code, ncode);
      zero = _mm512_cmp_ps_mask(a, zlim, _CMP_LT_OQ);
    } else {
      zero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LE_OQ);
    }
    code = _mm512_mask_blend_epi32(zero, code, zero_code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
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
  const __m512 bound = _mm512_set1_ps(job.m_bound);
  const __m512 bound_sq = _mm512_set1_ps(job.m_bound_sq);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 16) {
    const __m512i mc =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mq + i)));
    const __m512i vc =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vq + i)));
    const __m512 vi = _mm512_mul_ps(avx512_lookup256(q.map[kUnsigned], vc), va);
    __m512 mi = _mm512_mul_ps(avx512_lookup256(q.map[kSigned], mc), ma);
    const __mmask16 over = _mm512_cmp_ps_mask(_mm512_mul_ps(mi, mi), _mm512_mul_ps(bound_sq, vi),
                                              _CMP_GT_OQ);  // the moment guard
    if (over) {
      const __m512 sb = _mm512_mul_ps(_mm512_sqrt_ps(vi), bound);
      const __m512i sgn = _mm512_and_si512(_mm512_castps_si512(mi), sign_bit);
      mi = _mm512_mask_mov_ps(mi, over, _mm512_castsi512_ps(
                                            _mm512_or_si512(_mm512_castps_si512(sb), sgn)));
    }
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

// The level rule's per-block registers (from block_consts) and the codes of 8 values.
struct QReg {
  __m256 lim, lim3, sc, off, zlim;
  __m256i kmax, pos, neg, zero_code;
};

INF_TARGET_AVX2 inline QReg avx2_qreg(const QLevels& lv, const BlockConsts& k) {
  QReg r;
  r.lim = _mm256_load_ps(k.lim);
  r.lim3 = _mm256_set1_ps(k.lim[3]);
  r.sc = _mm256_load_ps(k.sc);
  r.off = _mm256_load_ps(lv.O);
  r.zlim = _mm256_set1_ps(k.zlim);
  r.kmax = _mm256_load_si256(reinterpret_cast<const __m256i*>(lv.kmax));
  r.pos = _mm256_load_si256(reinterpret_cast<const __m256i*>(lv.pos));
  r.neg = _mm256_load_si256(reinterpret_cast<const __m256i*>(lv.neg));
  r.zero_code = _mm256_set1_epi32(lv.zero_code);
  return r;
}

template <bool SIGNED>
INF_TARGET_AVX2 inline __m256i avx2_codes(const QReg& r, __m256 x) {
  const __m256 a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256i one = _mm256_set1_epi32(1);
  // level = #{j < 7 : lim[j] <= a} by a binary search over the sorted lim (3 compares)
  __m256i level = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(a, r.lim3, _CMP_GE_OQ)),
                                   _mm256_set1_epi32(4));
  level = _mm256_add_epi32(
      level,
      _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(
                           a, _mm256_permutevar8x32_ps(r.lim, _mm256_add_epi32(level, one)),
                           _CMP_GE_OQ)),
                       _mm256_set1_epi32(2)));
  level = _mm256_sub_epi32(level, _mm256_castps_si256(_mm256_cmp_ps(
                                      a, _mm256_permutevar8x32_ps(r.lim, level), _CMP_GE_OQ)));
  const __m256 t = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_permutevar8x32_ps(r.sc, level)),
                                 _mm256_permutevar8x32_ps(r.off, level));
  __m256i bin = _mm256_max_epi32(_mm256_cvttps_epi32(t), _mm256_setzero_si256());
  bin = _mm256_min_epi32(bin, _mm256_permutevar8x32_epi32(r.kmax, level));
  __m256i code = _mm256_add_epi32(_mm256_permutevar8x32_epi32(r.pos, level), bin);
  __m256 is_zero;
  if constexpr (SIGNED) {
    const __m256i ncode = _mm256_sub_epi32(_mm256_permutevar8x32_epi32(r.neg, level), bin);
    code = _mm256_blendv_epi8(
        code, ncode, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)));
    is_zero = _mm256_cmp_ps(a, r.zlim, _CMP_LT_OQ);
  } else {
    is_zero = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LE_OQ);
  }
  return _mm256_blendv_epi8(code, r.zero_code, _mm256_castps_si256(is_zero));
}

INF_TARGET_AVX2 inline void avx2_store_codes(uint8_t* dst, __m256i code) {
  const __m128i w =
      _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(w, w));
}

// The absmax of 8 lanes folded into (mx, nan), and its value at the end (as scalar_absmax).
INF_TARGET_AVX2 inline void avx2_absmax_step(__m256 x, __m256& mx, __m256& nan) {
  nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  mx = _mm256_max_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))),
                     mx);  // a NaN first operand yields the second
}

INF_TARGET_AVX2 inline float avx2_absmax_value(__m256 mx, __m256 nan) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN()
                                      : _mm_cvtss_f32(m4);
}

INF_TARGET_AVX2 void avx2_quantize_block(const float* buf, const QMaps& q, int sign,
                                         uint8_t* codes, float* absmax) {
  __m256 mx = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) avx2_absmax_step(_mm256_loadu_ps(buf + i), mx, nan);
  const float scale = avx2_absmax_value(mx, nan);
  *absmax = scale;
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const QReg r = avx2_qreg(lv, block_consts(lv, scale));
  if (sign == kSigned) {
    for (int i = 0; i < kBlock; i += 8) {
      avx2_store_codes(codes + i, avx2_codes<true>(r, _mm256_loadu_ps(buf + i)));
    }
  } else {
    for (int i = 0; i < kBlock; i += 8) {
      avx2_store_codes(codes + i, avx2_codes<false>(r, _mm256_loadu_ps(buf + i)));
    }
  }
}

// map[code] for 8 codes without a gather, by the decade formula of build_dynamic_map: j = code + 1
// (unsigned) or |code - 127| (signed), f = floor(log2 j) from j's fp32 exponent, k = j - 2^f,
// value = fma(B[f], k, A[f]) (negative below code 127 of the signed map); 0 and 1.0 blended in.
template <bool SIGNED>
INF_TARGET_AVX2 inline __m256 avx2_code_value(const DecadeTable& t, __m256i code) {
  const __m256i j = SIGNED ? _mm256_abs_epi32(_mm256_sub_epi32(code, _mm256_set1_epi32(127)))
                           : _mm256_add_epi32(code, _mm256_set1_epi32(1));
  const __m256i f = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(j)), 23), _mm256_set1_epi32(127));
  const __m256i k = _mm256_sub_epi32(j, _mm256_sllv_epi32(_mm256_set1_epi32(1), f));
  __m256 value = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t.B), f),
                                 _mm256_cvtepi32_ps(k),
                                 _mm256_permutevar8x32_ps(_mm256_load_ps(t.A), f));
  const __m256i zero_code = _mm256_set1_epi32(SIGNED ? 127 : 0);
  if (SIGNED) {
    const __m256 neg = _mm256_castsi256_ps(_mm256_cmpgt_epi32(zero_code, code));
    value = _mm256_or_ps(value, _mm256_and_ps(neg, _mm256_set1_ps(-0.0f)));
  }
  value = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(code, zero_code)), value);
  return _mm256_blendv_ps(value, _mm256_set1_ps(1.0f),
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, _mm256_set1_epi32(255))));
}

// One vector (8 elements at i) of the AVX2 8-bit step: dequantize, guard, update; stores the
// parameter (and working copy) and returns the new fp32 moments in mo, vo.
template <int GD, int OD>
INF_TARGET_AVX2 inline void avx2_q8_vector(const Job& job, const V256& c, const Span& s, int i,
                                           __m256 ma, __m256 va, __m256& mo, __m256& vo) {
  const QMaps& q = *job.q;
  const __m256i mc = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.m) + i)));
  const __m256i vc = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.v) + i)));
  const __m256 vi = _mm256_mul_ps(avx2_code_value<false>(q.dec[kUnsigned], vc), va);
  __m256 mi = _mm256_mul_ps(avx2_code_value<true>(q.dec[kSigned], mc), ma);
  const __m256 over = _mm256_cmp_ps(_mm256_mul_ps(mi, mi),
                                    _mm256_mul_ps(_mm256_set1_ps(job.m_bound_sq), vi),
                                    _CMP_GT_OQ);  // the moment guard
  if (_mm256_movemask_ps(over) != 0) {
    const __m256 sb = _mm256_mul_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(job.m_bound));
    mi = _mm256_blendv_ps(mi, _mm256_or_ps(sb, _mm256_and_ps(mi, _mm256_set1_ps(-0.0f))), over);
  }
  const __m256 param =
      avx2_adam(job.c, c, avx2_load_grad<GD>(static_cast<const char*>(s.g) + i * dtype_size(GD)),
                _mm256_loadu_ps(s.p + i), mi, vi, mo, vo);
  _mm256_storeu_ps(s.p + i, param);
  if constexpr (OD != kNone) {
    avx2_store_out<OD, false>(static_cast<char*>(s.out) + i * dtype_size(OD), param);
  }
}

template <int GD, int OD>
INF_TARGET_AVX2 void avx2_q8_block(const Job& job, const Span& s) {
  const V256 c = make_v256(job.c);
  const __m256 ma = _mm256_set1_ps(*s.m_scale);
  const __m256 va = _mm256_set1_ps(*s.v_scale);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 8) {
    __m256 mo, vo;
    avx2_q8_vector<GD, OD>(job, c, s, i, ma, va, mo, vo);
    _mm256_store_ps(mbuf + i, mo);
    _mm256_store_ps(vbuf + i, vo);
  }
  requantize<&avx2_quantize_block>(s, *job.q, mbuf, vbuf);
}

// The codes of a block whose moments are computed but not yet quantized (avx2_q8_range).
struct PendingCodes {
  bool m = false, v = false;  // a moment's codes still to write
  QReg mr, vr;
  uint8_t* mcodes = nullptr;
  uint8_t* vcodes = nullptr;
  const float* mbuf = nullptr;
  const float* vbuf = nullptr;
};

INF_TARGET_AVX2 void avx2_flush_codes(PendingCodes& pend) {
  for (int i = 0; i < kBlock; i += 8) {
    if (pend.m) {
      avx2_store_codes(pend.mcodes + i, avx2_codes<true>(pend.mr, _mm256_load_ps(pend.mbuf + i)));
    }
    if (pend.v) {
      avx2_store_codes(pend.vcodes + i,
                       avx2_codes<false>(pend.vr, _mm256_load_ps(pend.vbuf + i)));
    }
  }
  pend.m = pend.v = false;
}

// A range of blocks, software-pipelined: the re-quantization of block b-1 (ALU work) runs in
// the loop that updates block b (bound by the divider: sqrt and two divisions per element), so
// the two overlap. The same operations as avx2_q8_block block by block, so the same bits.
template <int GD, int OD>
INF_TARGET_AVX2 void avx2_q8_range(const Job& job, int64_t b0, int64_t b1) {
  const V256 c = make_v256(job.c);
  const QMaps& q = *job.q;
  alignas(64) float bufs[2][2][kBlock];  // [which][m, v]
  PendingCodes pend;
  int which = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * kBlock;
    const Span s{job.p + i0,
                 static_cast<const char*>(job.g) + i0 * job.gsize,
                 static_cast<char*>(job.m) + i0,
                 static_cast<char*>(job.v) + i0,
                 job.m_scale + b,
                 job.v_scale + b,
                 job.out != nullptr ? static_cast<char*>(job.out) + i0 * job.osize : nullptr,
                 static_cast<int>(std::min<int64_t>(kBlock, job.n - i0))};
    if (s.count < kBlock) {
      avx2_flush_codes(pend);
      step_padded(job, s);
      continue;
    }
    float* mb = bufs[which][0];
    float* vb = bufs[which][1];
    const __m256 ma = _mm256_set1_ps(*s.m_scale);
    const __m256 va = _mm256_set1_ps(*s.v_scale);
    __m256 mmx = _mm256_setzero_ps(), mnan = _mm256_setzero_ps();
    __m256 vmx = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    const bool overlap = pend.m && pend.v;  // else at most one moment (a degenerate block)
    if (!overlap) avx2_flush_codes(pend);
    for (int i = 0; i < kBlock; i += 8) {
      __m256 mo, vo;
      avx2_q8_vector<GD, OD>(job, c, s, i, ma, va, mo, vo);
      _mm256_store_ps(mb + i, mo);
      _mm256_store_ps(vb + i, vo);
      avx2_absmax_step(mo, mmx, mnan);
      avx2_absmax_step(vo, vmx, vnan);
      if (overlap) {
        avx2_store_codes(pend.mcodes + i,
                         avx2_codes<true>(pend.mr, _mm256_load_ps(pend.mbuf + i)));
        avx2_store_codes(pend.vcodes + i,
                         avx2_codes<false>(pend.vr, _mm256_load_ps(pend.vbuf + i)));
      }
    }
    pend.m = pend.v = false;
    // block b's new scales, and its codes pending for the next block's loop
    const float mscale = avx2_absmax_value(mmx, mnan);
    const float vscale = avx2_absmax_value(vmx, vnan);
    *s.m_scale = mscale;
    *s.v_scale = vscale;
    uint8_t* mcodes = static_cast<uint8_t*>(s.m);
    uint8_t* vcodes = static_cast<uint8_t*>(s.v);
    const QLevels& ml = q.lv[kSigned];
    const QLevels& vl = q.lv[kUnsigned];
    pend.m = !degenerate_block(ml, mscale, mcodes);
    pend.v = !degenerate_block(vl, vscale, vcodes);
    if (pend.m) pend.mr = avx2_qreg(ml, block_consts(ml, mscale));
    if (pend.v) pend.vr = avx2_qreg(vl, block_consts(vl, vscale));
    pend.mcodes = mcodes;
    pend.vcodes = vcodes;
    pend.mbuf = mb;
    pend.vbuf = vb;
    which ^= 1;
  }
  avx2_flush_codes(pend);
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

template <int GD>
RangeFn pick_q8_range_out(int cap, int od) {
  if (cap != kAVX2) return &step_range;
  switch (od) {
    case kF32: return &avx2_q8_range<GD, kF32>;
    case kBF16: return &avx2_q8_range<GD, kBF16>;
    case kF16: return &avx2_q8_range<GD, kF16>;
    default: return &avx2_q8_range<GD, kNone>;
  }
}

// The 8-bit step's range function: the pipelined one on AVX2, block by block elsewhere.
RangeFn select_q8_range(int cap, int gd, int od) {
  switch (gd) {
    case kF32: return pick_q8_range_out<kF32>(cap, od);
    case kBF16: return pick_q8_range_out<kBF16>(cap, od);
    default: return pick_q8_range_out<kF16>(cap, od);
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
// dequantize (map[code] * absmax), guard, update in fp32, update p with the fp32 moments, then
// store the new absmax and the codes of the level rule. All-zero codes with zero scales are a
// zero state. Non-finite gradients poison the block (its absmax becomes NaN or inf).
//
// The moment guard: exact Adam keeps |m_t| <= K_t sqrt(v_t), K_t = (1 - beta1) / sqrt(1 - beta2)
// * sqrt(sum_{j<t} (beta1^2 / beta2)^j) (Cauchy-Schwarz over the two sums), so its update never
// exceeds lr * K_t * sqrt(1 - beta2^t) / (1 - beta1^t). A quantized state need not: in a block
// holding large and small moments a small exp_avg_sq can round far down while its exp_avg does
// not, and the update becomes ~ lr * m / eps. Each dequantized exp_avg is therefore clamped to
// +-m_bound * sqrt(exp_avg_sq) before the update, m_bound = K_{t-1} (the state is t-1 steps
// old; the host computes it, infinity.ops.adam_compact.moment_bound): a state that exact Adam
// can reach is never changed, any other is brought back inside the set it can reach.
INF_API int inf_adam_step_q8g(float* p, const void* g, int g_dtype, uint8_t* m_codes,
                              float* m_absmax, uint8_t* v_codes, float* v_absmax, void* out,
                              int out_dtype, int64_t n, double lr, double beta1, double beta2,
                              double eps, double weight_decay, int adamw,
                              double bias_correction1, double bias_correction2_sqrt,
                              double grad_multiplier, double m_bound) {
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
  job.m_bound = static_cast<float>(
      std::min(m_bound, static_cast<double>(std::numeric_limits<float>::max())));
  job.m_bound_sq = job.m_bound * job.m_bound;
  job.block = select_block<kKernel8bit>(cap, g_dtype, out_dtype);
  job.range = select_q8_range(cap, g_dtype, out_dtype);
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
// of 256 into absmax[ceil(n/256)], the codes of the level rule into codes[n].
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
