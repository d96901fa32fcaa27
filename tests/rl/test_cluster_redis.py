"""Redis for a multi-node run: the config refuses a Redis the other nodes cannot reach or that
anyone on the network could use, and a server that keeps no AOF; the embedded server listens on
a non-loopback address with its password (and TLS when configured) when the run is on a
cluster. The single-machine default is untouched."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rl.config.runfile import ConfigError, load_config
from rl.run import launch
from rl.run.launch import LaunchError, RedisTLS, check_external_redis, services, start_redis

SHARED = "output_dir=/mnt/agentrl/runs"  # a cluster run needs an absolute run directory


def error_for(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return info.value


def machine_ip() -> str | None:
    """An IPv4 address of this machine other than loopback, that a server can bind, or None."""
    candidates = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.1", 9))  # a UDP connect picks the route's source; sends nothing
        candidates.append(sock.getsockname()[0])
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        candidates += [info[4][0] for info in infos]
    for ip in candidates:
        if ip.startswith("127.") or ip == "0.0.0.0":
            continue
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind((ip, 0))
            return ip
    return None


@pytest.fixture()
def ip() -> str:
    found = machine_ip()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind a server to")
    return found


def refused_client(**kwargs) -> redis.Redis:
    """A client that fails at once (redis-py's default retries back off for seconds)."""
    return redis.Redis(retry=Retry(NoBackoff(), 0), socket_timeout=5, **kwargs)


def raw_command(host: str, port: int, command: bytes) -> bytes:
    """One inline command over a plain socket, the reply's first line (no client library)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(command + b"\r\n")
        return sock.recv(256).split(b"\r\n")[0]


# --- the config check ------------------------------------------------------------------------


def test_single_machine_default_is_unchanged():
    cfg = load_config(None)
    assert cfg.ray.address == "local" and cfg.redis.url is None and cfg.redis.bind is None
    assert launch.embedded_redis_host(cfg) == "127.0.0.1"
    # on one machine a loopback, passwordless external server is still accepted
    assert load_config(None, ["redis.url=redis://localhost:6379/0"]).redis.url


def test_a_cluster_run_with_the_embedded_redis_passes_the_check():
    cfg = load_config(None, ["ray.address=auto", SHARED])
    assert cfg.redis.url is None
    load_config(None, ["ray.address=10.0.0.10:6379", SHARED, "redis.bind=10.0.0.10"])
    load_config(None, ["ray.address=auto", SHARED, "redis.url=redis://:s3cret@10.0.0.10:6379/0"])
    load_config(
        None, ["ray.address=auto", SHARED, "redis.url=rediss://agentrl:s3cret@redis.internal:6380"]
    )
    load_config(
        None, ["ray.address=auto", SHARED, "redis.url=redis://10.0.0.10:6379/0?password=s3cret"]
    )


@pytest.mark.parametrize(
    ("overrides", "key", "fragments"),
    [
        (
            ["redis.url=redis://:pw@127.0.0.1:6379/0"],
            "redis.url",
            ["points at 127.0.0.1, which only this machine reaches", "remove redis.url"],
        ),
        (["redis.url=redis://:pw@localhost:6379/0"], "redis.url", ["points at localhost"]),
        (["redis.url=redis://:pw@[::1]:6379/0"], "redis.url", ["points at ::1"]),
        (["redis.url=redis://:pw@0.0.0.0:6379/0"], "redis.url", ["points at 0.0.0.0"]),
        (["redis.url=unix:///run/redis.sock"], "redis.url", ["is a unix socket"]),
        (
            ["redis.url=redis://10.0.0.10:6379/0"],
            "redis.url",
            ["has no password", "redis://:PASSWORD@HOST:PORT/0"],
        ),
        (["redis.url=redis://agentrl@10.0.0.10:6379/0"], "redis.url", ["has no password"]),
        (
            ["redis.bind=127.0.0.1"],
            "redis.bind",
            ["127.0.0.1 is loopback-only", "the IP Ray reports for this node"],
        ),
    ],
)
def test_a_cluster_run_refuses_a_loopback_or_passwordless_redis(overrides, key, fragments):
    error = error_for("ray.address=auto", SHARED, *overrides)
    assert error.key == key
    assert "ray.address is 'auto', a cluster" in error.message
    for fragment in fragments:
        assert fragment in error.message


def test_ray_client_with_the_embedded_redis_is_refused():
    error = error_for("ray.address=ray://head:10001", SHARED)
    assert error.key == "redis.url"
    assert "Ray Client" in error.message and "ray job submit" in error.message


def test_embedded_only_settings_with_an_external_url_are_refused():
    error = error_for("redis.url=redis://:pw@10.0.0.10:6379/0", "redis.bind=10.0.0.5")
    assert error.key == "redis.bind" and "url names an existing one" in error.message
    error = error_for("redis.tls_cert_file=/etc/ssl/redis.pem")
    assert error.key == "redis.tls_cert_file" and "all three" in error.message


# --- the embedded server on a cluster --------------------------------------------------------


def test_embedded_redis_on_a_non_loopback_address_needs_its_password(tmp_path, ip):
    server = start_redis(tmp_path / "redis", host=ip)
    try:
        assert server.host == ip and f"@{ip}:{server.port}/0" in server.url
        assert redis.Redis.from_url(server.url).ping()  # as the other nodes connect
        assert raw_command(ip, server.port, b"PING").startswith(b"-NOAUTH")
        with pytest.raises(redis.AuthenticationError):
            refused_client(host=ip, port=server.port, password="wrong").ping()
        with pytest.raises(redis.RedisError):
            refused_client(host=ip, port=server.port).ping()
        assert redis.Redis(host="127.0.0.1", port=server.port, password=server.password).ping()
        conf = (tmp_path / "redis" / "redis.conf").read_text()
        assert f"bind {ip} 127.0.0.1\n" in conf and "appendonly yes\n" in conf
    finally:
        server.stop()


def test_services_on_a_cluster_start_redis_at_the_node_ip(tmp_path, ip, monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "start_ray", lambda cfg, env: calls.append(cfg.address))
    monkeypatch.setattr(launch, "stop_ray", lambda: calls.append("stopped"))
    monkeypatch.setattr(launch, "_node_ip", lambda: ip)  # what Ray reports for this node
    cfg = load_config(None, ["ray.address=auto", SHARED])
    with services(cfg, tmp_path) as svc:
        assert calls == ["auto"]  # Ray joined the cluster before Redis started
        assert f"@{ip}:" in svc.redis_url and svc.redis.ping()
        assert raw_command(ip, urlsplit(svc.redis_url).port, b"PING").startswith(b"-NOAUTH")
    assert calls == ["auto", "stopped"]


def make_cert(directory, ip: str, name: str = "server") -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a self-signed certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"),
            *("-addext", f"subjectAltName=IP:{ip},IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_embedded_redis_serves_tls_when_configured(tmp_path, ip):
    cert, key = make_cert(tmp_path, ip)
    try:
        server = start_redis(tmp_path / "redis", host=ip, tls=RedisTLS(cert, key, cert))
    except LaunchError as exc:
        if "TLS" in str(exc) or "tls" in str(exc):
            pytest.skip(f"this redis-server has no TLS: {str(exc)[:200]}")
        raise
    try:
        assert server.url.startswith("rediss://") and "ssl_ca_certs=" in server.url
        assert redis.Redis.from_url(server.url).ping()  # TLS, verified, with the password
        with pytest.raises(redis.RedisError):  # plain TCP is not served
            refused_client(host=ip, port=server.port, password=server.password).ping()
        other, _ = make_cert(tmp_path, ip, name="stranger")
        with pytest.raises(redis.RedisError):  # the client verifies the server's certificate
            refused_client(
                host=ip, port=server.port, password=server.password, ssl=True, ssl_ca_certs=other
            ).ping()
        with pytest.raises(redis.RedisError):  # and TLS alone does not replace the password
            refused_client(host=ip, port=server.port, ssl=True, ssl_ca_certs=cert).ping()
    finally:
        server.stop()


def test_missing_tls_files_are_named(tmp_path):
    files = {"tls_cert_file": "c.pem", "tls_key_file": "k.pem", "tls_ca_cert_file": "c.pem"}
    cfg = load_config(None, [f"redis.{key}={tmp_path / name}" for key, name in files.items()])
    with pytest.raises(ConfigError, match=r"redis.tls_cert_file: .*c.pem' is not a file"):
        launch.redis_tls(cfg.redis)


# --- an external server's persistence --------------------------------------------------------


def test_an_external_redis_without_aof_is_refused(redis_server):
    client = redis_server.client()
    assert check_external_redis(redis_server.url).ping()  # the embedded server keeps an AOF
    client.config_set("appendonly", "no")
    with pytest.raises(ConfigError) as info:
        check_external_redis(redis_server.url)
    assert info.value.key == "redis.url"
    assert "persists by RDB snapshots only (appendonly no)" in info.value.message
    assert "CONFIG SET appendonly yes" in info.value.message


def test_a_server_that_hides_its_config_is_used_with_a_warning(redis_server, caplog):
    client = redis_server.client()
    client.acl_setuser(  # every command but CONFIG, as some managed services do
        "agentrl", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
    )
    url = f"redis://agentrl:pw@127.0.0.1:{redis_server.port}/0"
    with caplog.at_level(logging.WARNING, logger="rl.run.launch"):
        assert check_external_redis(url).ping()
    assert "could not ask the Redis at 127.0.0.1 whether it keeps an AOF" in caplog.text


def test_an_unreachable_external_redis_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    with pytest.raises(ConfigError, match=r"redis\.url: cannot use the server at 127\.0\.0\.1"):
        check_external_redis(f"redis://:pw@127.0.0.1:{port}/0")


def test_services_check_the_external_redis_before_ray_starts(tmp_path, ip, monkeypatch):
    server = start_redis(tmp_path / "redis", host=ip)
    try:
        server.client().config_set("appendonly", "no")
        calls = []
        monkeypatch.setattr(launch, "start_ray", lambda cfg, env: calls.append("ray"))
        cfg = load_config(None, ["ray.address=auto", SHARED, f"redis.url={server.url}"])
        with pytest.raises(ConfigError, match="appendonly no"), services(cfg, tmp_path / "run"):
            pass
        assert calls == []
    finally:
        server.stop()


def test_a_cluster_run_needs_an_absolute_run_directory():
    error = error_for("ray.address=auto")
    assert error.key == "output_dir"
    assert (
        "relative path 'runs'" in error.message and "output_dir=/mnt/agentrl/runs" in error.message
    )
    assert load_config(None, ["output_dir=runs"]).output_dir == "runs"  # one machine: fine
