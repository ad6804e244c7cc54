#!/usr/bin/env bash
# Regenerates the committed gRPC stubs (hiqcache/v1/*) from proto/ with the project venv's
# pinned grpcio-tools; tests/python/package/test_stubs.py fails when they drift from the proto.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${HIQ_VENV:-$root/.venv}/bin/python
cd "$root/python"
"$py" -m grpc_tools.protoc -I"$root/proto" --python_out=. --grpc_python_out=. --pyi_out=. \
  "$root/proto/hiqcache/v1/cache.proto"
