// CPU Adam / AdamW with compact optimizer states (opt-in): the fp32 master weights stay fp32,
// the two moments are stored
//   (a) as bfloat16 (round to nearest even), 4 bytes of state per parameter instead of 8, or
//   (b) as 8-bit codes, block-wise quantized like bitsandbytes' 8-bit Adam: per block of 256
//       elements one fp32 absmax scale per moment, a signed dynamic map for exp_avg and an
//       unsigned one for exp_avg_sq; 2 + 8/256 bytes per parameter.
// Gradients fp32/bf16/fp16 in, optional working copy fp32/bf16/fp16 out, in the same pass, as
// inf_adam_step (csrc/cpu_adam.cpp), whose moment math (FMAs included, in the same order) and
// host-side scalars these kernels share. The bf16 kernel's parameter update is inf_adam_step's
// too (given the same fp32 moments, bitwise the same parameter); the 8-bit kernel's divides once,
// with the bias corrections folded into two scalars (scalar_q8_adam), so that it is not bound by
// the divider. The moments are widened to fp32, updated, the parameter is updated with the
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
using inf_adam::bits_f32;
using inf_adam::dtype_size;
using inf_adam::f32_bits;
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

// The 8-bit kernels' per-vector helpers are inlined into their loops (the compiler's own limits
// left some as calls that spill every vector register around each call).
#define INF_INLINE inline __attribute__((always_inline))

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
//
// Dequantization (code -> value) is map[code] * absmax. The vector paths compute map[code] from
// the decade formula instead of a lookup: j = code + 1 (unsigned) or |code - 127| (signed) has
// f = floor(log2 j) as its fp32 exponent - 127 and k = j - 2^f, and map[code] =
// fma(B[f], k, A[f]) (build_dynamic_map's own operation, so bitwise the table's value), negated
// below code 127 of the signed map; f = 8 (unsigned) / 7 (signed) is 1.0, code 127 (signed) 0
// (the AVX-512 path reads the signed tables at the exponent of 4j, where j = 0 has a slot of
// its own: see ExpTable). Lookups measured no faster on an AVX-512 Xeon (Emerald Rapids):
// 16-lane gathers of the table slower, VBMI byte-plane permutes (vpermi2b) the same, as they
// load the shuffle port as much as the formula's permutes do.
//
// Quantization (value -> code) without a search: the map is a decimal exponent (decade) and a
// linear fraction, so the nearest code is computed, on the ratio r = |x| * (1 / absmax) (x itself
// for the unsigned map), from per-map constant tables of 8 levels:
//   r = max(|x| * inv, 2^-31), inv = fp32(1 / absmax) (one division per block; max as vmaxps:
//     a NaN product gives 2^-31);
//   level L = #{j = 0..6 : r >= lim[j]}: lim are the fp32 midpoints between neighbouring decades
//     (decade 6 | 5, ..., 1 | 0) and between decade 0's top value and 1.0; L = 0..6 is decade
//     6 - L, L = 7 is the value 1.0. The lims are ~10x apart, so each binary octave of r holds at
//     most one: the AVX-512 path indexes 32-entry tables by r's exponent (octave o, the
//     exponent field & 31; r = inf, from a subnormal absmax, is octave 31 like [1, 2)), where
//     the level of octave o + 1 is the level above octave o's lim, so S, C and cap are read at
//     o + (r >= oct_lim[o]) (a NaN oct_lim where an octave holds no lim: never >=); the others
//     count or binary-search; same L;
//   code = min(cvtt(fma(r, S[L], C[L])), cap[L]) (cvtt: truncation, 0x80000000 for NaN or out of
//     range; the min unsigned, so that one becomes cap[L]). The decade's values are the
//     midpoints of 2^f equal bins, so the nearest value is the bin that holds r:
//     S = 10^e 2^f / 0.9, C = (first code of the decade) - 0.1 * 2^f / 0.9, and cap = the
//     decade's last code takes the spill-over above its top value (up to the next midpoint).
//     Level 0 (decade 6) also holds the codes below it: signed, S = 1 / zlim, C = 127, cap = 128
//     (0 below zlim, the midpoint between 0 and the smallest value); unsigned, S = 1 / mid12,
//     C = 1, cap = 2 (codes 1 and 2 split at their midpoint mid12; everything below is code 1,
//     the floor). Level 7: S = 0, C = cap = 255 (1.0);
//   signed: a negative x (sign bit set) takes the mirror code 254 - code (the map is symmetric
//     but for +1.0; -1.0 -> -1 -> 0, the lowest value). unsigned: code = min(code, bits(x)) as
//     int32: x = +0 is code 0, any positive x keeps at least code 1 (a positive second moment is
//     never stored as 0), a negative x is below 0;
//   the result is saturated to 0..255. A zero absmax: every code is 0's code; a NaN absmax (any
//     element NaN): every code is 0.
// Every path (scalar, AVX2, AVX-512, the PyTorch fallback in infinity/ops/adam_compact.py)
// computes the same fp32 operations (the per-block 1 / absmax, the product, one fma) and so the
// same codes. Up to fp32 rounding next to a midpoint this is the nearest code.
constexpr float kRatioMin = 4.656612873077393e-10f;  // 2^-31: r's exponent field is 96..127

struct QLevels {
  alignas(64) float lim[16];         // 7 level boundaries of r (lim[7..] = +inf)
  alignas(64) float S[16];           // per level (8 used; 16 wide for the AVX-512 permutes)
  alignas(64) float C[16];
  alignas(64) int32_t cap[16];
  alignas(64) int32_t oct_base[32];  // by r's exponent field & 31: lims below the octave
  alignas(64) float oct_lim[32];     // the lim inside the octave, or NaN (no r compares >= it)
  alignas(64) float oct_S[32];       // S, C, cap of level oct_base[i] (AVX-512: index o + ge)
  alignas(64) float oct_C[32];
  alignas(64) int32_t oct_cap[32];
  int32_t zero_code;
};

struct DecadeTable {
  alignas(32) float A[8];
  alignas(32) float B[8];
};

// The decade formula's coefficients indexed by the low bits of the fp32 exponent of j (127 + f):
// 16 entries (AVX-512 permutes) and 8 (AVX2). Unsigned: f = 0 (code 0) is 0, f = 8 (code 255)
// is 1.0; with 8 entries both land on index 7, which holds 0 (the AVX2 path sets 1.0 itself).
// Signed: f = 7 (code 255) is 1.0; code 127 (j = 0) is masked to 0 by the AVX2 path. The
// signed 16-entry tables are read at the exponent of 4j (129 + f: indices 1..8, and 0 for
// j = 0, which holds 0) with B / 4 (exact), so that fma(B / 4, 4k, A) is fma(B, k, A) bitwise
// and code 127 needs no mask.
struct ExpTable {
  alignas(64) float A16[16];
  alignas(64) float B16[16];
  alignas(32) float A8[8];
  alignas(32) float B8[8];
};

// Vector constants, read from memory (built at run time, so the compiler loads them instead of
// re-materialising each one on the shuffle port inside the loops).
struct VConsts {
  alignas(64) int32_t one[16];
  alignas(64) int32_t c2[16];
  alignas(64) int32_t c4[16];
  alignas(64) int32_t c127[16];
  alignas(64) int32_t c254[16];
  alignas(64) int32_t c255[16];
  alignas(64) int32_t abs_mask[16];
  alignas(64) int32_t sign_mask[16];
  alignas(64) int32_t exp_mask[16];  // sign and exponent field
  alignas(64) float ratio_min[16];
  alignas(64) float one_f[16];
};

struct QMaps {
  alignas(64) float map[2][kBlock];
  QLevels lv[2];
  DecadeTable dec[2];
  ExpTable ex[2];
  VConsts k;
};

// The map's values by decade, as fp32 arithmetic: decade e holds 2^f values (f = 6 - e signed,
// 7 - e unsigned), value k = fma(B[f], k, A[f]) with A[f] = fp32((0.1 + 0.45 / 2^f) / 10^e) and
// B[f] = fp32(0.9 / 2^f / 10^e): the bin midpoints of [0.1, 1] / 10^e.
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

ExpTable build_exp_table(bool is_signed, const DecadeTable& d) {
  ExpTable t{};
  const int top = is_signed ? 7 : 8;  // the f of 1.0
  for (int f = 0; f <= top; ++f) {
    const float a = f == top ? 1.0f : d.A[f];  // unsigned f = 0: A = B = 0 (the value 0)
    const float b = f == top ? 0.0f : d.B[f];
    const int i16 = ((is_signed ? 129 : 127) + f) & 15;
    t.A16[i16] = a;
    t.B16[i16] = is_signed ? b * 0.25f : b;
    if (!(is_signed == false && f == 8)) {  // unsigned 1.0 shares index 7 with 0: keep 0
      t.A8[(127 + f) & 7] = a;
      t.B8[(127 + f) & 7] = b;
    }
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

// The level tables of one map (its fp32 values for the boundaries, double for the rest, each
// rounded once to fp32).
QLevels build_levels(bool is_signed, const float* map) {
  static constexpr double kTenE[7] = {1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6};
  QLevels lv{};
  const int bits = is_signed ? 6 : 7;
  int base = is_signed ? 128 : 1;  // the first positive code of decade 6
  for (int L = 0; L < 7; ++L) {
    const int e = 6 - L;
    const int count = 1 << (bits - e);
    lv.S[L] = static_cast<float>(kTenE[e] * count / 0.9);
    lv.C[L] = static_cast<float>(base - 0.1 * count / 0.9);
    lv.cap[L] = base + count - 1;
    base += count;  // the first code of the next decade (or 1.0's)
    lv.lim[L] = static_cast<float>(0.5 * (static_cast<double>(map[base - 1]) + map[base]));
  }
  if (is_signed) {  // 0 below the midpoint between 0 and the smallest value, then code 128
    lv.S[0] = static_cast<float>(1.0 / (0.5 * static_cast<double>(map[128])));
    lv.C[0] = 127.0f;
  } else {  // codes 1 and 2 split at their midpoint; the floor below
    lv.S[0] = static_cast<float>(1.0 / (0.5 * (static_cast<double>(map[1]) + map[2])));
    lv.C[0] = 1.0f;
  }
  lv.S[7] = 0.f;
  lv.C[7] = 255.0f;
  lv.cap[7] = kBlock - 1;  // 1.0
  for (int j = 7; j < 16; ++j) lv.lim[j] = std::numeric_limits<float>::infinity();
  for (int i = 0; i < 32; ++i) {  // octave [2^(i-31), 2^(i-30)) of r, exponent field 96 + i
    const float lo = std::ldexp(1.0f, i - 31);
    const float hi = 2.0f * lo;
    lv.oct_base[i] = 0;
    lv.oct_lim[i] = std::numeric_limits<float>::quiet_NaN();
    for (int j = 0; j < 7; ++j) {
      if (lv.lim[j] <= lo) {
        ++lv.oct_base[i];
      } else if (lv.lim[j] < hi) {
        lv.oct_lim[i] = lv.lim[j];  // at most one: the lims are ~10x apart
      }
    }
  }
  for (int i = 0; i < 32; ++i) {
    lv.oct_S[i] = lv.S[lv.oct_base[i]];
    lv.oct_C[i] = lv.C[lv.oct_base[i]];
    lv.oct_cap[i] = lv.cap[lv.oct_base[i]];
  }
  lv.zero_code = is_signed ? 127 : 0;
  return lv;
}

QMaps build_qmaps() {
  QMaps q;
  for (int s = 0; s < 2; ++s) {
    build_dynamic_map(s == kSigned, q.map[s]);
    q.lv[s] = build_levels(s == kSigned, q.map[s]);
    q.dec[s] = build_decades(s == kSigned);
    q.ex[s] = build_exp_table(s == kSigned, q.dec[s]);
  }
  for (int i = 0; i < 16; ++i) {
    q.k.one[i] = 1;
    q.k.c2[i] = 2;
    q.k.c4[i] = 4;
    q.k.c127[i] = 127;
    q.k.c254[i] = 254;
    q.k.c255[i] = 255;
    q.k.abs_mask[i] = 0x7FFFFFFF;
    q.k.sign_mask[i] = static_cast<int32_t>(0x80000000u);
    q.k.exp_mask[i] = static_cast<int32_t>(0xFF800000u);
    q.k.ratio_min[i] = kRatioMin;
    q.k.one_f[i] = 1.0f;
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
  float q8_step = 0.f;     // 8-bit: lr / bc1 * sqrt(bc2) (scalar_q8_adam)
  float q8_eps = 0.f;      // 8-bit: eps * sqrt(bc2)
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
// absmax of 256 values, as every path computes it: the largest |x| as an fp32 bit pattern (the
// order of non-negative floats is that of their bits, and any NaN's |bits| exceed inf's), a NaN
// result returned as the quiet NaN.
inline float absmax_from_bits(uint32_t bits) {
  return bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : bits_f32(bits);
}

inline float scalar_absmax(const float* buf) {
  uint32_t mx = 0;
  for (int i = 0; i < kBlock; ++i) mx = std::max(mx, f32_bits(buf[i]) & 0x7FFFFFFFu);
  return absmax_from_bits(mx);
}

// A block whose absmax is 0 (every code is 0's) or NaN (every code 0): true when handled.
inline bool degenerate_block(const QLevels& lv, float absmax, uint8_t* codes) {
  if (absmax > 0.f) return false;  // positive, +inf included
  std::memset(codes, absmax == 0.f ? lv.zero_code : 0, kBlock);
  return true;
}

// The per-block constant of the level rule, computed the same way for every path.
inline float block_inv(float absmax) { return 1.0f / absmax; }

// cvttps2dq: truncation, 0x80000000 for NaN and out-of-range values.
inline int32_t cvtt(float t) {
  if (!(t > -2147483648.0f && t < 2147483648.0f)) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(t);
}

// max(p, kRatioMin) as vmaxps(p, kRatioMin) computes it: a NaN p gives kRatioMin.
inline float ratio_clamp(float p) { return p > kRatioMin ? p : kRatioMin; }

template <bool SIGNED>
inline int scalar_code(const QLevels& lv, float inv, float x) {
  const float r = ratio_clamp((SIGNED ? std::fabs(x) : x) * inv);
  int level = 0;
  for (int j = 0; j < 7; ++j) level += r >= lv.lim[j] ? 1 : 0;
  const uint32_t t = static_cast<uint32_t>(cvtt(std::fma(r, lv.S[level], lv.C[level])));
  int32_t code = static_cast<int32_t>(std::min(t, static_cast<uint32_t>(lv.cap[level])));
  if constexpr (SIGNED) {
    if (std::signbit(x)) code = 254 - code;
  } else {
    code = std::min(code, static_cast<int32_t>(f32_bits(x)));
  }
  return std::min(std::max(code, 0), 255);
}

// absmax of 256 values, then each value's code by the level rule.
void scalar_quantize_block(const float* buf, const QMaps& q, int sign, uint8_t* codes,
                           float* absmax) {
  const float scale = scalar_absmax(buf);
  *absmax = scale;
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const float inv = block_inv(scale);
  for (int i = 0; i < kBlock; ++i) {
    codes[i] = static_cast<uint8_t>(sign == kSigned ? scalar_code<true>(lv, inv, buf[i])
                                                    : scalar_code<false>(lv, inv, buf[i]));
  }
}

// The moment guard of the 8-bit step (see inf_adam_step_q8g): where m*m > bound^2 * v, m becomes
// copysign(sqrt(v) * bound, m); every path computes these same fp32 products. A NaN or an
// overflowing bound^2 * v (no bound) compares false and leaves m as it is.
inline float scalar_guard(float m, float v, float bound, float bound_sq) {
  if (m * m > bound_sq * v) return std::copysign(std::sqrt(v) * bound, m);
  return m;
}

// One element of the 8-bit step's Adam(W) update (grad not yet multiplied): the moments exactly
// as scalar_adam (csrc/adam_common.h), the parameter with one division,
//     p - (step * m) / (sqrt(v) + eps'),   step = lr / bc1 * sqrt(bc2),  eps' = eps * sqrt(bc2),
// (Adam's p - lr/bc1 * m / (sqrt(v) / sqrt(bc2) + eps) with the bias corrections folded into
// the two host-side scalars). Every path computes these operations in this order.
inline float scalar_q8_adam(const Job& job, float grad, float param, float mi, float vi,
                            float& mo, float& vo) {
  param = inf_adam::scalar_adam_moments(job.c, grad, param, mi, vi, mo, vo);
  return param - (job.q8_step * mo) / (std::sqrt(vo) + job.q8_eps);
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
        scalar_q8_adam(job, scalar_load_grad<GD>(s.g, i), s.p[i], mi, vi, mbuf[i], vbuf[i]);
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

// A block's codes still to be written (the pipelined ranges): the new moments of the block just
// updated (src, fp32) are quantized during the next block's update loop.
struct Pending {
  bool m = false, v = false;  // a moment's codes still to write
  float minv = 0.f, vinv = 0.f;  // 1 / absmax
  uint8_t* mcodes = nullptr;
  uint8_t* vcodes = nullptr;
  const float* mbuf = nullptr;
  const float* vbuf = nullptr;
};

// Block b's new scales from its absmax bit patterns; its codes pending (or written now for a
// degenerate block).
inline void set_pending(const QMaps& q, const Span& s, uint32_t mbits, uint32_t vbits,
                        const float* mb, const float* vb, Pending& pend) {
  const float mscale = absmax_from_bits(mbits);
  const float vscale = absmax_from_bits(vbits);
  *s.m_scale = mscale;
  *s.v_scale = vscale;
  uint8_t* mcodes = static_cast<uint8_t*>(s.m);
  uint8_t* vcodes = static_cast<uint8_t*>(s.v);
  pend.m = !degenerate_block(q.lv[kSigned], mscale, mcodes);
  pend.v = !degenerate_block(q.lv[kUnsigned], vscale, vcodes);
  if (pend.m) pend.minv = block_inv(mscale);
  if (pend.v) pend.vinv = block_inv(vscale);
  pend.mcodes = mcodes;
  pend.vcodes = vcodes;
  pend.mbuf = mb;
  pend.vbuf = vb;
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

// The codes of 16 values by the level rule (see the map comment); inv = 1 / absmax broadcast.
// The level from r's exponent: two 32-entry permutes and one compare.
template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE __m512i avx512_codes(const QLevels& lv, const VConsts& k, __m512 inv,
                                                  __m512 x) {
  const __m512i xb = _mm512_castps_si512(x);
  const __m512 a =
      SIGNED ? _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_load_si512(k.abs_mask))) : x;
  const __m512 r = _mm512_max_ps(_mm512_mul_ps(a, inv), _mm512_load_ps(k.ratio_min));
  __m512i octave = _mm512_srli_epi32(_mm512_castps_si512(r), 23);  // & 31 by the permutes
  const __m512 lim = _mm512_permutex2var_ps(_mm512_load_ps(lv.oct_lim), octave,
                                            _mm512_load_ps(lv.oct_lim + 16));
  // the level of octave + 1 is the level above this octave's lim: one index for both
  octave = _mm512_mask_add_epi32(octave, _mm512_cmp_ps_mask(r, lim, _CMP_GE_OQ), octave,
                                 _mm512_load_si512(k.one));
  const __m512 t = _mm512_fmadd_ps(
      r, _mm512_permutex2var_ps(_mm512_load_ps(lv.oct_S), octave, _mm512_load_ps(lv.oct_S + 16)),
      _mm512_permutex2var_ps(_mm512_load_ps(lv.oct_C), octave, _mm512_load_ps(lv.oct_C + 16)));
  __m512i code = _mm512_min_epu32(
      _mm512_cvttps_epi32(t), _mm512_permutex2var_epi32(_mm512_load_si512(lv.oct_cap), octave,
                                                        _mm512_load_si512(lv.oct_cap + 16)));
  if constexpr (SIGNED) {
    code = _mm512_mask_sub_epi32(code, _mm512_cmplt_epi32_mask(xb, _mm512_setzero_si512()),
                                 _mm512_load_si512(k.c254), code);
  } else {
    code = _mm512_min_epi32(code, xb);
  }
  return code;  // saturated to 0..255 by avx512_store_codes
}

// 64 codes (4 x 16 int32, in order) saturated to 0..255 and stored as bytes.
INF_TARGET_AVX512 INF_INLINE void avx512_store_codes(uint8_t* dst, __m512i c0, __m512i c1,
                                                     __m512i c2, __m512i c3) {
  const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
  // lane L of b holds c0[4L..4L+3], c1[4L..], c2[4L..], c3[4L..]: a 4x4 transpose of dwords
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi32(order, b));
}

template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE void avx512_codes64(const QLevels& lv, const VConsts& k, __m512 inv,
                                                 const float* src, uint8_t* dst) {
  avx512_store_codes(dst, avx512_codes<SIGNED>(lv, k, inv, _mm512_loadu_ps(src)),
                     avx512_codes<SIGNED>(lv, k, inv, _mm512_loadu_ps(src + 16)),
                     avx512_codes<SIGNED>(lv, k, inv, _mm512_loadu_ps(src + 32)),
                     avx512_codes<SIGNED>(lv, k, inv, _mm512_loadu_ps(src + 48)));
}

// absmax bits of 16 lanes folded into mx (as scalar_absmax).
INF_TARGET_AVX512 INF_INLINE __m512i avx512_absmax_step(const VConsts& k, __m512 x, __m512i mx) {
  return _mm512_max_epu32(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_load_si512(k.abs_mask)), mx);
}

INF_TARGET_AVX512 void avx512_quantize_block(const float* buf, const QMaps& q, int sign,
                                             uint8_t* codes, float* absmax) {
  __m512i mx = _mm512_setzero_si512();
  for (int i = 0; i < kBlock; i += 16) {
    mx = avx512_absmax_step(q.k, _mm512_loadu_ps(buf + i), mx);
  }
  const float scale = absmax_from_bits(_mm512_reduce_max_epu32(mx));
  *absmax = scale;
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const __m512 inv = _mm512_set1_ps(block_inv(scale));
  for (int i = 0; i < kBlock; i += 64) {
    if (sign == kSigned) {
      avx512_codes64<true>(lv, q.k, inv, buf + i, codes + i);
    } else {
      avx512_codes64<false>(lv, q.k, inv, buf + i, codes + i);
    }
  }
}

// map[code] of 16 codes by the decade formula (see the map comment): exponent-indexed tables.
INF_TARGET_AVX512 INF_INLINE __m512 avx512_value_unsigned(const QMaps& q, __m512i code) {
  const ExpTable& t = q.ex[kUnsigned];
  const __m512 j = _mm512_cvtepi32_ps(_mm512_add_epi32(code, _mm512_load_si512(q.k.one)));
  const __m512i jb = _mm512_castps_si512(j);
  const __m512i idx = _mm512_srli_epi32(jb, 23);
  const __m512 k = _mm512_sub_ps(
      j, _mm512_castsi512_ps(_mm512_and_si512(jb, _mm512_load_si512(q.k.exp_mask))));
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, _mm512_load_ps(t.B16)), k,
                         _mm512_permutexvar_ps(idx, _mm512_load_ps(t.A16)));
}

INF_TARGET_AVX512 INF_INLINE __m512 avx512_value_signed(const QMaps& q, __m512i code) {
  const ExpTable& t = q.ex[kSigned];
  const __m512i sign = _mm512_load_si512(q.k.sign_mask);
  // 4j, j = code - 127 (exact in fp32): its exponent indexes the tables (see ExpTable)
  const __m512i sj = _mm512_castps_si512(_mm512_cvtepi32_ps(
      _mm512_slli_epi32(_mm512_sub_epi32(code, _mm512_load_si512(q.k.c127)), 2)));
  const __m512i jb = _mm512_andnot_si512(sign, sj);  // |4j|
  const __m512i idx = _mm512_srli_epi32(jb, 23);
  const __m512 k = _mm512_sub_ps(
      _mm512_castsi512_ps(jb),
      _mm512_castsi512_ps(_mm512_and_si512(jb, _mm512_load_si512(q.k.exp_mask))));  // 4k
  const __m512 mag = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, _mm512_load_ps(t.B16)), k,
                                     _mm512_permutexvar_ps(idx, _mm512_load_ps(t.A16)));
  // mag | (sj & sign)
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), sj, sign, 0xF8));
}

// The 8-bit step's scalars as vectors (scalar_q8_adam).
struct Q8V512 {
  __m512 gmul, decay, wd, lerp, b2, omb2, step, eps, bound, bound_sq;
  bool gmul_one;  // grad_multiplier == 1: no multiply (bitwise the same)
};

INF_TARGET_AVX512 INF_INLINE Q8V512 make_q8v512(const Job& job) {
  const Coeffs& c = job.c;
  return Q8V512{_mm512_set1_ps(c.grad_multiplier), _mm512_set1_ps(c.decay),
                _mm512_set1_ps(c.weight_decay),    _mm512_set1_ps(c.lerp_coeff),
                _mm512_set1_ps(c.beta2),           _mm512_set1_ps(c.one_minus_beta2),
                _mm512_set1_ps(job.q8_step),       _mm512_set1_ps(job.q8_eps),
                _mm512_set1_ps(job.m_bound),       _mm512_set1_ps(job.m_bound_sq),
                c.grad_multiplier == 1.0f};
}

// U x 16 elements at i of the AVX-512 8-bit step: dequantize, guard, update (scalar_q8_adam's
// operations); stores the parameters (and working copy) and returns the new fp32 moments. The
// guard's clamp (a square root per element) runs for the U vectors together when any lane of
// them needs it: rare in training, but in a run of constant gradients the state sits on
// Adam's bound and it fires at random, element by element.
template <int GD, int OD, int U>
INF_TARGET_AVX512 INF_INLINE void avx512_q8_update(const Job& job, const Q8V512& c, const Span& s,
                                                   int i, __m512 ma, __m512 va, __m512* mo,
                                                   __m512* vo) {
  const QMaps& q = *job.q;
  __m512 mi[U], vi[U];
  __mmask16 over[U];
  __mmask16 any = 0;
  for (int u = 0; u < U; ++u) {
    const int e = i + 16 * u;
    const __m512i mc = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.m) + e)));
    const __m512i vc = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.v) + e)));
    vi[u] = _mm512_mul_ps(avx512_value_unsigned(q, vc), va);
    mi[u] = _mm512_mul_ps(avx512_value_signed(q, mc), ma);
    over[u] = _mm512_cmp_ps_mask(_mm512_mul_ps(mi[u], mi[u]), _mm512_mul_ps(c.bound_sq, vi[u]),
                                 _CMP_GT_OQ);  // the moment guard
    any = _kor_mask16(any, over[u]);
  }
  if (any) {
    for (int u = 0; u < U; ++u) {
      const __m512 sb = _mm512_mul_ps(_mm512_sqrt_ps(vi[u]), c.bound);
      mi[u] = _mm512_mask_mov_ps(
          mi[u], over[u],
          _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
              _mm512_castps_si512(sb), _mm512_castps_si512(mi[u]),
              _mm512_load_si512(q.k.sign_mask), 0xF8)));  // sb | (mi & sign)
    }
  }
  for (int u = 0; u < U; ++u) {
    const int e = i + 16 * u;
    __m512 grad = avx512_load_grad<GD, false>(s.g, e, 0);
    if (!c.gmul_one) grad = _mm512_mul_ps(grad, c.gmul);
    __m512 param = _mm512_loadu_ps(s.p + e);
    if (job.c.has_weight_decay) {
      if (job.c.adamw) {
        param = _mm512_mul_ps(param, c.decay);
      } else {
        grad = _mm512_fmadd_ps(param, c.wd, grad);
      }
    }
    mo[u] = _mm512_fmadd_ps(c.lerp, _mm512_sub_ps(grad, mi[u]), job.c.lerp_small ? mi[u] : grad);
    vo[u] = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, grad), grad, _mm512_mul_ps(vi[u], c.b2));
    param = _mm512_sub_ps(param, _mm512_div_ps(_mm512_mul_ps(c.step, mo[u]),
                                               _mm512_add_ps(_mm512_sqrt_ps(vo[u]), c.eps)));
    _mm512_storeu_ps(s.p + e, param);
    if constexpr (OD != kNone) avx512_store_out<OD, false, false>(s.out, e, 0, param);
  }
}

// One block (the padded last block): update into buffers, then re-quantize.
template <int GD, int OD>
INF_TARGET_AVX512 void avx512_q8_block(const Job& job, const Span& s) {
  const Q8V512 c = make_q8v512(job);
  const __m512 ma = _mm512_set1_ps(*s.m_scale);
  const __m512 va = _mm512_set1_ps(*s.v_scale);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 64) {
    __m512 mo[4], vo[4];
    avx512_q8_update<GD, OD, 4>(job, c, s, i, ma, va, mo, vo);
    for (int u = 0; u < 4; ++u) {
      _mm512_store_ps(mbuf + i + 16 * u, mo[u]);
      _mm512_store_ps(vbuf + i + 16 * u, vo[u]);
    }
  }
  requantize<&avx512_quantize_block>(s, *job.q, mbuf, vbuf);
}

// Software prefetch of 64 elements' inputs kPrefetchBlocks blocks ahead (parameters, gradients,
// both moments' codes): the 8-bit step computes long enough per byte that the hardware
// prefetchers alone leave it waiting on DRAM at every 4 KiB page.
constexpr int64_t kPrefetchBlocks = 2;

INF_INLINE void prefetch64(const Job& job, int64_t i) {
  const char* p = reinterpret_cast<const char*>(job.p + i);
  for (int k = 0; k < 256; k += 64) _mm_prefetch(p + k, _MM_HINT_T0);
  const char* g = static_cast<const char*>(job.g) + i * job.gsize;
  for (int k = 0; k < 64 * job.gsize; k += 64) _mm_prefetch(g + k, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(job.m) + i, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(job.v) + i, _MM_HINT_T0);
}

INF_TARGET_AVX512 void avx512_flush_codes(const QMaps& q, Pending& pend) {
  if (pend.m) {
    const __m512 inv = _mm512_set1_ps(pend.minv);
    for (int i = 0; i < kBlock; i += 64) {
      avx512_codes64<true>(q.lv[kSigned], q.k, inv, pend.mbuf + i, pend.mcodes + i);
    }
  }
  if (pend.v) {
    const __m512 inv = _mm512_set1_ps(pend.vinv);
    for (int i = 0; i < kBlock; i += 64) {
      avx512_codes64<false>(q.lv[kUnsigned], q.k, inv, pend.vbuf + i, pend.vcodes + i);
    }
  }
  pend.m = pend.v = false;
}

// A range of blocks, software-pipelined: the re-quantization of block b-1 (ALU and permute work)
// runs in the loop that updates block b (which waits on the divider), 64 elements at a time, so
// the two overlap; the update loop also folds the new moments' absmax. The same operations as
// avx512_q8_block, block by block, so the same bits.
template <int GD, int OD>
INF_TARGET_AVX512 void avx512_q8_range(const Job& job, int64_t b0, int64_t b1) {
  const Q8V512 c = make_q8v512(job);
  const QMaps& q = *job.q;
  alignas(64) float bufs[2][2][kBlock];  // [which][m, v]
  Pending pend;
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
      avx512_flush_codes(q, pend);
      step_padded(job, s);
      continue;
    }
    float* mb = bufs[which][0];
    float* vb = bufs[which][1];
    const __m512 ma = _mm512_set1_ps(*s.m_scale);
    const __m512 va = _mm512_set1_ps(*s.v_scale);
    __m512i mmx = _mm512_setzero_si512(), vmx = _mm512_setzero_si512();
    const bool overlap = pend.m && pend.v;  // else at most one moment (a degenerate block)
    if (!overlap) avx512_flush_codes(q, pend);
    const __m512 minv = _mm512_set1_ps(pend.minv);
    const __m512 vinv = _mm512_set1_ps(pend.vinv);
    const bool prefetch = b + kPrefetchBlocks < b1;
    for (int i = 0; i < kBlock; i += 64) {
      __m512 mo[4], vo[4];
      if (prefetch) prefetch64(job, (b + kPrefetchBlocks) * kBlock + i);
      avx512_q8_update<GD, OD, 4>(job, c, s, i, ma, va, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm512_store_ps(mb + i + 16 * u, mo[u]);
        _mm512_store_ps(vb + i + 16 * u, vo[u]);
        mmx = avx512_absmax_step(q.k, mo[u], mmx);
        vmx = avx512_absmax_step(q.k, vo[u], vmx);
      }
      if (overlap) {
        avx512_codes64<true>(q.lv[kSigned], q.k, minv, pend.mbuf + i, pend.mcodes + i);
        avx512_codes64<false>(q.lv[kUnsigned], q.k, vinv, pend.vbuf + i, pend.vcodes + i);
      }
    }
    pend.m = pend.v = false;
    set_pending(q, s, _mm512_reduce_max_epu32(mmx), _mm512_reduce_max_epu32(vmx), mb, vb, pend);
    which ^= 1;
  }
  avx512_flush_codes(q, pend);
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

// The codes of 8 values by the level rule (see the map comment); inv = 1 / absmax broadcast.
// The level by a binary search over the sorted lims (3 compares).
template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE __m256i avx2_codes(const QLevels& lv, const VConsts& k, __m256 inv,
                                              __m256 x) {
  const __m256 a =
      SIGNED ? _mm256_and_ps(x, _mm256_load_ps(reinterpret_cast<const float*>(k.abs_mask))) : x;
  const __m256 r = _mm256_max_ps(_mm256_mul_ps(a, inv), _mm256_load_ps(k.ratio_min));
  // level = 4 * (r >= lim[3]), + 2 * (r >= lim[level + 1]), + (r >= lim[level])
  __m256i level = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_broadcast_ss(lv.lim + 3), _CMP_GE_OQ)),
      _mm256_load_si256(reinterpret_cast<const __m256i*>(k.c4)));
  level = _mm256_add_epi32(
      level, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(
                                  r, _mm256_permutevar8x32_ps(_mm256_loadu_ps(lv.lim + 1), level),
                                  _CMP_GE_OQ)),
                              _mm256_load_si256(reinterpret_cast<const __m256i*>(k.c2))));
  level = _mm256_sub_epi32(level,
                           _mm256_castps_si256(_mm256_cmp_ps(
                               r, _mm256_permutevar8x32_ps(_mm256_load_ps(lv.lim), level),
                               _CMP_GE_OQ)));
  const __m256 t = _mm256_fmadd_ps(r, _mm256_permutevar8x32_ps(_mm256_load_ps(lv.S), level),
                                   _mm256_permutevar8x32_ps(_mm256_load_ps(lv.C), level));
  __m256i code = _mm256_min_epu32(
      _mm256_cvttps_epi32(t),
      _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(lv.cap)),
                                  level));
  if constexpr (SIGNED) {  // 254 - code where the sign bit of x is set
    const __m256i mirror =
        _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(k.c254)), code);
    code = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(code), _mm256_castsi256_ps(mirror), x));
  } else {
    code = _mm256_min_epi32(code, _mm256_castps_si256(x));
  }
  return code;  // saturated to 0..255 by avx2_store_codes
}

// 32 codes (4 x 8 int32, in order) saturated to 0..255 and stored as bytes.
INF_TARGET_AVX2 INF_INLINE void avx2_store_codes(uint8_t* dst, __m256i c0, __m256i c1, __m256i c2,
                                                 __m256i c3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  // lane L of b holds c0[4L..4L+3], c1[4L..], c2[4L..], c3[4L..]
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(b, order));
}

template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE void avx2_codes32(const QLevels& lv, const VConsts& k, __m256 inv,
                                             const float* src, uint8_t* dst) {
  avx2_store_codes(dst, avx2_codes<SIGNED>(lv, k, inv, _mm256_loadu_ps(src)),
                   avx2_codes<SIGNED>(lv, k, inv, _mm256_loadu_ps(src + 8)),
                   avx2_codes<SIGNED>(lv, k, inv, _mm256_loadu_ps(src + 16)),
                   avx2_codes<SIGNED>(lv, k, inv, _mm256_loadu_ps(src + 24)));
}

// absmax bits of 8 lanes folded into mx (as scalar_absmax), and their maximum.
INF_TARGET_AVX2 INF_INLINE __m256i avx2_absmax_step(const VConsts& k, __m256 x, __m256i mx) {
  return _mm256_max_epu32(
      _mm256_and_si256(_mm256_castps_si256(x),
                       _mm256_load_si256(reinterpret_cast<const __m256i*>(k.abs_mask))),
      mx);
}

INF_TARGET_AVX2 INF_INLINE uint32_t avx2_reduce_max(__m256i mx) {
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
}

INF_TARGET_AVX2 void avx2_quantize_block(const float* buf, const QMaps& q, int sign,
                                         uint8_t* codes, float* absmax) {
  __m256i mx = _mm256_setzero_si256();
  for (int i = 0; i < kBlock; i += 8) mx = avx2_absmax_step(q.k, _mm256_loadu_ps(buf + i), mx);
  const float scale = absmax_from_bits(avx2_reduce_max(mx));
  *absmax = scale;
  const QLevels& lv = q.lv[sign];
  if (degenerate_block(lv, scale, codes)) return;
  const __m256 inv = _mm256_set1_ps(block_inv(scale));
  for (int i = 0; i < kBlock; i += 32) {
    if (sign == kSigned) {
      avx2_codes32<true>(lv, q.k, inv, buf + i, codes + i);
    } else {
      avx2_codes32<false>(lv, q.k, inv, buf + i, codes + i);
    }
  }
}

// map[code] of 8 codes by the decade formula (see the map comment): exponent-indexed tables
// (8 entries: unsigned code 255 takes 1.0 from a compare).
INF_TARGET_AVX2 INF_INLINE __m256 avx2_value_unsigned(const QMaps& q, __m256i code) {
  const ExpTable& t = q.ex[kUnsigned];
  const __m256i one = _mm256_load_si256(reinterpret_cast<const __m256i*>(q.k.one));
  const __m256 j = _mm256_cvtepi32_ps(_mm256_add_epi32(code, one));
  const __m256i jb = _mm256_castps_si256(j);
  const __m256i idx = _mm256_srli_epi32(jb, 23);
  const __m256 k = _mm256_sub_ps(
      j, _mm256_castsi256_ps(_mm256_and_si256(
             jb, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.k.exp_mask)))));
  const __m256 value = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t.B8), idx), k,
                                       _mm256_permutevar8x32_ps(_mm256_load_ps(t.A8), idx));
  // code 255 (f = 8) shares index 7 with code 0: its value there is 0, or it with 1.0
  const __m256i top = _mm256_cmpeq_epi32(
      code, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.k.c255)));
  return _mm256_or_ps(value, _mm256_and_ps(_mm256_castsi256_ps(top), _mm256_load_ps(q.k.one_f)));
}

INF_TARGET_AVX2 INF_INLINE __m256 avx2_value_signed(const QMaps& q, __m256i code) {
  const ExpTable& t = q.ex[kSigned];
  const __m256i c127 = _mm256_load_si256(reinterpret_cast<const __m256i*>(q.k.c127));
  const __m256 sj = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, c127));
  const __m256 sign = _mm256_load_ps(reinterpret_cast<const float*>(q.k.sign_mask));
  const __m256 j = _mm256_andnot_ps(sign, sj);  // |j|
  const __m256i jb = _mm256_castps_si256(j);
  const __m256i idx = _mm256_srli_epi32(jb, 23);
  const __m256 k = _mm256_sub_ps(
      j, _mm256_castsi256_ps(_mm256_and_si256(
             jb, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.k.exp_mask)))));
  const __m256 mag = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t.B8), idx), k,
                                     _mm256_permutevar8x32_ps(_mm256_load_ps(t.A8), idx));
  // code 127 (j = 0) is 0; the sign of code - 127
  const __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, c127));
  return _mm256_or_ps(_mm256_andnot_ps(zero, mag), _mm256_and_ps(sj, sign));
}

// The 8-bit step's scalars as vectors (scalar_q8_adam).
struct Q8V256 {
  __m256 gmul, decay, wd, lerp, b2, omb2, step, eps, bound, bound_sq;
  bool gmul_one;  // grad_multiplier == 1: no multiply (bitwise the same)
};

INF_TARGET_AVX2 INF_INLINE Q8V256 make_q8v256(const Job& job) {
  const Coeffs& c = job.c;
  return Q8V256{_mm256_set1_ps(c.grad_multiplier), _mm256_set1_ps(c.decay),
                _mm256_set1_ps(c.weight_decay),    _mm256_set1_ps(c.lerp_coeff),
                _mm256_set1_ps(c.beta2),           _mm256_set1_ps(c.one_minus_beta2),
                _mm256_set1_ps(job.q8_step),       _mm256_set1_ps(job.q8_eps),
                _mm256_set1_ps(job.m_bound),       _mm256_set1_ps(job.m_bound_sq),
                c.grad_multiplier == 1.0f};
}

// U x 8 elements at i of the AVX2 8-bit step: dequantize, guard, update (scalar_q8_adam's
// operations); stores the parameters (and working copy) and returns the new fp32 moments. The
// guard's clamp runs for the U vectors together when any lane needs it (avx512_q8_update).
template <int GD, int OD, int U>
INF_TARGET_AVX2 INF_INLINE void avx2_q8_update(const Job& job, const Q8V256& c, const Span& s,
                                               int i, __m256 ma, __m256 va, __m256* mo,
                                               __m256* vo) {
  const QMaps& q = *job.q;
  __m256 mi[U], vi[U], over[U];
  __m256 any = _mm256_setzero_ps();
  for (int u = 0; u < U; ++u) {
    const int e = i + 8 * u;
    const __m256i mc = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.m) + e)));
    const __m256i vc = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.v) + e)));
    vi[u] = _mm256_mul_ps(avx2_value_unsigned(q, vc), va);
    mi[u] = _mm256_mul_ps(avx2_value_signed(q, mc), ma);
    over[u] = _mm256_cmp_ps(_mm256_mul_ps(mi[u], mi[u]), _mm256_mul_ps(c.bound_sq, vi[u]),
                            _CMP_GT_OQ);  // the moment guard
    any = _mm256_or_ps(any, over[u]);
  }
  if (_mm256_movemask_ps(any) != 0) {
    const __m256 sign = _mm256_load_ps(reinterpret_cast<const float*>(q.k.sign_mask));
    for (int u = 0; u < U; ++u) {
      const __m256 sb = _mm256_mul_ps(_mm256_sqrt_ps(vi[u]), c.bound);
      mi[u] = _mm256_blendv_ps(mi[u], _mm256_or_ps(sb, _mm256_and_ps(mi[u], sign)), over[u]);
    }
  }
  for (int u = 0; u < U; ++u) {
    const int e = i + 8 * u;
    __m256 grad = avx2_load_grad<GD>(static_cast<const char*>(s.g) + e * dtype_size(GD));
    if (!c.gmul_one) grad = _mm256_mul_ps(grad, c.gmul);
    __m256 param = _mm256_loadu_ps(s.p + e);
    if (job.c.has_weight_decay) {
      if (job.c.adamw) {
        param = _mm256_mul_ps(param, c.decay);
      } else {
        grad = _mm256_fmadd_ps(param, c.wd, grad);
      }
    }
    mo[u] = _mm256_fmadd_ps(c.lerp, _mm256_sub_ps(grad, mi[u]), job.c.lerp_small ? mi[u] : grad);
    vo[u] = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, grad), grad, _mm256_mul_ps(vi[u], c.b2));
    param = _mm256_sub_ps(param, _mm256_div_ps(_mm256_mul_ps(c.step, mo[u]),
                                               _mm256_add_ps(_mm256_sqrt_ps(vo[u]), c.eps)));
    _mm256_storeu_ps(s.p + e, param);
    if constexpr (OD != kNone) {
      avx2_store_out<OD, false>(static_cast<char*>(s.out) + e * dtype_size(OD), param);
    }
  }
}

// One block (the padded last block): update into buffers, then re-quantize.
template <int GD, int OD>
INF_TARGET_AVX2 void avx2_q8_block(const Job& job, const Span& s) {
  const Q8V256 c = make_q8v256(job);
  const __m256 ma = _mm256_set1_ps(*s.m_scale);
  const __m256 va = _mm256_set1_ps(*s.v_scale);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int i = 0; i < kBlock; i += 32) {
    __m256 mo[4], vo[4];
    avx2_q8_update<GD, OD, 4>(job, c, s, i, ma, va, mo, vo);
    for (int u = 0; u < 4; ++u) {
      _mm256_store_ps(mbuf + i + 8 * u, mo[u]);
      _mm256_store_ps(vbuf + i + 8 * u, vo[u]);
    }
  }
  requantize<&avx2_quantize_block>(s, *job.q, mbuf, vbuf);
}

INF_TARGET_AVX2 void avx2_flush_codes(const QMaps& q, Pending& pend) {
  if (pend.m) {
    const __m256 inv = _mm256_set1_ps(pend.minv);
    for (int i = 0; i < kBlock; i += 32) {
      avx2_codes32<true>(q.lv[kSigned], q.k, inv, pend.mbuf + i, pend.mcodes + i);
    }
  }
  if (pend.v) {
    const __m256 inv = _mm256_set1_ps(pend.vinv);
    for (int i = 0; i < kBlock; i += 32) {
      avx2_codes32<false>(q.lv[kUnsigned], q.k, inv, pend.vbuf + i, pend.vcodes + i);
    }
  }
  pend.m = pend.v = false;
}

// A range of blocks, software-pipelined as avx512_q8_range: the re-quantization of block b-1
// runs in the loop that updates block b, 32 elements at a time. The same operations as
// avx2_q8_block block by block, so the same bits.
template <int GD, int OD>
INF_TARGET_AVX2 void avx2_q8_range(const Job& job, int64_t b0, int64_t b1) {
  const Q8V256 c = make_q8v256(job);
  const QMaps& q = *job.q;
  alignas(64) float bufs[2][2][kBlock];  // [which][m, v]
  Pending pend;
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
      avx2_flush_codes(q, pend);
      step_padded(job, s);
      continue;
    }
    float* mb = bufs[which][0];
    float* vb = bufs[which][1];
    const __m256 ma = _mm256_set1_ps(*s.m_scale);
    const __m256 va = _mm256_set1_ps(*s.v_scale);
    __m256i mmx = _mm256_setzero_si256(), vmx = _mm256_setzero_si256();
    const bool overlap = pend.m && pend.v;  // else at most one moment (a degenerate block)
    if (!overlap) avx2_flush_codes(q, pend);
    const __m256 minv = _mm256_set1_ps(pend.minv);
    const __m256 vinv = _mm256_set1_ps(pend.vinv);
    for (int i = 0; i < kBlock; i += 32) {
      __m256 mo[4], vo[4];
      avx2_q8_update<GD, OD, 4>(job, c, s, i, ma, va, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm256_store_ps(mb + i + 8 * u, mo[u]);
        _mm256_store_ps(vb + i + 8 * u, vo[u]);
        mmx = avx2_absmax_step(q.k, mo[u], mmx);
        vmx = avx2_absmax_step(q.k, vo[u], vmx);
      }
      if (overlap) {
        avx2_codes32<true>(q.lv[kSigned], q.k, minv, pend.mbuf + i, pend.mcodes + i);
        avx2_codes32<false>(q.lv[kUnsigned], q.k, vinv, pend.vbuf + i, pend.vcodes + i);
      }
    }
    pend.m = pend.v = false;
    set_pending(q, s, avx2_reduce_max(mmx), avx2_reduce_max(vmx), mb, vb, pend);
    which ^= 1;
  }
  avx2_flush_codes(q, pend);
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
  if (cap == kAVX512) {
    switch (od) {
      case kF32: return &avx512_q8_range<GD, kF32>;
      case kBF16: return &avx512_q8_range<GD, kBF16>;
      case kF16: return &avx512_q8_range<GD, kF16>;
      default: return &avx512_q8_range<GD, kNone>;
    }
  }
  if (cap != kAVX2) return &step_range;
  switch (od) {
    case kF32: return &avx2_q8_range<GD, kF32>;
    case kBF16: return &avx2_q8_range<GD, kBF16>;
    case kF16: return &avx2_q8_range<GD, kF16>;
    default: return &avx2_q8_range<GD, kNone>;
  }
}

// The 8-bit step's range function: the pipelined ones on AVX-512 and AVX2, block by block
// on the scalar path.
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
// dequantize (map[code] * absmax), guard, update in fp32, update p with the fp32 moments (one
// division: scalar_q8_adam), then store the new absmax and the codes of the level rule. All-zero codes with zero scales are a
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
  job.q8_step = static_cast<float>(lr / bias_correction1 * bias_correction2_sqrt);
  job.q8_eps = static_cast<float>(eps * bias_correction2_sqrt);
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
