// CRC32C (Castagnoli, reflected 0x82F63B78; crc32c("123456789") == 0xE3069283): slicing-by-8
// tables, the SSE4.2 crc32 instruction, the choice of path (folding in crc32c_fold.cpp) and the
// combination of CRCs of adjacent ranges.
// Convention: crc32c(data, seed) continues a previous value, so
// crc32c(b, crc32c(a, 0)) == crc32c(a + b, 0). SSE4.2 path when the CPU has it (checked once at
// run time; no -march needed), slicing-by-8 tables otherwise.
// No Python or torch headers: plain C ABI, loaded through ctypes.
#include "aio_crc32c.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common.h"

namespace {

struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Crc32cTables& crc_tables() {
  static const Crc32cTables* tables = new Crc32cTables();
  return *tables;
}

uint32_t crc32c_table(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& T = crc_tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = T[7][v & 0xFF] ^ T[6][(v >> 8) & 0xFF] ^ T[5][(v >> 16) & 0xFF] ^
          T[4][(v >> 24) & 0xFF] ^ T[3][(v >> 32) & 0xFF] ^ T[2][(v >> 40) & 0xFF] ^
          T[1][(v >> 48) & 0xFF] ^ T[0][(v >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// GF(2) polynomial arithmetic modulo the (reflected) CRC32C polynomial, to combine CRCs of
// adjacent stripes: raw(A || B, init) == shift(raw(A, init), |B|) ^ raw(B, 0).
uint32_t crc_multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, prod = 0;
  for (;;) {
    if (a & m) {
      prod ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return prod;
}

// x^(8 * nbytes) mod P: multiplying a raw CRC by it appends nbytes zero bytes.
uint32_t crc_shift_constant(uint64_t nbytes) {
  uint32_t x2n[64];
  uint32_t p = 1u << 30;  // x^1
  x2n[0] = p;
  for (int k = 1; k < 64; ++k) x2n[k] = p = crc_multmodp(p, p);
  uint32_t result = 1u << 31;  // x^0
  unsigned k = 3;               // 8 bits per byte
  for (uint64_t n = nbytes; n; n >>= 1, ++k)
    if (n & 1) result = crc_multmodp(x2n[k & 63], result);
  return result;
}

#if defined(__x86_64__) || defined(__i386__)
#define INF_HAVE_SSE42_PATH 1
__attribute__((target("sse4.2"))) uint64_t crc32c_sse42_words(uint64_t c, const unsigned char* p,
                                                               size_t words) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t a;
    std::memcpy(&a, p + 8 * i, 8);
    c = __builtin_ia32_crc32di(c, a);
  }
  return c;
}

// The crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle: three
// independent chains over three stripes keep it busy, then the stripes are combined.
constexpr size_t kCrcStripe = 16384;

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p,
                                                         size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = __builtin_ia32_crc32qi(crc, *p++);
    --n;
  }
  uint64_t c = crc;
  if (n >= 3 * kCrcStripe) {
    static const uint32_t shift = crc_shift_constant(kCrcStripe);
    while (n >= 3 * kCrcStripe) {
      uint64_t c0 = c, c1 = 0, c2 = 0;
      const unsigned char* q = p;
      for (size_t i = 0; i < kCrcStripe; i += 8) {
        uint64_t a, b, d;
        std::memcpy(&a, q + i, 8);
        std::memcpy(&b, q + kCrcStripe + i, 8);
        std::memcpy(&d, q + 2 * kCrcStripe + i, 8);
        c0 = __builtin_ia32_crc32di(c0, a);
        c1 = __builtin_ia32_crc32di(c1, b);
        c2 = __builtin_ia32_crc32di(c2, d);
      }
      uint32_t r = crc_multmodp(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      c = crc_multmodp(shift, r) ^ static_cast<uint32_t>(c2);
      p += 3 * kCrcStripe;
      n -= 3 * kCrcStripe;
    }
  }
  c = crc32c_sse42_words(c, p, n / 8);
  p += n / 8 * 8;
  n %= 8;
  crc = static_cast<uint32_t>(c);
  while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
  return crc;
}
#endif

int crc_impl() {  // 2 folding (VPCLMULQDQ), 1 sse4.2, 0 table
  static int impl = [] {
    const char* env = std::getenv("INFINITY_CRC32C_IMPL");
    if (env && std::strcmp(env, "table") == 0) return 0;
    bool no_fold = env && std::strcmp(env, "sse42") == 0;
    if (!no_fold && inf_crc_fold_supported()) return 2;
#ifdef INF_HAVE_SSE42_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) return 1;
#endif
    return 0;
  }();
  return impl;
}

}  // namespace

// impl: -1 automatic (folding, else SSE4.2, when available; INFINITY_CRC32C_IMPL=table|sse42
// overrides), 0 table, 1 SSE4.2, 2 VPCLMULQDQ folding (each falls back to the next simpler
// path when the CPU lacks it).
INF_API uint32_t inf_crc_crc32c_impl(const void* data, int64_t nbytes, uint32_t seed, int impl) {
  if (data == nullptr || nbytes <= 0) return seed;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = ~seed;
  if (impl < 0) impl = crc_impl();
  if (impl == 2) {
    if (inf_crc_fold_supported()) return ~inf_crc_fold(crc, p, static_cast<size_t>(nbytes));
    impl = 1;
  }
#ifdef INF_HAVE_SSE42_PATH
  if (impl == 1 && __builtin_cpu_supports("sse4.2"))
    return ~crc32c_sse42(crc, p, static_cast<size_t>(nbytes));
#endif
  return ~crc32c_table(crc, p, static_cast<size_t>(nbytes));
}

INF_API uint32_t inf_crc_crc32c(const void* data, int64_t nbytes, uint32_t seed) {
  return inf_crc_crc32c_impl(data, nbytes, seed, -1);
}

// Which path inf_crc_crc32c uses: 2 VPCLMULQDQ folding, 1 SSE4.2, 0 table.
INF_API int inf_crc_impl(void) { return crc_impl(); }

namespace inf_aio {

uint32_t crc32c_bytes(const void* data, uint64_t nbytes) {
  return inf_crc_crc32c(data, static_cast<int64_t>(nbytes), 0);
}

// crc32c(A || B) from crc32c(A), crc32c(B) and |B| (the identity zlib's crc32_combine uses).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc_multmodp(crc_shift_constant(len_b), crc_a) ^ crc_b;
}

}  // namespace inf_aio

