// CRC32C (Castagnoli) by carry-less multiplication: AVX-512 VPCLMULQDQ folding.
//
// The crc32 instruction (SSE4.2, the path in aio_crc32c.cpp) retires 8 bytes per cycle at best,
// ~15 GB/s on the test VM's EPYC: on a 2-core machine the checksums of every swap read and write
// took ~0.25 s of CPU per training step that the model's compute needed. Folding carries four
// 512-bit accumulators 256 bytes ahead per iteration with vpclmulqdq, at memory speed.
//
// The math, in the reflected bit order of CRC32C (bit i of a little-endian 128-bit lane holds
// the coefficient of x^(127-i) relative to the lane's end): moving a lane L forward by D bits
// multiplies it by x^D modulo P. With L = H * x^64 + Lo (H: the lane's low qword in reflected
// order), L * x^D == H * (x^(D+64) mod P) + Lo * (x^D mod P); both products are 64 x 33 bits
// and fit in a lane. A carry-less product of reflected operands comes out shifted by one bit,
// which the constants absorb: the constant for the low qword is k(D + 32) and for the high one
// k(D - 32), with k(e) = reflect32(x^e mod P) << 1 (the exponents were found by checking the
// fold against the bitwise CRC; tests/unit/io/test_io.py checks this path against the table).
// The constants are computed at first use.
//
// After folding, the remaining 128-bit lane R is congruent, modulo P, to everything folded so
// far (the initial CRC XORed into its first 32 bits): the CRC state equals the crc32 of the 16
// bytes of R from 0, which two crc32q instructions compute. The tail (< 256 bytes) continues
// with crc32q. No Python or torch headers.
#include "aio_crc32c.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics (zero-extension, broadcast) build on _mm512_undefined_*:
// harmless, but -Wmaybe-uninitialized reports it inside the header
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define INF_HAVE_FOLD_PATH 1
#endif

namespace {

uint64_t xpow_mod_p(unsigned e) {  // x^e mod P (P = x^32 + 0x1EDC6F41), normal bit order
  uint64_t r = 1;
  for (unsigned i = 0; i < e; ++i) {
    r <<= 1;
    if (r & (1ull << 32)) r ^= (1ull << 32) | 0x1EDC6F41ull;
  }
  return r;
}

uint64_t reflect32(uint64_t v) {
  uint64_t r = 0;
  for (int i = 0; i < 32; ++i)
    if (v & (1ull << i)) r |= 1ull << (31 - i);
  return r;
}

uint64_t k_of(unsigned e) { return reflect32(xpow_mod_p(e)) << 1; }

struct FoldConstants {
  uint64_t d2048_lo, d2048_hi;  // 256 bytes: the main loop
  uint64_t d512_lo, d512_hi;    // 64 bytes: one accumulator into the next
  uint64_t d384_lo, d384_hi, d256_lo, d256_hi, d128_lo, d128_hi;  // lanes into the last
};

const FoldConstants& constants() {
  static const FoldConstants c = [] {
    FoldConstants k;
    k.d2048_lo = k_of(2048 + 32);
    k.d2048_hi = k_of(2048 - 32);
    k.d512_lo = k_of(512 + 32);
    k.d512_hi = k_of(512 - 32);
    k.d384_lo = k_of(384 + 32);
    k.d384_hi = k_of(384 - 32);
    k.d256_lo = k_of(256 + 32);
    k.d256_hi = k_of(256 - 32);
    k.d128_lo = k_of(128 + 32);
    k.d128_hi = k_of(128 - 32);
    return k;
  }();
  return c;
}

#ifdef INF_HAVE_FOLD_PATH
#define INF_FOLD_TARGET \
  __attribute__((target("avx512f,avx512vl,avx512bw,vpclmulqdq,pclmul,sse4.2")))

INF_FOLD_TARGET inline __m512i fold512(__m512i x, __m512i k, __m512i data) {
  __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
  __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, data, 0x96);  // lo ^ hi ^ data
}

INF_FOLD_TARGET inline __m128i fold128(__m128i x, uint64_t k_lo, uint64_t k_hi, __m128i data) {
  __m128i k = _mm_set_epi64x(static_cast<long long>(k_hi), static_cast<long long>(k_lo));
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), data);
}

INF_FOLD_TARGET uint32_t crc32c_tail(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(c);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

INF_FOLD_TARGET uint32_t fold_crc(uint32_t crc, const unsigned char* p, size_t n) {
  if (n < 512) return crc32c_tail(crc, p, n);
  const FoldConstants& k = constants();
  __m512i x0 = _mm512_loadu_si512(p);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  p += 256;
  n -= 256;
  const __m512i k2048 = _mm512_broadcast_i32x4(
      _mm_set_epi64x(static_cast<long long>(k.d2048_hi), static_cast<long long>(k.d2048_lo)));
  while (n >= 256) {
    x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
    x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k512 = _mm512_broadcast_i32x4(
      _mm_set_epi64x(static_cast<long long>(k.d512_hi), static_cast<long long>(k.d512_lo)));
  x1 = fold512(x0, k512, x1);
  x2 = fold512(x1, k512, x2);
  x3 = fold512(x2, k512, x3);
  // the four lanes of x3 (lane 0 first in the data) into the last
  __m128i l0 = _mm512_extracti32x4_epi32(x3, 0);
  __m128i l1 = _mm512_extracti32x4_epi32(x3, 1);
  __m128i l2 = _mm512_extracti32x4_epi32(x3, 2);
  __m128i l3 = _mm512_extracti32x4_epi32(x3, 3);
  __m128i r = fold128(l0, k.d384_lo, k.d384_hi, l3);
  r = fold128(l1, k.d256_lo, k.d256_hi, r);
  r = fold128(l2, k.d128_lo, k.d128_hi, r);
  unsigned char lane[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lane), r);
  return crc32c_tail(crc32c_tail(0, lane, 16), p, n);
}
#endif

}  // namespace

// Whether this CPU runs the folding path.
bool inf_crc_fold_supported() {
#ifdef INF_HAVE_FOLD_PATH
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
  }();
  return supported;
#else
  return false;
#endif
}

// The CRC32C state ``crc`` (not inverted) advanced over ``n`` bytes; callers check
// inf_crc_fold_supported() first.
uint32_t inf_crc_fold(uint32_t crc, const unsigned char* p, size_t n) {
#ifdef INF_HAVE_FOLD_PATH
  return fold_crc(crc, p, n);
#else
  (void)p;
  (void)n;
  return crc;
#endif
}
