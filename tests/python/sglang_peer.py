"""An SGLang engine process of its own for test_sglang_storage.py: builds real host pools (shm
allocator) and the hiqcache backend through SGLang's StorageBackendFactory, then sets or gets
pages. Prints one JSON line per job on stdout.

  sglang_peer.py JSON
      {"target": ..., "uid": optional uid to run as, "jobs": [{"mode": "set" | "get",
       "mla": bool, "layout": ..., "codec": ..., "prompt": ..., "pages": n, "seed": s}]}
  set: fills n pages with sglang_kv.page_data(seed) and backs them up (batch_set_v1); reports
       {"stored": [bool]}.
  get: restores the n pages into its own host pool (batch_get_v1) and compares them with
       page_data(seed); reports {"restored": [bool], "exact": pages bit-exact,
       "violations": elements outside the INT8 bound}.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    uid = args.get("uid")
    if uid is not None:  # before anything starts a thread
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    sys.path.insert(0, os.path.dirname(__file__))
    import torch

    from kv_util import int8_violations
    from sglang_kv import (
        SMALL,
        SMALL_MLA,
        Engine,
        bf16_bits,
        extra_config,
        make_backend,
        page_data,
        page_hashes,
    )

    for job in args["jobs"]:
        shape = SMALL_MLA if job["mla"] else SMALL
        engine = Engine(shape, job["layout"])
        backend = make_backend(engine, extra_config(args["target"], job["codec"]))
        n = job["pages"]
        keys = page_hashes(job["prompt"], n)
        data = [page_data(shape, job["seed"], i) for i in range(n)]
        slots = engine.alloc_pages(n)
        if job["mode"] == "set":
            engine.write_pages(slots, data)
            out = {"stored": backend.batch_set_v1(keys, slots)}
        else:
            restored = backend.batch_get_v1(keys, slots)
            back = engine.read_pages(slots, n)
            out = {"restored": restored,
                   "exact": sum(bool(torch.equal(a, b)) for a, b in zip(data, back)),
                   "violations": sum(int8_violations(bf16_bits(a), bf16_bits(b))
                                     for a, b in zip(data, back))}
        backend.close()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
