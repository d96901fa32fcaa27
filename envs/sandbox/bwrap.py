"""The bubblewrap command line: what a sandboxed process can see and do.

Inside: a read-only /usr (and the interpreter's prefix when it lives elsewhere), fresh /proc,
/dev and /tmp, an empty size-capped tmpfs workspace at /workspace (the run's files are copied in
from a read-only staging bind), no network (its own namespace: only a down-to-itself loopback),
no /etc, no /home, no view of the run directory, the grader's files or the host's services, its
own pid namespace (killing bwrap kills every process of the run), no capabilities, a cleared
environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

WORKSPACE = "/workspace"
STAGE = "/stage"
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}


def find_bwrap() -> str | None:
    """The bubblewrap binary if present *and* able to make namespaces here, else None."""
    binary = shutil.which("bwrap")
    if binary is None:
        return None
    try:
        probe = subprocess.run(
            [binary, "--unshare-all", "--ro-bind", "/", "/", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return binary if probe.returncode == 0 else None


def default_python() -> str:
    """The interpreter sandboxed Python code runs with: the system python3 when there is one
    (so the project's virtualenv stays invisible), else the interpreter running us."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


def system_binds(python: str) -> list[str]:
    """Read-only binds of the system: /usr, the usual symlinks, and `python`'s prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    real = Path(os.path.realpath(python))
    if not str(real).startswith("/usr/"):
        prefix = real.parent.parent  # <prefix>/bin/python3.x -> <prefix>
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


def bwrap_argv(binary: str, *, python: str, stage: Path, tmpfs_bytes: int, uid: int) -> list[str]:
    """bwrap arguments up to (not including) the command."""
    args = [
        binary,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        "--clearenv",
        *system_binds(python),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmpfs_bytes),
        "--tmpfs",
        "/tmp",
        "--size",
        str(tmpfs_bytes),
        "--tmpfs",
        WORKSPACE,
        "--ro-bind",
        str(stage),
        STAGE,
        "--chdir",
        WORKSPACE,
    ]
    for key, value in ENV.items():
        args += ["--setenv", key, value]
    return args


def copy_in(command: list[str]) -> list[str]:
    """Wrap `command` so the staged files are copied into the workspace first."""
    script = f'cp -R {STAGE}/. {WORKSPACE}/ 2>/dev/null; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *command]
