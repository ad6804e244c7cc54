#!/usr/bin/env python3
"""The PyTorch export path on a GPU, with the machine's own torch and the hiqcache package:
a CUDA pool of torch tensors registered with hiqcached --device cuda through hiqcache.Client,
backed up and restored into other rows, compared.

1. The raw handle PyTorch gives (`storage._share_cuda_()[1]`): its length and first two bytes
   (version, type), and hiqcache.torch_ipc.parse_torch_ipc_handle of it (64 bytes).
2. A vLLM-style paged KV tensor [layers][K|V][blocks][block_size][heads][head_dim] (BF16), each
   layer's K and V described with hiqcache.torch_kv.paged_view over cuda_export's handle and
   offsets; ticket slots from hiqcache.torch_kv.CudaTicketSlots; registered (INT8 codec) with a
   daemon this script starts.
3. Backup of random rows (sync), restore (sync) into other blocks: every element within the
   INT8 bound of docs/design.md, rows around them untouched; then an asynchronous restore into a
   third region whose layers a torch stream waits for on their ticket slots (wait_on_stream)
   before comparing them with the synchronous restore on that stream: bit-equal.

Prints `torch export: PASS` or `torch export: FAIL: <why>`; exit 0 / 1, 2 when torch sees no
GPU. Environment: HIQ_DAEMON_PATH (hiqcached), HIQ_DAEMON_LD_LIBRARY_PATH (the daemon's
LD_LIBRARY_PATH), HIQ_GPU_POOL_BYTES (its pool, default 256MiB). hiqcache must be importable
(PYTHONPATH).
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 8, 8, 128, 16, 64
N = 16  # blocks backed up
SRC, DST, ASYNC_DST = 0, 24, 44  # first block of each region


def start_daemon(workdir):
    exe = os.environ.get("HIQ_DAEMON_PATH", "hiqcached")
    sock = os.path.join(workdir, "hiqcached.sock")
    env = dict(os.environ)
    if os.environ.get("HIQ_DAEMON_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["HIQ_DAEMON_LD_LIBRARY_PATH"]
    log = open(os.path.join(workdir, "hiqcached.log"), "wb")
    proc = subprocess.Popen(
        [exe, "--listen", f"unix://{sock}", "--device", "cuda",
         "--pool-bytes", os.environ.get("HIQ_GPU_POOL_BYTES") or "256MiB",
         "--shm-name", f"/hiq-torch-check-{os.getpid()}", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(sock + ".session")  # listens once the daemon serves
            return proc, f"unix://{sock}"
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    proc.kill()
    proc.wait()
    log.close()
    with open(os.path.join(workdir, "hiqcached.log"), "rb") as f:
        text = f.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"hiqcached --device cuda did not start (exit {proc.returncode}): {text}")


def int8_bound_violations(torch, x, xh):
    """Elements of xh (restored) outside docs/design.md's bound around x (original), per head:
    |xh - x| <= (0.5 + 2^-8) * s + 2^-8 * |xh|, s = bf16(max(|x|, 2^-112) / 127)."""
    x, xh = x.float(), xh.float()
    s = (x.abs().amax(dim=-1, keepdim=True).clamp_min(2.0 ** -112) / 127).to(torch.bfloat16).float()
    bound = (0.5 + 2.0 ** -8) * s + 2.0 ** -8 * xh.abs()
    err = (xh - x).abs()
    return int((err > bound).sum()), float(err.max())


def run(torch, hq, torch_kv, torch_ipc, target):
    dev = torch.device("cuda", 0)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), device "
          f"{torch.cuda.get_device_name(0)}; expandable segments: "
          f"{torch_kv.expandable_segments_enabled()}")
    kv = torch.zeros((LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM), dtype=torch.bfloat16, device=dev)
    raw = kv.untyped_storage()._share_cuda_()[1]
    print(f"storage._share_cuda_()[1]: {len(raw)} bytes, first two {bytes(raw[:2])!r} "
          f"(version {raw[0]}, type {chr(raw[1])!r})")
    handle = torch_ipc.parse_torch_ipc_handle(raw)
    print(f"parse_torch_ipc_handle: {len(handle)}-byte cudaIpcMemHandle_t")
    base_handle, _, end = torch_kv.cuda_export(kv)
    if base_handle != handle:
        raise AssertionError("cuda_export's handle differs from the parsed one")

    slots = torch_kv.CudaTicketSlots(LAYERS + 2, 0)
    done = LAYERS + 1
    client = hq.Client(target, call_timeout=30.0)
    try:
        g = hq.Geometry(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        layers = []
        for layer in range(LAYERS):
            views = []
            for plane in range(2):
                t = kv[layer, plane]
                _, offset, _ = torch_kv.cuda_export(t)
                views.append(torch_kv.paged_view(t, 0, offset))
            layers.append(hq.LayerView(k=views[0], v=views[1]))
        spec = hq.PoolSpec(
            model="torch-export-check", geometry=g, block_tokens=BLOCK,
            buffers=(hq.SharedBuffer(size_bytes=end, cuda_ipc_handle=handle),),
            layers=tuple(layers), device=hq.DeviceKind.CUDA,
            cuda_device_uuid=torch_kv.cuda_device_uuid(0), events=slots.spec())
        pool = client.register_pool(spec)
        info = client.pool_info(pool)
        print(f"registered CUDA pool: {info}")

        src = kv[:, :, SRC:SRC + N]
        src.copy_(torch.randn(src.shape, dtype=torch.float32, device=dev).to(torch.bfloat16))
        kv.view(torch.int16)[:, :, DST - 1:].fill_(-1)  # 0xFFFF around and in the destinations
        torch.cuda.synchronize()

        def rows(first_block):
            return [(first_block + b) * BLOCK + t for b in range(N) for t in range(BLOCK)]

        keys = hq.compute_block_keys(list(range(N * BLOCK)), BLOCK, salt=f"torch-{os.getpid()}")
        t0 = time.perf_counter()
        b = client.backup(pool, keys, rows(SRC))
        print(f"backup: {b.held}/{N} blocks held, ticket {b.ticket}, {b.status} "
              f"({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        if not b.status.ok or b.held != N:
            raise AssertionError(f"backup: {b.status}, {b.held} of {N} blocks")
        t0 = time.perf_counter()
        r = client.restore(pool, keys, rows(DST))
        print(f"restore (sync): {r.restored_blocks}/{N} blocks, ticket {r.ticket}, {r.status} "
              f"({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        if not r.status.ok or r.restored_blocks != N:
            raise AssertionError(f"restore: {r.status}, {r.restored_blocks} of {N} blocks")
        torch.cuda.synchronize()
        restored = kv[:, :, DST:DST + N]
        bad, max_err = int8_bound_violations(torch, src, restored)
        untouched = kv.view(torch.int16)[:, :, DST - 1]
        around = kv.view(torch.int16)[:, :, DST + N:ASYNC_DST]
        print(f"compare: {restored.numel()} elements, {bad} outside the INT8 bound, max |err| "
              f"{max_err:.4g}; rows before and after the destination untouched: "
              f"{bool((untouched == -1).all())}, {bool((around == -1).all())}")
        if bad or not (untouched == -1).all() or not (around == -1).all():
            raise AssertionError("the restored rows differ from the backed-up rows")

        # Asynchronous restore; a torch stream waits for each layer's ticket slot and compares
        # the layer with the synchronous restore behind that wait.
        stream = torch.cuda.Stream(dev)
        r = client.restore(pool, keys, rows(ASYNC_DST), layer_event_base=0, done_event=done,
                           sync=False)
        if not r.status.ok or r.restored_blocks != N:
            raise AssertionError(f"async restore: {r.status}, {r.restored_blocks} of {N} blocks")
        start, first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        diffs = []
        with torch.cuda.stream(stream):
            start.record(stream)
            for layer in range(LAYERS):
                slots.wait_on_stream(layer, r.ticket, stream)
                if layer == 0:
                    first.record(stream)
                a = kv[layer, :, ASYNC_DST:ASYNC_DST + N].view(torch.int16)
                diffs.append((a != kv[layer, :, DST:DST + N].view(torch.int16)).sum())
        wait = slots.wait(done, r.ticket, 20.0)
        stream.synchronize()
        differ = int(torch.stack(diffs).sum())
        print(f"restore (async): ticket {r.ticket}, done slot {slots.read(done)} ({wait}); "
              f"layer slots {[slots.read(i) for i in range(LAYERS)]}; elements differing from "
              f"the sync restore: {differ}; layer 0 on the stream {start.elapsed_time(first):.3f} "
              f"ms after the wait was enqueued")
        if not wait.ok or differ:
            raise AssertionError("the asynchronous restore differs or did not complete")
        s = client.release_pool(pool)
        if not s.ok:
            raise AssertionError(f"release_pool: {s}")
    finally:
        client.close()
        slots.close()


def main():
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - reported, not raised
        print(f"torch export: FAIL: import torch: {err}")
        return 1
    if not torch.cuda.is_available():
        print(f"torch export: no GPU: torch {torch.__version__} sees no CUDA device")
        return 2
    try:
        import hiqcache as hq
        from hiqcache import torch_ipc, torch_kv
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        print(f"torch export: FAIL: import hiqcache: {err!r}")
        return 1
    print(f"hiqcache from {os.path.dirname(hq.__file__)}")
    workdir = tempfile.mkdtemp(prefix="hiq-torch-check-")
    proc = None
    try:
        proc, target = start_daemon(workdir)
        run(torch, hq, torch_kv, torch_ipc, target)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        print(f"torch export: FAIL: {err!r}")
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log = os.path.join(workdir, "hiqcached.log")
            if os.path.getsize(log):
                with open(log, "rb") as f:
                    print("hiqcached log:\n" + f.read().decode(errors="replace")[-3000:])
        try:
            os.unlink(f"/dev/shm/hiq-torch-check-{os.getpid()}")
        except OSError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)
    print("torch export: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
