"""Resource limits of one sandboxed run, and how they are applied (rlimits via `prlimit`)."""

from __future__ import annotations

import os
import resource
import secrets
import shutil
from dataclasses import dataclass

UID_BASE, UID_SPAN = 1_900_000_000, 1 << 20
"""When we are root, each run gets its own unused uid (and gid) from this range, so that
RLIMIT_NPROC counts that run's processes alone (it counts per uid) and runs cannot signal or
ptrace each other."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one second later."""
    wall_s: float = 10.0
    """Wall-clock seconds for the whole run; then every process of the run is killed."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS): allocations beyond it fail (MemoryError)."""
    max_processes: int = 32
    """Processes and threads the run may have at once (RLIMIT_NPROC on the sandbox's uid)."""
    file_size_mb: int = 16
    """Largest file the run may write (RLIMIT_FSIZE): writes beyond it fail with EFBIG."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    workspace_mb: int = 64
    """Size of the writable workspace and of /tmp (tmpfs each, bubblewrap only)."""
    output_bytes: int = 65536
    """Bytes of stdout and of stderr kept; the rest is counted as dropped."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "max_processes", "file_size_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)}")
        for name in ("open_files", "workspace_mb", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)}")

    def rlimits(self, nproc: int) -> dict[str, tuple[int, int]]:
        """`prlimit` resource name -> (soft, hard)."""
        cpu = max(1, round(self.cpu_s))
        memory = self.memory_mb * 2**20
        fsize = self.file_size_mb * 2**20
        return {
            "cpu": (cpu, cpu + 1),
            "as": (memory, memory),
            "nproc": (nproc, nproc),
            "fsize": (fsize, fsize),
            "nofile": (self.open_files, self.open_files),
            "core": (0, 0),
        }


def prlimit_argv(limits: Limits, nproc: int) -> list[str] | None:
    """`prlimit --cpu=a:b ... --` (None when util-linux's prlimit is missing)."""
    binary = shutil.which("prlimit")
    if binary is None:
        return None
    flags = [f"--{name}={soft}:{hard}" for name, (soft, hard) in limits.rlimits(nproc).items()]
    return [binary, *flags, "--"]


def preexec(limits: Limits, nproc: int):
    """The same limits from Python in the child (used only when `prlimit` is missing)."""
    names = {
        "cpu": resource.RLIMIT_CPU,
        "as": resource.RLIMIT_AS,
        "nproc": resource.RLIMIT_NPROC,
        "fsize": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
        "core": resource.RLIMIT_CORE,
    }
    pairs = [(names[k], v) for k, v in limits.rlimits(nproc).items()]

    def apply() -> None:  # pragma: no cover - runs in the child
        for which, value in pairs:
            resource.setrlimit(which, value)

    return apply


def sandbox_uid() -> int:
    """The uid a run executes as: a fresh one from the range above when we are root, else ours
    (then RLIMIT_NPROC also counts our other processes; see `process_budget`)."""
    if os.geteuid() == 0:
        return UID_BASE + secrets.randbelow(UID_SPAN)
    return os.geteuid()


def process_budget(limits: Limits, uid: int) -> int:
    """RLIMIT_NPROC for a run as `uid`: its own processes plus those the uid already has (bwrap
    and its init included); as non-root, slack for our other processes starting meanwhile."""
    slack = 2 if os.geteuid() == 0 else 64
    return limits.max_processes + processes_of(uid) + slack


def processes_of(uid: int) -> int:
    """How many processes (threads included) `uid` runs now: RLIMIT_NPROC counts them all."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return count
