#!/usr/bin/env python3
"""How long cudaHostRegister takes per GiB on this machine: what hiqcached pays at start to
page-lock its pool (docs/design.md "Pool and durability": pre-faulted, then registered in
chunks), and what a CudaTicketSlots or an engine's host buffer pays.

For each size (default 1 and 4 GiB): a memfd of that size, mapped shared; first registered
untouched (the driver faults the pages in), then unregistered, written (every page faulted) and
registered again (the daemon's order), each timed. Prints one line per measurement and
`RESULT host_register_s_per_gib_<case>_<n>gib=<s>` lines. Exit 0 when every registration
succeeded, 1 otherwise (the CUDA error is printed), 2 without a usable device.

Environment: HIQ_CUDART, the libcudart to load (default: libcudart.so.13, then libcudart.so,
from the loader's path). Usage: host_register_probe.py [GiB ...]
"""
import ctypes
import mmap
import os
import sys
import time

GIB = 1 << 30
CUDA_HOST_REGISTER_PORTABLE = 0x1
CUDA_HOST_REGISTER_MAPPED = 0x2
PROT_READ, PROT_WRITE, MAP_SHARED = 0x1, 0x2, 0x01


def load_cudart():
    names = [os.environ["HIQ_CUDART"]] if os.environ.get("HIQ_CUDART") else []
    names += ["libcudart.so.13", "libcudart.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as err:
            errors.append(f"{name}: {err}")
    raise OSError("; ".join(errors))


def main(argv):
    sizes = [float(a) for a in argv[1:]] or [1.0, 4.0]
    try:
        rt = load_cudart()
    except OSError as err:
        print(f"host_register_probe: no CUDA runtime: {err}")
        return 2
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]

    def err_text(rc):
        return rt.cudaGetErrorString(rc).decode(errors="replace")

    count = ctypes.c_int(0)
    rc = rt.cudaGetDeviceCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        print(f"host_register_probe: no usable CUDA device (cudaGetDeviceCount rc={rc}: "
              f"{err_text(rc)}, {count.value} devices)")
        return 2
    rc = rt.cudaSetDevice(0) or rt.cudaFree(None)  # the context, outside the timings
    if rc != 0:
        print(f"host_register_probe: cudaSetDevice/cudaFree: {err_text(rc)}")
        return 1

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ok = True
    for gib in sizes:
        size = int(gib * GIB) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create(f"hiq-host-register-{gib:g}gib", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            addr = libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                print(f"host_register_probe: mmap of {gib:g} GiB failed: "
                      f"{os.strerror(ctypes.get_errno())}")
                ok = False
                continue
            flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
            for case in ("untouched", "prefaulted"):
                if case == "prefaulted":
                    t0 = time.perf_counter()
                    ctypes.memset(addr, 1, size)
                    print(f"fault in {gib:g} GiB (memset): {time.perf_counter() - t0:.3f} s")
                t0 = time.perf_counter()
                rc = rt.cudaHostRegister(addr, size, flags)
                reg_s = time.perf_counter() - t0
                if rc != 0:
                    print(f"cudaHostRegister of {gib:g} GiB ({case}) failed after "
                          f"{reg_s:.3f} s: {err_text(rc)}")
                    ok = False
                    break
                t0 = time.perf_counter()
                rc = rt.cudaHostUnregister(addr)
                unreg_s = time.perf_counter() - t0
                if rc != 0:
                    print(f"cudaHostUnregister of {gib:g} GiB failed: {err_text(rc)}")
                    ok = False
                print(f"cudaHostRegister {gib:g} GiB memfd, {case}: {reg_s:.3f} s "
                      f"({reg_s / gib:.3f} s/GiB); cudaHostUnregister {unreg_s:.3f} s")
                print(f"RESULT host_register_s_per_gib_{case}_{gib:g}gib={reg_s / gib:.4f}")
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
