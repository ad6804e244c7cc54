/* Compiled as C (C99) into hiqcache_c_test: hiqcache/hiqcache_c.h must stay a valid C header. */
#include "hiqcache/hiqcache_c.h"

int hiq_test_c_header_sizes(void);
int hiq_test_c_header_sizes(void) {
  hiq_pool_desc desc = {0};
  hiq_layer_view layer = {{0}, {0}, 0, 0};
  desc.layers = &layer;
  desc.device_kind = HIQ_DEVICE_HOST;
  /* The ctypes mirrors (tests/client/hiqcache_c_smoke.py) assume these sizes. */
  return (int)(sizeof(hiq_geometry) == 28 && sizeof(hiq_buffer) == 32 &&
               sizeof(hiq_tensor_view) == 80 && sizeof(hiq_layer_view) == 168 &&
               sizeof(hiq_pool_desc) == 112 && sizeof(hiq_pool_info) == 104 &&
               sizeof(hiq_stats) == 72 && desc.layers->has_v == 0);
}
