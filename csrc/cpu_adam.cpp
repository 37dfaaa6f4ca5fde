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
#include "adam_common.h"
#include "cpu_adam_threadpool.h"

namespace {

using inf_adam::Capability;
using inf_adam::Coeffs;
using inf_adam::Dtype;
using inf_adam::Error;
using inf_adam::V256;
using inf_adam::V512;
using inf_adam::avx2_adam;
using inf_adam::avx2_load_grad;
using inf_adam::avx2_store_out;
using inf_adam::avx512_adam;
using inf_adam::avx512_load_grad;
using inf_adam::avx512_store_out;
using inf_adam::dtype_size;
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
using inf_adam::kErrCapabilityUnsupported;
using inf_adam::kErrCapabilityInvalid;

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

// ---- scalar kernel ----------------------------------------------------------------------------
template <int GD, int OD, bool NT>
void scalar_chunk(const Job& job, int64_t begin, int64_t end) {
  const Coeffs c = job.c;
  float* __restrict p = job.p;
  float* __restrict m = job.m;
  float* __restrict v = job.v;
  for (int64_t i = begin; i < end; ++i) {
    float mo, vo;
    const float param = scalar_adam(c, scalar_load_grad<GD>(job.g, i), p[i], m[i], v[i], mo, vo);
    m[i] = mo;
    v[i] = vo;
    p[i] = param;
    if constexpr (OD != kNone) scalar_store_out<OD>(job.out, i, param);
  }
}

// ---- AVX-512 kernel ---------------------------------------------------------------------------
template <int GD, int OD, bool MASKED, bool NT>
INF_TARGET_AVX512 inline void avx512_block(const Job& job, const V512& c, int64_t i,
                                           __mmask16 k) {
  float* pp = job.p + i;
  float* mp = job.m + i;
  float* vp = job.v + i;
  const __m512 grad = avx512_load_grad<GD, MASKED>(job.g, i, k);
  const __m512 pi = MASKED ? _mm512_maskz_loadu_ps(k, pp) : _mm512_loadu_ps(pp);
  const __m512 mi = MASKED ? _mm512_maskz_loadu_ps(k, mp) : _mm512_loadu_ps(mp);
  const __m512 vi = MASKED ? _mm512_maskz_loadu_ps(k, vp) : _mm512_loadu_ps(vp);
  __m512 mo, vo;
  const __m512 param = avx512_adam(job.c, c, grad, pi, mi, vi, mo, vo);
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

template <int GD, int OD, bool NT>
INF_TARGET_AVX512 void avx512_chunk(const Job& job, int64_t begin, int64_t end) {
  constexpr int64_t W = 16;
  const V512 c = make_v512(job.c);
  int64_t i = begin;
  if constexpr (NT) {
    // Peel a masked head so the streaming stores of `out` are vector aligned.
    constexpr uintptr_t align = W * dtype_size(OD);
    const uintptr_t addr = reinterpret_cast<uintptr_t>(job.out) + i * dtype_size(OD);
    const int64_t head = std::min<int64_t>(
        end - i, static_cast<int64_t>(((align - addr % align) % align) / dtype_size(OD)));
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
// 8 elements at explicit addresses (the arrays, or padded stack copies for heads and tails).
template <int GD, int OD, bool NT>
INF_TARGET_AVX2 inline void avx2_block(const Coeffs& s, const V256& c, float* pp, const void* gp,
                                       float* mp, float* vp, void* op) {
  __m256 mo, vo;
  const __m256 param = avx2_adam(s, c, avx2_load_grad<GD>(gp), _mm256_loadu_ps(pp),
                                 _mm256_loadu_ps(mp), _mm256_loadu_ps(vp), mo, vo);
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
  constexpr int osize = dtype_size(OD);
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
  job.c = make_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                      bias_correction2_sqrt, grad_multiplier);

  const bool nt = out_dtype != kNone && n >= kStreamingFrom &&
                  reinterpret_cast<uintptr_t>(out) % dtype_size(out_dtype) == 0;
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
