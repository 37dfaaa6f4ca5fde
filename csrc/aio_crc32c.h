// CRC32C for the native core (aio_crc32c.cpp: table and SSE4.2 paths, combination;
// crc32c_fold.cpp: VPCLMULQDQ folding). Internal to the library. No Python or torch headers.
#pragma once
#include <cstddef>
#include <cstdint>

// crc32c_fold.cpp: whether this CPU runs the folding path, and the CRC32C state ``crc`` (not
// inverted) advanced over ``n`` bytes by it.
bool inf_crc_fold_supported();
uint32_t inf_crc_fold(uint32_t crc, const unsigned char* p, size_t n);

namespace inf_aio {

// CRC32C (seed 0) of nbytes at data, on the fastest path (inf_crc_crc32c).
uint32_t crc32c_bytes(const void* data, uint64_t nbytes);

// crc32c(A || B) from crc32c(A), crc32c(B) and |B|.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace inf_aio
