"""A TCP listener other nodes can reach is served over TLS or not at all (the daemon refuses to
start with one and no certificate); hiqcache.Client reaches it with the CA's roots, and neither a
plain client nor one trusting another CA gets an answer. A caller over TCP is anonymous: it sees
the totals, no namespace and no pool."""

from __future__ import annotations

import socket
import subprocess

import pytest

import hiqcache as hq
from daemon import Daemon
from margins import margin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ca(d, name: str) -> tuple[str, str]:
    key, pem = str(d / f"{name}.key"), str(d / f"{name}.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", pem,
                    "-days", "1", "-subj", f"/CN={name}"], check=True, capture_output=True)
    return key, pem


def make_server_cert(d, ca_key: str, ca_pem: str) -> tuple[str, str]:
    key, csr, pem = str(d / "srv.key"), str(d / "srv.csr"), str(d / "srv.pem")
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca_pem, "-CAkey", ca_key,
                    "-CAcreateserial", "-out", pem, "-days", "1", "-extfile", str(ext)],
                   check=True, capture_output=True)
    return key, pem


def test_a_reachable_tcp_listener_needs_tls_and_serves_only_tls(tmp_path):
    port = free_port()
    plain = Daemon(extra=("--listen", f"0.0.0.0:{port}", "--prefault", "false"))
    try:
        with pytest.raises(RuntimeError, match="only over TLS"):
            plain.start()
    finally:
        plain.close()

    ca_key, ca_pem = make_ca(tmp_path, "hiq-test-ca")
    srv_key, srv_pem = make_server_cert(tmp_path, ca_key, ca_pem)
    _, other_ca = make_ca(tmp_path, "another-ca")
    tcp = f"127.0.0.1:{port}"
    with Daemon(extra=("--listen", f"0.0.0.0:{port}", "--tls-cert-file", srv_pem,
                       "--tls-key-file", srv_key, "--prefault", "false")) as d:
        # A registered pool on the unix socket, so there is something a stranger must not see.
        g = hq.Geometry(num_layers=2, num_kv_heads=2, head_dim=64)
        shm = hq.HostShm.create_memfd("tls-kv", 2 * 2 * hq.slot_major_bytes(g, 64))
        plane = hq.slot_major_bytes(g, 64)
        layers = tuple(hq.LayerView(k=hq.slot_major_view(g, 64, 0, 2 * l * plane),
                                    v=hq.slot_major_view(g, 64, 0, (2 * l + 1) * plane))
                       for l in range(2))
        with hq.Client(d.target, call_timeout=margin(10)) as owner:
            owner.register_pool(hq.PoolSpec(model="private-model", geometry=g, block_tokens=16,
                                            buffers=(shm.shared_buffer(),), layers=layers))
            with hq.Client(tcp, tls_ca_file=ca_pem, call_timeout=margin(10)) as c:
                stats = c.get_stats()
                assert stats.pool_bytes > 0 and stats.caller_uid == 0 and not stats.caller_admin
                assert stats.namespaces == [] and stats.pools == [] and stats.namespaces_total == 0
            assert any(n.model == "private-model" for n in owner.get_stats().namespaces)
        # A plain client, one trusting another CA, and one whose CA file cannot be read (no
        # exception: every call is a miss).
        for client in (hq.Client(tcp, call_timeout=1.0),
                       hq.Client(tcp, call_timeout=1.0, tls_ca_file=other_ca),
                       hq.Client(tcp, call_timeout=1.0, tls_ca_file=str(tmp_path / "absent"))):
            with client, pytest.raises(hq.HiqError) as err:
                client.get_stats()
            assert err.value.status.code == hq.StatusCode.UNAVAILABLE, err.value.status
        shm.close()
