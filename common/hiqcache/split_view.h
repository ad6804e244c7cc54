// Split TensorViews (docs/design.md TensorView): the field that makes a view split, for the
// client's TensorView (hiqcache/pool_spec.h) and the daemon's ViewSpec (server/core/requests.h),
// which spell the fields alike. Split views are for HOST pools only.
#pragma once

namespace hiqcache {

// "dim_stride_bytes", "dim_run" or "row_group" (the first one set), or nullptr when none is.
template <typename View>
const char* SplitViewField(const View& v) {
  if (v.dim_stride_bytes != 0) return "dim_stride_bytes";
  if (v.dim_run != 0) return "dim_run";
  if (v.row_group != 0) return "row_group";
  return nullptr;
}

}  // namespace hiqcache
