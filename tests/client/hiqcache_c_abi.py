"""ctypes mirrors of the structs of client/include/hiqcache/hiqcache_c.h (ABI version 4), shared
by the C ABI's smoke test and the Python tests that drive libhiqcache.so (tests/python/c_client.py).
A change of the header's structs changes these in the same commit."""

import ctypes as C


class Geometry(C.Structure):
    _fields_ = [("num_layers", C.c_uint32), ("num_kv_heads", C.c_uint32),
                ("head_dim", C.c_uint32), ("dtype", C.c_uint32), ("attention", C.c_uint32),
                ("tp_rank", C.c_uint32), ("tp_size", C.c_uint32)]


class Buffer(C.Structure):
    _fields_ = [("host_shm_name", C.c_char_p), ("cuda_ipc_handle", C.c_void_p),
                ("cuda_ipc_handle_len", C.c_uint32), ("reserved", C.c_uint32),
                ("size_bytes", C.c_uint64)]


class TensorView(C.Structure):
    _fields_ = [("buffer", C.c_uint32), ("num_rows", C.c_uint32), ("offset_bytes", C.c_uint64),
                ("row_stride_bytes", C.c_uint64), ("head_stride_bytes", C.c_uint64),
                ("page_rows", C.c_uint64), ("page_stride_bytes", C.c_uint64),
                ("row_group", C.c_uint32), ("dim_run", C.c_uint32),
                ("row_group_stride_bytes", C.c_uint64), ("dim_run_stride_bytes", C.c_uint64),
                ("dim_stride_bytes", C.c_uint64)]


class LayerView(C.Structure):
    _fields_ = [("k", TensorView), ("v", TensorView), ("has_v", C.c_uint32),
                ("reserved", C.c_uint32)]


class PoolDesc(C.Structure):
    _fields_ = [("model", C.c_char_p), ("tenant", C.c_char_p), ("geometry", Geometry),
                ("block_tokens", C.c_uint32), ("codec", C.c_uint32), ("device_kind", C.c_uint32),
                ("num_buffers", C.c_uint32), ("cuda_device_uuid", C.c_char_p),
                ("buffers", C.POINTER(Buffer)), ("layers", C.POINTER(LayerView)),
                ("event_shm_name", C.c_char_p), ("event_count", C.c_uint32),
                ("reserved_events", C.c_uint32), ("cuda_slots", C.c_void_p)]


class PoolInfo(C.Structure):
    _fields_ = [("pool_id", C.c_uint64), ("encoded_bytes_per_token", C.c_uint64),
                ("block_bytes", C.c_uint64), ("capacity_tokens", C.c_uint64),
                ("namespace_id", C.c_char * 72)]


class Stats(C.Structure):
    _fields_ = [("pool_bytes", C.c_uint64), ("used_bytes", C.c_uint64),
                ("capacity_bytes", C.c_uint64), ("blocks", C.c_uint64), ("clients", C.c_uint64),
                ("uptime_seconds", C.c_uint64), ("num_namespaces", C.c_uint32),
                ("num_pools", C.c_uint32), ("device", C.c_char * 16)]
