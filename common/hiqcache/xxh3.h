// XXH3, through libxxhash's runtime dispatch where the library has it (the x86 builds of
// xxHash >= 0.8.1 export XXH3_*_dispatch: AVX-512, AVX2 or SSE2 picked for this CPU at the first
// call). Debian's libxxhash otherwise runs its SSE2 code: 19 GB/s against 44.5 through the
// dispatch on the Zen 4 VM, single thread, 1 MiB in L2, and a backup hashes every payload it
// writes. Same digests whatever the vector code (xxHash's guarantee; the tests compare the
// daemon's checksums with the plain functions'). Include this instead of <xxhash.h>.
#pragma once

#include <xxhash.h>

#if HIQ_XXH_DISPATCH
// Replaces XXH3_64bits, XXH3_64bits_update, XXH3_128bits, ... by their dispatching versions.
#include <xxh_x86dispatch.h>
#endif
