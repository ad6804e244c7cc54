"""The committed gRPC stubs (python/hiqcache/v1) are exactly what the pinned grpcio-tools
generates from proto/hiqcache/v1/cache.proto: a contract change cannot leave them behind."""

import filecmp
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[3]
FILES = ("cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py")


def test_stubs_match_the_proto():
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                        f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
                        str(ROOT / "proto" / "hiqcache" / "v1" / "cache.proto")], check=True)
        for name in FILES:
            committed = ROOT / "python" / "hiqcache" / "v1" / name
            generated = pathlib.Path(out) / "hiqcache" / "v1" / name
            assert filecmp.cmp(committed, generated, shallow=False), (
                f"{committed} differs from the proto: run python/gen_stubs.sh")
