"""The run file's checks for a multi-node run (ray.address other than "local"): every node must
reach the run's Redis, over the network, so it may not be loopback-only or passwordless.

`cluster_redis_error` is called by RunConfig's validator (rl/config/runfile.py), so `agentrl check`
reports these before anything starts. What can only be known by asking the server (its
persistence) is checked when the run starts (rl/run/launch.py: check_external_redis).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import parse_qs, unquote, urlsplit

from rl.config.errors import ConfigError
from rl.config.sections import RedisConfig

LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.x, ::1, localhost, and the wildcard
    0.0.0.0, which as a destination means this machine)."""
    host = host.strip("[]").lower()
    if host in LOCAL_NAMES or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name: not resolved here (a config check makes no DNS lookups)
    return address.is_loopback or address.is_unspecified


def url_host(url: str) -> str:
    return urlsplit(url).hostname or ""


def url_password(url: str) -> str:
    """The password a redis:// URL carries (in its user part or as ?password=), or ""."""
    parts = urlsplit(url)
    if parts.password:
        return unquote(parts.password)
    return parse_qs(parts.query).get("password", [""])[0]


def cluster_redis_error(ray_address: str, redis: RedisConfig) -> ConfigError | None:
    """Why this Redis setting cannot serve a run on the cluster at `ray_address`, or None."""
    if ray_address == "local":
        return None  # one machine: the embedded server on 127.0.0.1 is right
    where = f"ray.address is {ray_address!r}, a cluster whose nodes all connect to the run's Redis"
    if redis.url is None:
        return _embedded_error(ray_address, redis.bind, where)
    if redis.url.startswith("unix://"):
        return ConfigError(
            "redis.url",
            f"is a unix socket, which only this machine reaches, but {where}; give a "
            "redis://:PASSWORD@HOST:PORT/0 URL with a host the other nodes reach, or remove "
            "redis.url to start the embedded Redis on this (the head) node",
        )
    host = url_host(redis.url)
    if is_loopback(host):
        return ConfigError(
            "redis.url",
            f"points at {host}, which only this machine reaches, but {where}; use the IP "
            "address or host name the other nodes reach the server at, or remove redis.url to "
            "start the embedded Redis on this (the head) node",
        )
    if not url_password(redis.url):
        return ConfigError(
            "redis.url",
            f"has no password, but {where}, so the server listens on the network; set one on "
            "the server (requirepass, or an ACL user) and put it in the URL: "
            "redis://:PASSWORD@HOST:PORT/0 (or redis://USER:PASSWORD@HOST:PORT/0)",
        )
    return None


def _embedded_error(ray_address: str, bind: str | None, where: str) -> ConfigError | None:
    if bind is not None and is_loopback(bind) and bind.strip("[]") not in ("0.0.0.0", "::"):
        return ConfigError(
            "redis.bind",
            f"{bind} is loopback-only, but {where}; set it to an address of this (the head) "
            "node that the other nodes reach, or remove it (null: the IP Ray reports for "
            "this node)",
        )
    if ray_address.startswith("ray://") and bind is None:
        return ConfigError(
            "redis.url",
            f"is null, so the embedded Redis would start on this machine, but ray.address is "
            f"{ray_address!r} (Ray Client): this machine is not a cluster node. Set redis.url to "
            "a Redis every node reaches (with a password), or submit the run to the head node "
            "with `ray job submit -- agentrl train RUN.yaml ray.address=auto`; redis.bind set to "
            "an address of this machine that the nodes reach also does",
        )
    return None


def cluster_output_error(ray_address: str, output_dir: str) -> ConfigError | None:
    """A multi-node run's actors load the policy from, and checkpoint into, the run directory:
    it must be an absolute path, on a filesystem every node mounts at that path."""
    if ray_address == "local" or output_dir.startswith("/"):
        return None
    return ConfigError(
        "output_dir",
        f"is the relative path {output_dir!r}, but ray.address is {ray_address!r}: the rollout "
        "workers and learner ranks on other nodes read the policy from the run directory and "
        "the learner writes checkpoints there, each in its own working directory. Set "
        "output_dir to an absolute path on a filesystem every node mounts at the same path "
        "(e.g. output_dir=/mnt/agentrl/runs; docs/cluster.md)",
    )
