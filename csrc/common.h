// Shared definitions for the native core. No Python or torch headers anywhere in csrc/.
#pragma once
#include <cstddef>
#include <cstdint>

#define INF_API extern "C" __attribute__((visibility("default")))

// Version of the C ABI; infinity/_native checks it so a stale build is reported, not misused.
#define INF_ABI_VERSION 1
