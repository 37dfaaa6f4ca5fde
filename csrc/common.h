// Shared definitions for the native core. No Python or torch headers anywhere in csrc/.
#pragma once
#include <cstddef>
#include <cstdint>

#define INF_API extern "C" __attribute__((visibility("default")))

// Version of the C ABI; infinity/_native checks it so a stale build is reported, not misused.
#define INF_ABI_VERSION 1

// Shared by the CPU kernels (cpu_adam.cpp defines them; cpu_adam_compact.cpp uses them).
INF_API int inf_cpu_capability();   // the path the kernels run now: 0 scalar, 1 avx2, 2 avx512
INF_API int inf_get_num_threads();  // threads the kernels use (inf_set_num_threads)
namespace inf_cpu {
// Runs fn(ctx, 0..ntasks-1) on the worker pool of the CPU Adam kernels; returns when all are done.
void run_on_pool(int ntasks, void (*fn)(void* ctx, int task), void* ctx);
}  // namespace inf_cpu
