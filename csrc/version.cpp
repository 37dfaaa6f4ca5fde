#include "common.h"

INF_API int inf_abi_version(void) { return INF_ABI_VERSION; }
