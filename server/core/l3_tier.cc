#include "core/l3_tier.h"

namespace hiqcache::server {

const uint8_t* L3Block::payload() const {
  return reinterpret_cast<const uint8_t*>(value.data()) + payload_offset;
}

bool L3Available() {
#ifdef HIQ_HAVE_L3
  return true;
#else
  return false;
#endif
}

}  // namespace hiqcache::server
