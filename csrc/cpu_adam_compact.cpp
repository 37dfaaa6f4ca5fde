// CPU Adam / AdamW with compact optimizer states (opt-in): the fp32 master weights stay fp32,
// the two moments are stored
//   (a) as bfloat16 (round to nearest even), 4 bytes of state per parameter instead of 8, or
//   (b) as 8-bit float codes with one power-of-two scale per block of 256 elements and moment:
//       2 + 8/256 bytes per parameter (the format is described below, "8-bit state format").
// Gradients fp32/bf16/fp16 in, optional working copy fp32/bf16/fp16 out, in the same pass, as
// inf_adam_step (csrc/cpu_adam.cpp), whose moment math (FMAs included, in the same order) and
// host-side scalars these kernels share. The bf16 kernel's parameter update is inf_adam_step's
// too (given the same fp32 moments, bitwise the same parameter); the 8-bit kernel's divides once,
// with the bias corrections folded into two scalars (scalar_q8_adam), so that it is not bound by
// the divider. The moments are widened to fp32, updated, the parameter is updated with the
// unrounded fp32 moments, and only then are the moments rounded / encoded for storage.
//
// Every kernel works on blocks of 256 elements (the quantization block; the bf16 kernel uses the
// same blocking for its driver): full blocks in place, the last partial block on zero-padded
// stack copies. Threads split the work on block boundaries, so any thread count gives bitwise
// the same result, and the AVX-512, AVX2+FMA and scalar paths agree bitwise with each other
// (same operations: the encoding and decoding are integer operations and one fma each, the
// per-block exponent a scalar computation every path shares).
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
enum Signedness : int { kUnsigned = 0, kSigned = 1 };  // exp_avg_sq, exp_avg

// The 8-bit step's update variants (a template parameter of the AVX2 path, chosen per call in
// inf_adam_step_q8g): kModeAny reads every flag of Coeffs per vector; the two common cases, with
// grad_multiplier 1 and the lerp form m + (1 - beta1) * (g - m), have them compiled in (the
// same operations, so bitwise the same result, in fewer instructions).
enum Q8Mode : int { kModeAny = 0, kModeAdamW = 1, kModeNoDecay = 2 };

// The 8-bit kernels' per-vector helpers are inlined into their loops (the compiler's own limits
// left some as calls that spill every vector register around each call).
#define INF_INLINE inline __attribute__((always_inline))

constexpr int kBlock = 256;                      // quantization block (elements)
constexpr int64_t kSingleThreadBelow = 1 << 16;  // elements
constexpr int64_t kMinPerThread = 1 << 15;       // elements

// ---- 8-bit state format -------------------------------------------------------------------------
// Per moment: n bytes of codes and ceil(n/256) fp32 "scale fields" S, one per block of 256.
//
// A code is a small float: its magnitude a is read as z = as_float((a << 19) + bits(1.0f)), i.e.
// a's bits become the top exponent and mantissa bits of 1 + fraction (4 mantissa bits), and the
// value is (z - 1) * unit, computed as fma(z, unit, -unit) (exact). So a = 0 is 0, a = 1..15 are
// the linear steps 1/16 .. 15/16, then binades of 16 steps each, up to
//   exp_avg    ("m", signed):   a = 0..127 (3 exponent bits, "e3m4"): top value 247 (z = 248);
//                               the byte is the two's complement of t = sign ? -a : a (-127..127;
//                               -128 is never written, read as a = 128);
//   exp_avg_sq ("v", unsigned): a = byte = 0..255 (4 exponent bits, "e4m4"): top value 63487.
// m's decoded value takes the sign bit of t (decode(0) = +0).
//
// The scale field: bits(S) = bits(2^k) | c_max, where 2^k is a normal fp32 power of two
// (k in [-126, 126]) and c_max (0..255) the largest code magnitude of the block; the unit is
// as_float(bits(S) & ~0xFF) = 2^k. S = +0 is a zero block (codes 0); S = inf or NaN a poisoned
// block (codes 0; fma(z, inf, -inf) = NaN decodes every element to NaN), from a non-finite
// moment. decode(c_max, unit) is the block's largest magnitude, known without reading the codes.
//
// Encoding x at 2^k (inv = 2^-k exact): z = fma(|x|, inv, 1) (v: x itself), then
// q = (bits(z) + 2^18 - bits(1.0f)) >> 19 in uint32 arithmetic: the code of the nearest value
// (ties away from zero, by the carry of the rounding bit into the exponent), a = min(q, top code);
// a positive v keeps at least code 1 (a = max(a, min(int32 bits(x), 1))). q > top code is a clip
// (NaN gives a huge q: clipped too).
//
// The block exponent kfor(x, H) for the largest magnitude x: k = ilogb(x) - E (E = 7 m, 15 v),
// + 1 if x * 2^-k > the top value, + H; clamped to [-126, 126]: x encodes without clipping.
//
// The exact rule (inf_q8_quantize, and the step's exact path): mx = the largest |x| of the block
// (as a bit pattern: NaN if any NaN); NaN / inf: codes 0, S = quiet NaN / inf; 0: codes 0, S = 0;
// else k = kfor(mx, 0), every element encoded, S = 2^k | c_max.
//
// The step (inf_adam_step_q8g) decodes, guards and updates the moments and the parameter, then
// encodes the new moments. Delayed ("fast") path, when both old scale fields are finite with
// c_max > 0 and the step is not Adam with L2 weight decay (whose moments depend on the
// parameter, updated in place before the encoding ends): k = kfor(decode(c_max, old unit),
// kHeadroom) per moment (two binades of headroom over the old block's largest value: a block's
// largest moment can grow 4x in a step before it clips), every element encoded
// in the update loop into staging bytes (the old codes stay intact) while the largest q is
// tracked. A clip redoes the block: its new moments recomputed from the intact old codes (the
// same operations: bitwise the same values; the parameters are not touched again), then the
// exact rule. Else the staged codes are copied and S = 2^k | the largest q. Exact path otherwise
// (first step, zero or poisoned blocks, Adam with L2 weight decay): new moments into fp32
// buffers, then the exact rule.
constexpr uint32_t kOneBits = 0x3F800000u;  // bits(1.0f)
constexpr int kCodeShift = 19;
constexpr uint32_t kRoundAdd = (1u << 18) - kOneBits;  // uint32 wrap-around
constexpr uint32_t kTopCode[2] = {255, 127};           // by Signedness
constexpr float kTopValue[2] = {63487.0f, 247.0f};
constexpr int kTopExp[2] = {15, 7};

inline uint32_t unit_bits(uint32_t scale_bits) { return scale_bits & 0xFFFFFF00u; }
inline bool scale_finite(uint32_t scale_bits) {
  return (scale_bits & 0x7F800000u) != 0x7F800000u;
}
inline float pow2(int k) { return bits_f32(static_cast<uint32_t>(k + 127) << 23); }  // normal k

// The value of magnitude a at unit.
inline float decode_mag(uint32_t a, float unit) {
  return std::fma(bits_f32((a << kCodeShift) + kOneBits), unit, -unit);
}
inline float decode_m(uint8_t byte, float unit) {
  const int32_t t = static_cast<int8_t>(byte);
  const float mag = decode_mag(static_cast<uint32_t>(t < 0 ? -t : t), unit);
  return bits_f32(f32_bits(mag) | (static_cast<uint32_t>(t) & 0x80000000u));
}
inline float decode_v(uint8_t byte, float unit) { return decode_mag(byte, unit); }

// Binades the fast path leaves above a block's previous largest value (infinity/ops/q8_format.py
// HEADROOM).
constexpr int kHeadroom = 2;

// kfor for any x >= 0 (or NaN) by libm: subnormal, zero and inf inputs (a scale field the
// kernels never write still gives a defined, clamped k).
inline int kfor_general(float x, int sign, int headroom) {
  const int e = std::isinf(x) ? 128 : (x == 0.f ? -150 : std::ilogb(x));
  int k = e - kTopExp[sign];
  if (std::ldexp(x, -k) > kTopValue[sign]) k += 1;
  k += headroom;
  return std::min(std::max(k, -126), 126);
}

// The same k from x's bits, twice per block on the step's fast path: for a normal x, ilogb(x) is
// its exponent field - 127 and ldexp(x, -k) (exact: a normal result) is x's mantissa under the
// exponent of 2^E, so the test reads the mantissa bits against the top value.
inline int kfor(float x, int sign, int headroom) {
  const uint32_t b = f32_bits(x);
  const uint32_t field = b >> 23;  // x >= 0: no sign bit; 0 (zero, subnormal), 255 (inf, NaN)
  if (field == 0 || field >= 255) return kfor_general(x, sign, headroom);
  int k = static_cast<int>(field) - 127 - kTopExp[sign];
  const float scaled =
      bits_f32((b & 0x007FFFFFu) | (static_cast<uint32_t>(kTopExp[sign] + 127) << 23));
  if (scaled > kTopValue[sign]) k += 1;
  k += headroom;
  return std::min(std::max(k, -126), 126);
}

// q of one element (before the clamp to the top code; v: with the floor of a positive x).
inline uint32_t encode_q(float x, float inv, int sign) {
  const float ax = sign == kSigned ? std::fabs(x) : x;
  const uint32_t q = (f32_bits(std::fma(ax, inv, 1.0f)) + kRoundAdd) >> kCodeShift;
  if (sign == kSigned) return q;
  return static_cast<uint32_t>(std::max(static_cast<int32_t>(q),
                                        std::min(static_cast<int32_t>(f32_bits(x)), 1)));
}
inline uint8_t code_byte(float x, uint32_t q, int sign) {
  const uint32_t a = std::min(q, kTopCode[sign]);
  if (sign == kSigned && std::signbit(x)) return static_cast<uint8_t>(0u - a);
  return static_cast<uint8_t>(a);
}

// The largest |x| bit pattern of a block's 256 values as the exact rule reads it.
inline uint32_t absmax_bits(const float* buf) {
  uint32_t mx = 0;
  for (int i = 0; i < kBlock; ++i) mx = std::max(mx, f32_bits(buf[i]) & 0x7FFFFFFFu);
  return mx;
}

// The exact rule's outcome for a degenerate block (mx zero, inf or NaN): true when handled.
inline bool exact_degenerate(uint32_t mx, uint8_t* codes, float* scale) {
  if (mx != 0 && mx < 0x7F800000u) return false;
  std::memset(codes, 0, kBlock);
  *scale = bits_f32(mx > 0x7F800000u ? 0x7FC00000u : mx);
  return true;
}

inline float scale_field(int k, uint32_t c_max) { return bits_f32(f32_bits(pow2(k)) | c_max); }

// The per-block set-up of the step: the old units and, on the fast path, the two new exponents.
struct BlockPlan {
  float unit_m, unit_v;
  bool fast;
  int km, kv;
  float inv_m, inv_v;
};

// ---- jobs ---------------------------------------------------------------------------------------
// One block (up to 256 elements) at explicit addresses: the arrays, or padded stack copies.
struct Span {
  float* p;
  const void* g;
  void* m;         // bf16 moments or 8-bit codes
  void* v;
  float* m_scale;  // 8-bit: this block's scale field (read, then overwritten); else null
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
  float m_bound = 0.f;     // 8-bit: the moment guard's bound (inf_adam_step_q8g)
  float m_bound_sq = 0.f;  // m_bound * m_bound (fp32)
  float q8_step = 0.f;     // 8-bit: lr / bc1 * sqrt(bc2) (scalar_q8_adam)
  float q8_eps = 0.f;      // 8-bit: eps * sqrt(bc2)
  bool q8_delayed = false; // 8-bit: the delayed encoding is allowed (not Adam with L2 decay)
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
  void (*quantize)(const float* buf, int sign, uint8_t* codes, float* scale) = nullptr;
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


// ---- 8-bit: shared scalar pieces ----------------------------------------------------------------
inline BlockPlan plan_block(const Job& job, const Span& s) {
  const uint32_t mb = f32_bits(*s.m_scale);
  const uint32_t vb = f32_bits(*s.v_scale);
  BlockPlan pl{};
  pl.unit_m = bits_f32(unit_bits(mb));
  pl.unit_v = bits_f32(unit_bits(vb));
  pl.fast = job.q8_delayed && scale_finite(mb) && scale_finite(vb) && (mb & 0xFFu) != 0 &&
            (vb & 0xFFu) != 0;
  if (pl.fast) {
    pl.km = kfor(decode_mag(mb & 0xFFu, pl.unit_m), kSigned, kHeadroom);
    pl.kv = kfor(decode_mag(vb & 0xFFu, pl.unit_v), kUnsigned, kHeadroom);
    pl.inv_m = pow2(-pl.km);
    pl.inv_v = pow2(-pl.kv);
  }
  return pl;
}

// The exact rule on 256 fp32 values (see the format comment).
void scalar_exact_block(const float* buf, int sign, uint8_t* codes, float* scale) {
  const uint32_t mx = absmax_bits(buf);
  if (exact_degenerate(mx, codes, scale)) return;
  const int k = kfor(bits_f32(mx), sign, 0);
  const float inv = pow2(-k);
  uint32_t top = 0;
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t q = encode_q(buf[i], inv, sign);
    top = std::max(top, q);
    codes[i] = code_byte(buf[i], q, sign);
  }
  *scale = scale_field(k, std::min(top, kTopCode[sign]));
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

// Element i of the 8-bit step: decode, guard, update; returns the parameter, sets mo, vo.
template <int GD>
inline float scalar_q8_element(const Job& job, const Span& s, const BlockPlan& pl, int i,
                               float& mo, float& vo) {
  const float vi = decode_v(static_cast<const uint8_t*>(s.v)[i], pl.unit_v);
  const float mi = scalar_guard(decode_m(static_cast<const uint8_t*>(s.m)[i], pl.unit_m), vi,
                                job.m_bound, job.m_bound_sq);
  return scalar_q8_adam(job, scalar_load_grad<GD>(s.g, i), s.p[i], mi, vi, mo, vo);
}

// One full block (or a zero-padded copy of the last one).
template <int GD, int OD>
void scalar_q8_block(const Job& job, const Span& span) {
  const Span s = span;  // a local copy: not reloaded after each store through its pointers
  const BlockPlan pl = plan_block(job, s);
  uint8_t* mq = static_cast<uint8_t*>(s.m);
  uint8_t* vq = static_cast<uint8_t*>(s.v);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  alignas(64) uint8_t mst[kBlock];
  alignas(64) uint8_t vst[kBlock];
  uint32_t qm = 0, qv = 0;
  for (int i = 0; i < kBlock; ++i) {
    float mo, vo;
    const float param = scalar_q8_element<GD>(job, s, pl, i, mo, vo);
    s.p[i] = param;
    if constexpr (OD != kNone) scalar_store_out<OD>(s.out, i, param);
    if (pl.fast) {
      const uint32_t a = encode_q(mo, pl.inv_m, kSigned);
      const uint32_t b = encode_q(vo, pl.inv_v, kUnsigned);
      qm = std::max(qm, a);
      qv = std::max(qv, b);
      mst[i] = code_byte(mo, a, kSigned);
      vst[i] = code_byte(vo, b, kUnsigned);
    } else {
      mbuf[i] = mo;
      vbuf[i] = vo;
    }
  }
  if (pl.fast) {
    if (qm <= kTopCode[kSigned] && qv <= kTopCode[kUnsigned]) {
      std::memcpy(mq, mst, kBlock);
      std::memcpy(vq, vst, kBlock);
      *s.m_scale = scale_field(pl.km, qm);
      *s.v_scale = scale_field(pl.kv, qv);
      return;
    }
    for (int i = 0; i < kBlock; ++i) scalar_q8_element<GD>(job, s, pl, i, mbuf[i], vbuf[i]);
  }
  scalar_exact_block(mbuf, kSigned, mq, s.m_scale);
  scalar_exact_block(vbuf, kUnsigned, vq, s.v_scale);
}

// Software prefetch of the inputs of block b (parameters, gradients, both moments' codes), run
// kPrefetchBlocks blocks ahead: the 8-bit step computes long enough per byte that the hardware
// prefetchers alone leave it waiting on DRAM at every 4 KiB page.
constexpr int64_t kPrefetchBlocks = 2;

inline void prefetch_block(const Job& job, int64_t b) {
  const int64_t i = b * kBlock;
  const char* p = reinterpret_cast<const char*>(job.p + i);
  for (int k = 0; k < kBlock * 4; k += 64) _mm_prefetch(p + k, _MM_HINT_T0);
  const char* g = static_cast<const char*>(job.g) + i * job.gsize;
  for (int k = 0; k < kBlock * job.gsize; k += 64) _mm_prefetch(g + k, _MM_HINT_T0);
  const char* m = static_cast<const char*>(job.m) + i;
  const char* v = static_cast<const char*>(job.v) + i;
  for (int k = 0; k < kBlock; k += 64) {
    _mm_prefetch(m + k, _MM_HINT_T0);
    _mm_prefetch(v + k, _MM_HINT_T0);
  }
}

// The 8-bit step's range: block by block (one pass each), prefetching ahead; only full blocks
// are prefetched (the padded last one is copied anyway).
void q8_range(const Job& job, int64_t b0, int64_t b1) {
  const int64_t full = job.n / kBlock;
  for (int64_t b = b0; b < b1; ++b) {
    if (b + kPrefetchBlocks < std::min(b1, full)) prefetch_block(job, b + kPrefetchBlocks);
    const int64_t i = b * kBlock;
    const Span s{job.p + i,
                 static_cast<const char*>(job.g) + i * job.gsize,
                 static_cast<char*>(job.m) + i,
                 static_cast<char*>(job.v) + i,
                 job.m_scale + b,
                 job.v_scale + b,
                 job.out != nullptr ? static_cast<char*>(job.out) + i * job.osize : nullptr,
                 static_cast<int>(std::min<int64_t>(kBlock, job.n - i))};
    if (s.count == kBlock) {
      job.block(job, s);
    } else {
      step_padded(job, s);
    }
  }
}

// ---- vector paths -------------------------------------------------------------------------------
using QuantizeFn = void (*)(const float*, int, uint8_t*, float*);

// ---- AVX-512 path: bf16 moments -----------------------------------------------------------------
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

// ---- AVX-512 path: 8-bit ------------------------------------------------------------------------
// 16 magnitudes' values at unit: fma(as_float((a << 19) + bits(1)), unit, -unit).
INF_TARGET_AVX512 INF_INLINE __m512 avx512_decode_mag(__m512i a, __m512 unit) {
  const __m512 z = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(a, kCodeShift), _mm512_set1_epi32(kOneBits)));
  return _mm512_fmsub_ps(z, unit, unit);
}

// q of 16 values at inv (before the clamp; v with the floor); mx folds the largest q.
template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE __m512i avx512_encode_q(__m512 x, __m512 inv, __m512i& mx) {
  const __m512i xb = _mm512_castps_si512(x);
  const __m512 ax =
      SIGNED ? _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7FFFFFFF))) : x;
  const __m512 z = _mm512_fmadd_ps(ax, inv, _mm512_set1_ps(1.0f));
  __m512i q = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_castps_si512(z), _mm512_set1_epi32(static_cast<int>(kRoundAdd))),
      kCodeShift);
  if constexpr (!SIGNED) q = _mm512_max_epi32(q, _mm512_min_epi32(xb, _mm512_set1_epi32(1)));
  mx = _mm512_max_epu32(mx, q);
  return q;
}

// 16 codes of x from their q, as int32 (m: t = -a where x's sign bit is set).
template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE __m512i avx512_codes(__m512 x, __m512i q) {
  __m512i a = _mm512_min_epu32(q, _mm512_set1_epi32(static_cast<int>(kTopCode[SIGNED])));
  if constexpr (SIGNED) {
    const __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(x), _mm512_setzero_si512());
    a = _mm512_mask_sub_epi32(a, neg, _mm512_setzero_si512(), a);
  }
  return a;
}

// 64 codes (4 x 16 int32 in order: m -127..127 by signed-saturating packs, v 0..255 unsigned)
// stored as bytes: two packs and one permute instead of four narrowing stores.
template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE void avx512_store_codes(uint8_t* dst, const __m512i* c) {
  __m512i b;
  if constexpr (SIGNED) {
    b = _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));
  } else {
    b = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
  }
  // lane L of b holds c0[4L..4L+3], c1[4L..], c2[4L..], c3[4L..]: a 4x4 transpose of dwords
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi32(order, b));
}

// 64 values at inv encoded into dst; mx folds the largest q.
template <bool SIGNED>
INF_TARGET_AVX512 INF_INLINE void avx512_encode64(const __m512* x, __m512 inv, __m512i& mx,
                                                  uint8_t* dst) {
  __m512i c[4];
  for (int u = 0; u < 4; ++u) {
    c[u] = avx512_codes<SIGNED>(x[u], avx512_encode_q<SIGNED>(x[u], inv, mx));
  }
  avx512_store_codes<SIGNED>(dst, c);
}

// The exact rule on 256 fp32 values (scalar_exact_block's operations).
INF_TARGET_AVX512 void avx512_exact_block(const float* buf, int sign, uint8_t* codes,
                                          float* scale) {
  __m512i amx = _mm512_setzero_si512();
  for (int i = 0; i < kBlock; i += 16) {
    amx = _mm512_max_epu32(
        amx, _mm512_and_si512(_mm512_loadu_si512(buf + i), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  const uint32_t mx = _mm512_reduce_max_epu32(amx);
  if (exact_degenerate(mx, codes, scale)) return;
  const int k = kfor(bits_f32(mx), sign, 0);
  const __m512 inv = _mm512_set1_ps(pow2(-k));
  __m512i top = _mm512_setzero_si512();
  for (int i = 0; i < kBlock; i += 64) {
    const __m512 x[4] = {_mm512_loadu_ps(buf + i), _mm512_loadu_ps(buf + i + 16),
                         _mm512_loadu_ps(buf + i + 32), _mm512_loadu_ps(buf + i + 48)};
    if (sign == kSigned) {
      avx512_encode64<true>(x, inv, top, codes + i);
    } else {
      avx512_encode64<false>(x, inv, top, codes + i);
    }
  }
  *scale = scale_field(k, std::min<uint32_t>(_mm512_reduce_max_epu32(top), kTopCode[sign]));
}

// The 8-bit step's scalars as vectors (scalar_q8_adam).
struct Q8V512 {
  __m512 gmul, decay, wd, lerp, b2, omb2, step, eps, bound, bound_sq;
  bool gmul_one;  // grad_multiplier == 1: no multiply (bitwise the same)
  bool has_wd, adamw, lerp_small;  // job.c's, held here (not reloaded after each store)
};

INF_TARGET_AVX512 INF_INLINE Q8V512 make_q8v512(const Job& job) {
  const Coeffs& c = job.c;
  return Q8V512{_mm512_set1_ps(c.grad_multiplier), _mm512_set1_ps(c.decay),
                _mm512_set1_ps(c.weight_decay),    _mm512_set1_ps(c.lerp_coeff),
                _mm512_set1_ps(c.beta2),           _mm512_set1_ps(c.one_minus_beta2),
                _mm512_set1_ps(job.q8_step),       _mm512_set1_ps(job.q8_eps),
                _mm512_set1_ps(job.m_bound),       _mm512_set1_ps(job.m_bound_sq),
                c.grad_multiplier == 1.0f,         c.has_weight_decay,
                c.adamw,                           c.lerp_small};
}

// U x 16 elements at i of the AVX-512 8-bit step: decode, guard, update (scalar_q8_adam's
// operations); stores the parameters (and working copy) when STORE and returns the new fp32
// moments. The guard's clamp (a square root per element) runs for the U vectors together when
// any lane of them needs it: rare in training, but in a run of constant gradients the state sits
// on Adam's bound and it fires at random, element by element.
template <int GD, int OD, int U, bool STORE>
INF_TARGET_AVX512 INF_INLINE void avx512_q8_update(const Q8V512& c, const Span& s, int i,
                                                   __m512 um, __m512 uv, __m512* mo, __m512* vo) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  __m512 mi[U], vi[U];
  __mmask16 over[U];
  __mmask16 any = 0;
  for (int u = 0; u < U; ++u) {
    const int e = i + 16 * u;
    const __m512i t = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.m) + e)));
    const __m512i vc = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.v) + e)));
    vi[u] = avx512_decode_mag(vc, uv);
    const __m512 mag = avx512_decode_mag(_mm512_abs_epi32(t), um);
    mi[u] = _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(mag), t, sign, 0xF8));  // mag | (t & sign)
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
              _mm512_castps_si512(sb), _mm512_castps_si512(mi[u]), sign, 0xF8)));
    }
  }
  for (int u = 0; u < U; ++u) {
    const int e = i + 16 * u;
    __m512 grad = avx512_load_grad<GD, false>(s.g, e, 0);
    if (!c.gmul_one) grad = _mm512_mul_ps(grad, c.gmul);
    __m512 param = _mm512_loadu_ps(s.p + e);
    if (c.has_wd) {
      if (c.adamw) {
        param = _mm512_mul_ps(param, c.decay);
      } else {
        grad = _mm512_fmadd_ps(param, c.wd, grad);
      }
    }
    mo[u] = _mm512_fmadd_ps(c.lerp, _mm512_sub_ps(grad, mi[u]), c.lerp_small ? mi[u] : grad);
    vo[u] = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, grad), grad, _mm512_mul_ps(vi[u], c.b2));
    if constexpr (STORE) {
      param = _mm512_sub_ps(param, _mm512_div_ps(_mm512_mul_ps(c.step, mo[u]),
                                                 _mm512_add_ps(_mm512_sqrt_ps(vo[u]), c.eps)));
      _mm512_storeu_ps(s.p + e, param);
      if constexpr (OD != kNone) avx512_store_out<OD, false, false>(s.out, e, 0, param);
    }
  }
}

// One full block (or a zero-padded copy of the last one), one pass (see the format comment).
template <int GD, int OD>
INF_TARGET_AVX512 void avx512_q8_block(const Job& job, const Span& span) {
  const Span s = span;  // a local copy: not reloaded after each store through its pointers
  const Q8V512 c = make_q8v512(job);
  const BlockPlan pl = plan_block(job, s);
  const __m512 um = _mm512_set1_ps(pl.unit_m);
  const __m512 uv = _mm512_set1_ps(pl.unit_v);
  uint8_t* mq = static_cast<uint8_t*>(s.m);
  uint8_t* vq = static_cast<uint8_t*>(s.v);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  alignas(64) uint8_t mst[kBlock];
  alignas(64) uint8_t vst[kBlock];
  if (pl.fast) {
    const __m512 im = _mm512_set1_ps(pl.inv_m);
    const __m512 iv = _mm512_set1_ps(pl.inv_v);
    __m512i qm = _mm512_setzero_si512(), qv = _mm512_setzero_si512();
    for (int i = 0; i < kBlock; i += 64) {
      __m512 mo[4], vo[4];
      avx512_q8_update<GD, OD, 4, true>(c, s, i, um, uv, mo, vo);
      avx512_encode64<true>(mo, im, qm, mst + i);
      avx512_encode64<false>(vo, iv, qv, vst + i);
    }
    const uint32_t tm = _mm512_reduce_max_epu32(qm);
    const uint32_t tv = _mm512_reduce_max_epu32(qv);
    if (tm <= kTopCode[kSigned] && tv <= kTopCode[kUnsigned]) {
      for (int i = 0; i < kBlock; i += 64) {
        _mm512_storeu_si512(mq + i, _mm512_load_si512(mst + i));
        _mm512_storeu_si512(vq + i, _mm512_load_si512(vst + i));
      }
      *s.m_scale = scale_field(pl.km, tm);
      *s.v_scale = scale_field(pl.kv, tv);
      return;
    }
    for (int i = 0; i < kBlock; i += 64) {  // a clip: redo from the intact old codes
      __m512 mo[4], vo[4];
      avx512_q8_update<GD, OD, 4, false>(c, s, i, um, uv, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm512_store_ps(mbuf + i + 16 * u, mo[u]);
        _mm512_store_ps(vbuf + i + 16 * u, vo[u]);
      }
    }
  } else {
    for (int i = 0; i < kBlock; i += 64) {
      __m512 mo[4], vo[4];
      avx512_q8_update<GD, OD, 4, true>(c, s, i, um, uv, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm512_store_ps(mbuf + i + 16 * u, mo[u]);
        _mm512_store_ps(vbuf + i + 16 * u, vo[u]);
      }
    }
  }
  avx512_exact_block(mbuf, kSigned, mq, s.m_scale);
  avx512_exact_block(vbuf, kUnsigned, vq, s.v_scale);
}

// ---- AVX2 path: bf16 moments --------------------------------------------------------------------
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

// ---- AVX2 path: 8-bit ---------------------------------------------------------------------------
INF_TARGET_AVX2 INF_INLINE __m256 avx2_decode_mag(__m256i a, __m256 unit) {
  const __m256 z = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(a, kCodeShift), _mm256_set1_epi32(kOneBits)));
  return _mm256_fmsub_ps(z, unit, unit);
}

template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE __m256i avx2_encode_q(__m256 x, __m256 inv, __m256i& mx) {
  const __m256i xb = _mm256_castps_si256(x);
  const __m256 ax =
      SIGNED ? _mm256_castsi256_ps(_mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF))) : x;
  const __m256 z = _mm256_fmadd_ps(ax, inv, _mm256_set1_ps(1.0f));
  __m256i q = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(z), _mm256_set1_epi32(static_cast<int>(kRoundAdd))),
      kCodeShift);
  if constexpr (!SIGNED) q = _mm256_max_epi32(q, _mm256_min_epi32(xb, _mm256_set1_epi32(1)));
  mx = _mm256_max_epu32(mx, q);
  return q;
}

// 8 codes of x as int32 (m: t = -a where x's sign bit is set).
template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE __m256i avx2_codes(__m256 x, __m256i q) {
  const __m256i a = _mm256_min_epu32(q, _mm256_set1_epi32(static_cast<int>(kTopCode[SIGNED])));
  if constexpr (!SIGNED) return a;
  // -a where x's bits are negative as an int32 (its sign bit), a where positive; where x is +0
  // its a is 0
  return _mm256_sign_epi32(a, _mm256_castps_si256(x));
}

// 32 codes (4 x 8 int32 in order: m -127..127 signed-saturating packs, v 0..255 unsigned) as bytes.
template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE void avx2_store_codes(uint8_t* dst, __m256i c0, __m256i c1, __m256i c2,
                                                 __m256i c3) {
  __m256i b;
  if constexpr (SIGNED) {
    b = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
  } else {
    b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  }
  // lane L of b holds c0[4L..4L+3], c1[4L..], c2[4L..], c3[4L..]
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(b, order));
}

// 32 values at inv encoded into dst; mx folds the largest q.
template <bool SIGNED>
INF_TARGET_AVX2 INF_INLINE void avx2_encode32(const __m256* x, __m256 inv, __m256i& mx,
                                              uint8_t* dst) {
  __m256i c[4];
  for (int u = 0; u < 4; ++u) c[u] = avx2_codes<SIGNED>(x[u], avx2_encode_q<SIGNED>(x[u], inv, mx));
  avx2_store_codes<SIGNED>(dst, c[0], c[1], c[2], c[3]);
}

INF_TARGET_AVX2 INF_INLINE uint32_t avx2_reduce_max(__m256i mx) {
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
}

// The exact rule on 256 fp32 values (scalar_exact_block's operations).
INF_TARGET_AVX2 void avx2_exact_block(const float* buf, int sign, uint8_t* codes, float* scale) {
  __m256i amx = _mm256_setzero_si256();
  for (int i = 0; i < kBlock; i += 8) {
    amx = _mm256_max_epu32(
        amx, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf + i)),
                              _mm256_set1_epi32(0x7FFFFFFF)));
  }
  const uint32_t mx = avx2_reduce_max(amx);
  if (exact_degenerate(mx, codes, scale)) return;
  const int k = kfor(bits_f32(mx), sign, 0);
  const __m256 inv = _mm256_set1_ps(pow2(-k));
  __m256i top = _mm256_setzero_si256();
  for (int i = 0; i < kBlock; i += 32) {
    const __m256 x[4] = {_mm256_loadu_ps(buf + i), _mm256_loadu_ps(buf + i + 8),
                         _mm256_loadu_ps(buf + i + 16), _mm256_loadu_ps(buf + i + 24)};
    if (sign == kSigned) {
      avx2_encode32<true>(x, inv, top, codes + i);
    } else {
      avx2_encode32<false>(x, inv, top, codes + i);
    }
  }
  *scale = scale_field(k, std::min<uint32_t>(avx2_reduce_max(top), kTopCode[sign]));
}

// The 8-bit step's scalars as vectors (scalar_q8_adam).
struct Q8V256 {
  __m256 gmul, decay, wd, lerp, b2, omb2, step, eps, bound, bound_sq;
  bool gmul_one;  // grad_multiplier == 1: no multiply (bitwise the same)
  bool has_wd, adamw, lerp_small;  // job.c's, held here (not reloaded after each store)
};

INF_TARGET_AVX2 INF_INLINE Q8V256 make_q8v256(const Job& job) {
  const Coeffs& c = job.c;
  return Q8V256{_mm256_set1_ps(c.grad_multiplier), _mm256_set1_ps(c.decay),
                _mm256_set1_ps(c.weight_decay),    _mm256_set1_ps(c.lerp_coeff),
                _mm256_set1_ps(c.beta2),           _mm256_set1_ps(c.one_minus_beta2),
                _mm256_set1_ps(job.q8_step),       _mm256_set1_ps(job.q8_eps),
                _mm256_set1_ps(job.m_bound),       _mm256_set1_ps(job.m_bound_sq),
                c.grad_multiplier == 1.0f,         c.has_weight_decay,
                c.adamw,                           c.lerp_small};
}

// U x 8 elements at i of the AVX2 8-bit step (avx512_q8_update's operations), the flags of
// Coeffs as MODE fixes them.
template <int GD, int OD, int U, bool STORE, int MODE>
INF_TARGET_AVX2 INF_INLINE void avx2_q8_update(const Q8V256& c, const Span& s, int i,
                                               __m256 um, __m256 uv, __m256* mo, __m256* vo) {
  const bool gmul_one = MODE != kModeAny || c.gmul_one;
  const bool has_wd = MODE == kModeAny ? c.has_wd : MODE == kModeAdamW;
  const bool adamw = MODE != kModeAny || c.adamw;
  const bool lerp_small = MODE != kModeAny || c.lerp_small;
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  __m256 mi[U], vi[U], over[U];
  __m256 any = _mm256_setzero_ps();
  for (int u = 0; u < U; ++u) {
    const int e = i + 8 * u;
    const __m256i t = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.m) + e)));
    const __m256i vc = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s.v) + e)));
    vi[u] = avx2_decode_mag(vc, uv);
    const __m256 mag = avx2_decode_mag(_mm256_abs_epi32(t), um);
    mi[u] = _mm256_or_ps(mag, _mm256_and_ps(_mm256_castsi256_ps(t), sign));
    over[u] = _mm256_cmp_ps(_mm256_mul_ps(mi[u], mi[u]), _mm256_mul_ps(c.bound_sq, vi[u]),
                            _CMP_GT_OQ);  // the moment guard
    any = _mm256_or_ps(any, over[u]);
  }
  if (_mm256_movemask_ps(any) != 0) {
    for (int u = 0; u < U; ++u) {
      const __m256 sb = _mm256_mul_ps(_mm256_sqrt_ps(vi[u]), c.bound);
      mi[u] = _mm256_blendv_ps(mi[u], _mm256_or_ps(sb, _mm256_and_ps(mi[u], sign)), over[u]);
    }
  }
  for (int u = 0; u < U; ++u) {
    const int e = i + 8 * u;
    __m256 grad = avx2_load_grad<GD>(static_cast<const char*>(s.g) + e * dtype_size(GD));
    if (!gmul_one) grad = _mm256_mul_ps(grad, c.gmul);
    __m256 param = _mm256_loadu_ps(s.p + e);
    if (has_wd) {
      if (adamw) {
        param = _mm256_mul_ps(param, c.decay);
      } else {
        grad = _mm256_fmadd_ps(param, c.wd, grad);
      }
    }
    mo[u] = _mm256_fmadd_ps(c.lerp, _mm256_sub_ps(grad, mi[u]), lerp_small ? mi[u] : grad);
    vo[u] = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, grad), grad, _mm256_mul_ps(vi[u], c.b2));
    if constexpr (STORE) {
      param = _mm256_sub_ps(param, _mm256_div_ps(_mm256_mul_ps(c.step, mo[u]),
                                                 _mm256_add_ps(_mm256_sqrt_ps(vo[u]), c.eps)));
      _mm256_storeu_ps(s.p + e, param);
      if constexpr (OD != kNone) {
        avx2_store_out<OD, false>(static_cast<char*>(s.out) + e * dtype_size(OD), param);
      }
    }
  }
}

// One full block (or a zero-padded copy of the last one), as avx512_q8_block.
template <int GD, int OD, int MODE>
INF_TARGET_AVX2 void avx2_q8_block(const Job& job, const Span& span) {
  const Span s = span;  // a local copy: not reloaded after each store through its pointers
  const Q8V256 c = make_q8v256(job);
  const BlockPlan pl = plan_block(job, s);
  const __m256 um = _mm256_set1_ps(pl.unit_m);
  const __m256 uv = _mm256_set1_ps(pl.unit_v);
  uint8_t* mq = static_cast<uint8_t*>(s.m);
  uint8_t* vq = static_cast<uint8_t*>(s.v);
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  alignas(64) uint8_t mst[kBlock];
  alignas(64) uint8_t vst[kBlock];
  if (pl.fast) {
    const __m256 im = _mm256_set1_ps(pl.inv_m);
    const __m256 iv = _mm256_set1_ps(pl.inv_v);
    __m256i qm = _mm256_setzero_si256(), qv = _mm256_setzero_si256();
    for (int i = 0; i < kBlock; i += 32) {
      __m256 mo[4], vo[4];
      avx2_q8_update<GD, OD, 4, true, MODE>(c, s, i, um, uv, mo, vo);
      avx2_encode32<true>(mo, im, qm, mst + i);
      avx2_encode32<false>(vo, iv, qv, vst + i);
    }
    const uint32_t tm = avx2_reduce_max(qm);
    const uint32_t tv = avx2_reduce_max(qv);
    if (tm <= kTopCode[kSigned] && tv <= kTopCode[kUnsigned]) {
      std::memcpy(mq, mst, kBlock);
      std::memcpy(vq, vst, kBlock);
      *s.m_scale = scale_field(pl.km, tm);
      *s.v_scale = scale_field(pl.kv, tv);
      return;
    }
    for (int i = 0; i < kBlock; i += 32) {  // a clip: redo from the intact old codes
      __m256 mo[4], vo[4];
      avx2_q8_update<GD, OD, 4, false, MODE>(c, s, i, um, uv, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm256_store_ps(mbuf + i + 8 * u, mo[u]);
        _mm256_store_ps(vbuf + i + 8 * u, vo[u]);
      }
    }
  } else {
    for (int i = 0; i < kBlock; i += 32) {
      __m256 mo[4], vo[4];
      avx2_q8_update<GD, OD, 4, true, MODE>(c, s, i, um, uv, mo, vo);
      for (int u = 0; u < 4; ++u) {
        _mm256_store_ps(mbuf + i + 8 * u, mo[u]);
        _mm256_store_ps(vbuf + i + 8 * u, vo[u]);
      }
    }
  }
  avx2_exact_block(mbuf, kSigned, mq, s.m_scale);
  avx2_exact_block(vbuf, kUnsigned, vq, s.v_scale);
}

// ---- dispatch -----------------------------------------------------------------------------------
template <int K, int GD, int OD>
BlockFn pick(int cap, int mode) {
  if constexpr (K == kKernelBF16Moments) {
    if (cap == kAVX512) return &avx512_bf16m_block<GD, OD>;
    if (cap == kAVX2) return &avx2_bf16m_block<GD, OD>;
    return &scalar_bf16m_block<GD, OD>;
  } else {
    if (cap == kAVX512) return &avx512_q8_block<GD, OD>;
    if (cap == kAVX2) {
      if (mode == kModeAdamW) return &avx2_q8_block<GD, OD, kModeAdamW>;
      if (mode == kModeNoDecay) return &avx2_q8_block<GD, OD, kModeNoDecay>;
      return &avx2_q8_block<GD, OD, kModeAny>;
    }
    return &scalar_q8_block<GD, OD>;
  }
}

template <int K, int GD>
BlockFn pick_out(int cap, int od, int mode) {
  switch (od) {
    case kF32: return pick<K, GD, kF32>(cap, mode);
    case kBF16: return pick<K, GD, kBF16>(cap, mode);
    case kF16: return pick<K, GD, kF16>(cap, mode);
    default: return pick<K, GD, kNone>(cap, mode);
  }
}

// mode: the 8-bit kernel's Q8Mode (ignored by the bf16 kernel).
template <int K>
BlockFn select_block(int cap, int gd, int od, int mode = kModeAny) {
  switch (gd) {
    case kF32: return pick_out<K, kF32>(cap, od, mode);
    case kBF16: return pick_out<K, kBF16>(cap, od, mode);
    default: return pick_out<K, kF16>(cap, od, mode);
  }
}

// The Q8Mode of a step's coefficients.
int q8_mode(const Coeffs& c) {
  if (c.grad_multiplier != 1.0f || !c.lerp_small) return kModeAny;
  if (!c.has_weight_decay) return kModeNoDecay;
  return c.adamw ? kModeAdamW : kModeAny;
}

QuantizeFn select_quantize(int cap) {
  if (cap == kAVX512) return &avx512_exact_block;
  if (cap == kAVX2) return &avx2_exact_block;
  return &scalar_exact_block;
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
      job.quantize(job.x + i, job.sign, job.codes + i, job.scale + b);
    } else {
      alignas(64) float buf[kBlock] = {};
      alignas(64) uint8_t codes[kBlock];
      std::memcpy(buf, job.x + i, static_cast<size_t>(count) * 4);
      job.quantize(buf, job.sign, codes, job.scale + b);
      std::memcpy(job.codes + i, codes, static_cast<size_t>(count));
    }
  }
}

void dequantize_range(const Job& job, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * kBlock;
    const int64_t i1 = std::min<int64_t>(i0 + kBlock, job.n);
    const float unit = bits_f32(unit_bits(f32_bits(job.scale_in[b])));
    if (job.sign == kSigned) {
      for (int64_t i = i0; i < i1; ++i) job.y[i] = decode_m(job.codes_in[i], unit);
    } else {
      for (int64_t i = i0; i < i1; ++i) job.y[i] = decode_v(job.codes_in[i], unit);
    }
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

// One Adam/AdamW step with 8-bit moments (the format at the top of this file). m_codes/v_codes:
// n codes each (exp_avg signed e3m4, exp_avg_sq unsigned e4m4); m_scale/v_scale: ceil(n/256)
// scale fields each. Per block: decode, guard, update in fp32, update p with the fp32 moments
// (one division: scalar_q8_adam), then encode the new moments (delayed path, or the exact rule).
// All-zero codes with zero scale fields are a zero state. Non-finite moments poison the block
// (its scale field becomes NaN or inf).
//
// The moment guard: exact Adam keeps |m_t| <= K_t sqrt(v_t), K_t = (1 - beta1) / sqrt(1 - beta2)
// * sqrt(sum_{j<t} (beta1^2 / beta2)^j) (Cauchy-Schwarz over the two sums), so its update never
// exceeds lr * K_t * sqrt(1 - beta2^t) / (1 - beta1^t). A quantized state need not: in a block
// holding large and small moments a small exp_avg_sq can round far down while its exp_avg does
// not, and the update becomes ~ lr * m / eps. Each decoded exp_avg is therefore clamped to
// +-m_bound * sqrt(exp_avg_sq) before the update, m_bound = K_{t-1} (the state is t-1 steps
// old; the host computes it, infinity.ops.adam_compact.moment_bound): a state that exact Adam
// can reach is never changed, any other is brought back inside the set it can reach.
INF_API int inf_adam_step_q8g(float* p, const void* g, int g_dtype, uint8_t* m_codes,
                              float* m_scale, uint8_t* v_codes, float* v_scale, void* out,
                              int out_dtype, int64_t n, double lr, double beta1, double beta2,
                              double eps, double weight_decay, int adamw,
                              double bias_correction1, double bias_correction2_sqrt,
                              double grad_multiplier, double m_bound) {
  if (n < 0) return kErrNegativeLength;
  const int err = check_dtypes(g_dtype, out, out_dtype);
  if (err != kOk) return err;
  if (n == 0) return kOk;
  if (p == nullptr || g == nullptr || m_codes == nullptr || m_scale == nullptr ||
      v_codes == nullptr || v_scale == nullptr) {
    return kErrNullPointer;
  }
  const int cap = inf_cpu_capability();
  g_calls[kKernel8bit][cap].fetch_add(1, std::memory_order_relaxed);
  Job job;
  job.p = p;
  job.g = g;
  job.m = m_codes;
  job.v = v_codes;
  job.m_scale = m_scale;
  job.v_scale = v_scale;
  job.out = out;
  job.n = n;
  job.gsize = dtype_size(g_dtype);
  job.msize = 1;
  job.osize = dtype_size(out_dtype);
  job.c = make_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                      bias_correction2_sqrt, grad_multiplier);
  job.m_bound = static_cast<float>(
      std::min(m_bound, static_cast<double>(std::numeric_limits<float>::max())));
  job.m_bound_sq = job.m_bound * job.m_bound;
  job.q8_step = static_cast<float>(lr / bias_correction1 * bias_correction2_sqrt);
  job.q8_eps = static_cast<float>(eps * bias_correction2_sqrt);
  job.q8_delayed = !(job.c.has_weight_decay && !job.c.adamw);
  job.block = select_block<kKernel8bit>(cap, g_dtype, out_dtype, q8_mode(job.c));
  job.range = &q8_range;
  run_job(job);
  return kOk;
}

INF_API int inf_q8_block_size() { return kBlock; }

// The 256 code values at unit 1.0 indexed by the byte: is_signed != 0 for exp_avg (byte 0x81 is
// -127: -247.0), 0 for exp_avg_sq.
INF_API int inf_q8_code_table(int is_signed, float* out) {
  if (out == nullptr) return kErrNullPointer;
  for (int b = 0; b < kBlock; ++b) {
    const uint8_t byte = static_cast<uint8_t>(b);
    out[b] = is_signed != 0 ? decode_m(byte, 1.0f) : decode_v(byte, 1.0f);
  }
  return kOk;
}

// Block-wise encoding of n fp32 values by the exact rule: scale fields into
// scale[ceil(n/256)], codes into codes[n].
INF_API int inf_q8_quantize(const float* x, int64_t n, int is_signed, uint8_t* codes,
                            float* scale) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return kOk;
  if (x == nullptr || codes == nullptr || scale == nullptr) return kErrNullPointer;
  Job job;
  job.n = n;
  job.x = x;
  job.codes = codes;
  job.scale = scale;
  job.sign = is_signed != 0 ? kSigned : kUnsigned;
  job.quantize = select_quantize(inf_cpu_capability());
  job.range = &quantize_range;
  run_job(job);
  return kOk;
}

// out[i] = decode(codes[i], unit(scale[i / 256])) (the kernel's decoding; the c_max byte of the
// scale field masked off).
INF_API int inf_q8_dequantize(const uint8_t* codes, const float* scale, int64_t n,
                              int is_signed, float* out) {
  if (n < 0) return kErrNegativeLength;
  if (n == 0) return kOk;
  if (codes == nullptr || scale == nullptr || out == nullptr) return kErrNullPointer;
  Job job;
  job.n = n;
  job.codes_in = codes;
  job.scale_in = scale;
  job.y = out;
  job.sign = is_signed != 0 ? kSigned : kUnsigned;
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
