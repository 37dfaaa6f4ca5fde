// Block-wise quantization from "pieces": the input of one quantized run (a segment of a frozen
// flat) given as consecutive pieces, each a source tensor (fp32, bf16 or fp16) of `total`
// elements of which the first `valid` are read and the rest count as zeros (the gaps and the
// padding of a flat). A quantization block never spans two pieces: every piece but the last
// holds a whole number of blocks. Shared by csrc/nf4.cpp and csrc/int8_block.cpp.
//
// Each block is handed to the format's kernel as fp32: straight from the source when it is a
// whole fp32 block, else widened (bf16 / fp16 -> fp32 is exact) into a per-task buffer of one
// block, zeros past `valid`. Threads split the blocks; the ISA of the widening follows the
// kernel's (inf_cpu_capability()). No Python or torch headers.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "adam_common.h"
#include "common.h"

namespace inf_quant {

using inf_adam::kAVX2;
using inf_adam::kAVX512;
using inf_adam::kBF16;
using inf_adam::kF16;
using inf_adam::kF32;
using inf_adam::kScalar;

// ---- a block's absmax, shared by the formats' kernels ------------------------------------
// max |x| over `count` elements and whether any is NaN (then `mx` is not meaningful: the
// formats store NaN / a NaN-proof scale for such a block).
struct BlockMax {
  float mx;
  bool nan;
};

inline BlockMax block_max_scalar(const float* x, int64_t count) {
  BlockMax m{0.f, false};
  for (int64_t i = 0; i < count; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) {
      m.nan = true;
    } else if (a > m.mx) {
      m.mx = a;
    }
  }
  return m;
}

INF_TARGET_AVX2 inline BlockMax block_max_avx2(const float* x, int64_t count) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  __m256 vnan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));  // wrong lanes only with a NaN
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  BlockMax m{0.f, _mm256_movemask_ps(vnan) != 0};
  for (float a : lanes) m.mx = a > m.mx ? a : m.mx;
  const BlockMax tail = block_max_scalar(x + i, count - i);
  m.nan = m.nan || tail.nan;
  m.mx = tail.mx > m.mx ? tail.mx : m.mx;
  return m;
}

INF_TARGET_AVX512 inline BlockMax block_max_avx512(const float* x, int64_t count) {
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 vnan = 0;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));  // wrong lanes only with a NaN
  }
  if (i < count) {
    const __mmask16 k = static_cast<__mmask16>((1u << (count - i)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  return BlockMax{_mm512_reduce_max_ps(vmax), vnan != 0};
}

constexpr int kOk = 0;
constexpr int kErrNull = -1;
constexpr int kErrDtype = -2;
constexpr int kErrLength = -4;
constexpr int kErrBlocksize = -7;
constexpr int kErrPieces = -8;

struct Pieces {
  const void* const* src = nullptr;
  const int32_t* dtype = nullptr;
  const int64_t* valid = nullptr;
  const int64_t* total = nullptr;
  int64_t count = 0;
  std::vector<int64_t> start;  // first element of each piece, and the sum at the end
};

// Checks the pieces (see the header comment) and fills p.start; kOk or an error code.
inline int check_pieces(Pieces& p, int64_t blocksize) {
  if (p.count < 0) return kErrLength;
  if (p.count > 0 && (p.src == nullptr || p.dtype == nullptr || p.valid == nullptr ||
                      p.total == nullptr)) {
    return kErrNull;
  }
  p.start.assign(static_cast<size_t>(p.count) + 1, 0);
  for (int64_t k = 0; k < p.count; ++k) {
    const int d = p.dtype[k];
    if (d != kF32 && d != kBF16 && d != kF16) return kErrDtype;
    if (p.total[k] < 0 || p.valid[k] < 0 || p.valid[k] > p.total[k]) return kErrLength;
    if (k + 1 < p.count && p.total[k] % blocksize != 0) return kErrPieces;
    if (p.valid[k] > 0 && p.src[k] == nullptr) return kErrNull;
    p.start[k + 1] = p.start[k] + p.total[k];
  }
  return kOk;
}

// Widens `n` elements of `src` (dtype d) from element i into dst (fp32).
template <int D>
inline void widen_scalar(const void* src, int64_t i, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (D == kF32) {
      dst[j] = static_cast<const float*>(src)[i + j];
    } else if constexpr (D == kBF16) {
      dst[j] = inf_adam::bf16_to_f32(static_cast<const uint16_t*>(src)[i + j]);
    } else {
      dst[j] = inf_adam::f16_to_f32(static_cast<const uint16_t*>(src)[i + j]);
    }
  }
}

template <int D>
INF_TARGET_AVX2 inline void widen_avx2(const void* src, int64_t i, int64_t n, float* dst) {
  const int elem = D == kF32 ? 4 : 2;
  const char* base = static_cast<const char*>(src) + i * elem;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, inf_adam::avx2_load_grad<D>(base + j * elem));
  widen_scalar<D>(src, i + j, n - j, dst + j);
}

template <int D>
INF_TARGET_AVX512 inline void widen_avx512(const void* src, int64_t i, int64_t n, float* dst) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    _mm512_storeu_ps(dst + j, inf_adam::avx512_load_grad<D, false>(src, i + j, 0));
  }
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm512_mask_storeu_ps(dst + j, k, inf_adam::avx512_load_grad<D, true>(src, i + j, k));
  }
}

inline void widen(int cap, int dtype, const void* src, int64_t i, int64_t n, float* dst) {
  if (n <= 0) return;
  if (cap == kAVX512) {
    if (dtype == kF32) widen_avx512<kF32>(src, i, n, dst);
    else if (dtype == kBF16) widen_avx512<kBF16>(src, i, n, dst);
    else widen_avx512<kF16>(src, i, n, dst);
  } else if (cap == kAVX2) {
    if (dtype == kF32) widen_avx2<kF32>(src, i, n, dst);
    else if (dtype == kBF16) widen_avx2<kBF16>(src, i, n, dst);
    else widen_avx2<kF16>(src, i, n, dst);
  } else {
    if (dtype == kF32) widen_scalar<kF32>(src, i, n, dst);
    else if (dtype == kBF16) widen_scalar<kBF16>(src, i, n, dst);
    else widen_scalar<kF16>(src, i, n, dst);
  }
}

// The kernel of one block: (fp32 values x[0 .. count), global block index b, first element i0).
using BlockFn = void (*)(void* ctx, const float* x, int64_t count, int64_t b, int64_t i0);

struct Run {
  const Pieces* pieces = nullptr;
  int64_t blocksize = 0;
  int cap = kScalar;
  BlockFn fn = nullptr;
  void* ctx = nullptr;
  std::vector<int64_t> bounds;  // task t: blocks [bounds[t], bounds[t+1])
};

inline void run_blocks(const Run& r, int64_t b0, int64_t b1) {
  const Pieces& p = *r.pieces;
  const int64_t bs = r.blocksize;
  std::vector<float> tmp;
  int64_t k = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * bs;
    while (p.start[k + 1] <= i0) ++k;  // pieces never split a block
    const int64_t local = i0 - p.start[k];
    const int64_t count = std::min(bs, p.total[k] - local);
    const int64_t valid = std::max<int64_t>(0, std::min(count, p.valid[k] - local));
    if (p.dtype[k] == kF32 && valid == count) {
      r.fn(r.ctx, static_cast<const float*>(p.src[k]) + local, count, b, i0);
      continue;
    }
    if (tmp.empty()) tmp.resize(static_cast<size_t>(bs));
    widen(r.cap, p.dtype[k], p.src[k], local, valid, tmp.data());
    std::fill(tmp.begin() + valid, tmp.begin() + count, 0.f);
    r.fn(r.ctx, tmp.data(), count, b, i0);
  }
}

// Runs fn over every block of the pieces, threaded when there are at least 2^18 elements.
inline void run(const Pieces& p, int64_t blocksize, int cap, BlockFn fn, void* ctx) {
  const int64_t n = p.start.back();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  if (blocks == 0) return;
  Run r;
  r.pieces = &p;
  r.blocksize = blocksize;
  r.cap = cap;
  r.fn = fn;
  r.ctx = ctx;
  int64_t tasks = n >= (1 << 18) ? std::max(1, inf_get_num_threads()) : 1;
  tasks = std::min<int64_t>(tasks, blocks);
  if (tasks <= 1) {
    run_blocks(r, 0, blocks);
    return;
  }
  r.bounds.resize(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) r.bounds[t] = blocks * t / tasks;
  inf_cpu::run_on_pool(
      static_cast<int>(tasks),
      [](void* c, int t) {
        const Run& x = *static_cast<const Run*>(c);
        run_blocks(x, x.bounds[t], x.bounds[t + 1]);
      },
      &r);
}

}  // namespace inf_quant
