"""``rediss://`` end to end: a TLS-only redis-server with a self-signed CA, every role and
``rolloutpipe run --redis-url rediss://…?ssl_ca_certs=CA`` on it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rolloutpipe.broker.connect import connect, connect_sync
from rolloutpipe.broker.embedded import find_redis_server, free_port
from tests.support.config import EMULATED_FAST, ROOT


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost signed by it."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=rolloutpipe-test-ca", "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=d)  # fmt: skip
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


@pytest.fixture()
def tls_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server listening on TLS only; yields its ``rediss://`` URL (CA given in the query)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: cannot make test certificates")
    binary = find_redis_server()
    certs = make_certs(tmp_path / "tls")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(certs["cert"]),
         "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]),
         "--tls-auth-clients", "no"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}&ssl_cert_reqs=required"
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                out = (proc.stdout.read() if proc.stdout else b"").decode(errors="replace")
                if "tls" in out.lower() or "TLS" in out:
                    pytest.skip(f"{binary} has no TLS support: {out.strip()[-300:]}")
                raise RuntimeError(f"TLS redis-server did not start: {out[-2000:]}")
            try:
                r = redis.Redis.from_url(url, socket_connect_timeout=0.5)
                r.ping()
                r.close()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_rediss_clients_verify_the_server(tls_redis: str, tmp_path: Path) -> None:
    r = connect(tls_redis)
    try:
        assert await r.ping() is True
        assert r.connection_pool.connection_class.__name__ == "SSLConnection"
    finally:
        await r.aclose()
    s = connect_sync(tls_redis)
    assert s.ping() is True
    s.close()
    # a server certificate not signed by the CA we trust is refused (verification is on)
    other = make_certs(tmp_path / "other")
    bad = tls_redis.split("?")[0] + f"?ssl_ca_certs={other['ca']}&ssl_cert_reqs=required"
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        redis.Redis.from_url(bad).ping()
    with pytest.raises(redis.ConnectionError):  # and plain redis:// gets no answer on the TLS port
        redis.Redis.from_url(
            tls_redis.split("?")[0].replace("rediss://", "redis://"), socket_timeout=1
        ).ping()


@pytest.mark.slow
def test_run_end_to_end_over_tls(tls_redis: str, tmp_path: Path) -> None:
    out = tmp_path / "tls-run"
    p = subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", "3", "--out", str(out),
         "--no-progress", "--redis-url", tls_redis, "run=tls", *EMULATED_FAST],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["groups"] == 8 and r["fence_rejections"] == 0 for r in rows)
    r = connect_sync(tls_redis)
    assert r.exists("rp:{tls}:version") and r.get("rp:{tls}:done") == b"1"
    r.close()
    st = subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "status", "--run", "tls", "--redis-url", tls_redis],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert st.returncode == 0 and "version" in st.stdout.lower(), st.stdout + st.stderr
