"""`Sandbox.run`: one command in a fresh workspace, under limits, with capped output.

    box = Sandbox(SandboxConfig(limits=Limits(cpu_s=2, wall_s=5)))
    result = box.run_python("print(1 + 1)", files={"data.txt": "42"})
    result.stdout, result.status, result.dropped_bytes

With bubblewrap (see `bwrap.py`) the run is isolated from the host. Without it the run still gets
the rlimits, its own process group (killed as a whole), a throwaway working directory, a cleared
environment and, when we are root, a uid of its own; but it can see the host's files and network,
so every such run warns loudly, and `require_isolation=True` refuses to run at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.sandbox.bwrap import ENV, bwrap_argv, copy_in, default_python, find_bwrap
from envs.sandbox.limits import Limits, preexec, prlimit_argv, process_budget, sandbox_uid
from envs.tools import EnvBroken

_CHUNK = 65536


class SandboxUnavailable(RuntimeError):
    """Isolation was required (`require_isolation=True`) but bubblewrap cannot run here."""


class SandboxLaunchFailed(EnvBroken):
    """The machine could not start a sandboxed run (fork or exec failed; or its workspace or
    input could not be written for lack of processes, memory, descriptors or disk: EAGAIN,
    ENOMEM, EMFILE, ENFILE, ENOSPC, EDQUOT). Not the model's doing, so not an observation
    to train on: as an `EnvBroken`, a tool's call raises it through `Toolbox.call` and the rollout
    ends the episode as an env error."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxConfig:
    limits: Limits = field(default_factory=Limits)
    require_isolation: bool = False
    """Refuse to run (SandboxUnavailable) when bubblewrap is missing or cannot run."""
    backend: str = "auto"
    """"auto" (bubblewrap when it works), "bwrap" (same as auto + require_isolation) or
    "process" (never bubblewrap: rlimits and a process group only; for tests and debugging)."""
    python: str | None = None
    """Interpreter for `run_python`; default: the system python3, else our own interpreter."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "bwrap", "process"):
            raise ValueError(f"backend must be auto, bwrap or process, got {self.backend!r}")
        if self.backend == "process" and self.require_isolation:
            raise ValueError("backend='process' cannot satisfy require_isolation=True")


@dataclass(slots=True, kw_only=True)
class RunResult:
    returncode: int
    """Exit code; negative -N when a signal N ended the command."""
    stdout: str
    stderr: str
    stdout_dropped: int = 0
    """Bytes of stdout beyond `Limits.output_bytes`, read and thrown away."""
    stderr_dropped: int = 0
    timed_out: bool = False
    """The wall timeout fired and the run's processes were killed."""
    wall_s: float = 0.0
    backend: str = "bwrap"

    @property
    def dropped_bytes(self) -> int:
        return self.stdout_dropped + self.stderr_dropped

    @property
    def status(self) -> str:
        """ok | exit | cpu_limit | file_size_limit | killed | wall_timeout."""
        if self.timed_out:
            return "wall_timeout"
        if self.returncode == 0:
            return "ok"
        if self.returncode > 0:
            return "exit"
        return {
            -signal.SIGXCPU: "cpu_limit",
            -signal.SIGXFSZ: "file_size_limit",
        }.get(self.returncode, "killed")

    def describe(self) -> str:
        """A short report for the model: status line, then stdout and stderr."""
        head = {
            "ok": "exit code 0",
            "exit": f"exit code {self.returncode}",
            "cpu_limit": "killed: CPU time limit",
            "file_size_limit": "killed: file size limit",
            "killed": f"killed by signal {-self.returncode}",
            "wall_timeout": f"killed: timed out after {self.wall_s:.1f} s",
        }[self.status]
        parts = [head]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        if self.dropped_bytes:
            parts.append(f"[{self.dropped_bytes} bytes of output dropped]")
        return "\n".join(parts)


class Sandbox:
    """Runs commands under limits; one instance can serve many runs (and threads)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.python = self.config.python or default_python()
        self._bwrap = None if self.config.backend == "process" else find_bwrap()
        required = self.config.require_isolation or self.config.backend == "bwrap"
        if self._bwrap is None and required:
            raise SandboxUnavailable(
                "bubblewrap is required (require_isolation) but `bwrap` is missing or cannot "
                "create namespaces here; install it (apt-get install bubblewrap; `make setup` "
                "does) or allow unisolated runs"
            )
        if self._bwrap is None:
            self._warn()

    @property
    def isolated(self) -> bool:
        """True when runs go through bubblewrap."""
        return self._bwrap is not None

    @property
    def backend(self) -> str:
        return "bwrap" if self.isolated else "process"

    def _warn(self) -> None:
        warnings.warn(
            "SANDBOX NOT ISOLATED: bubblewrap is unavailable, so model-written code runs with "
            "rlimits and its own process group only; it can read host files and reach the "
            "network. Install bubblewrap, or set require_isolation to refuse such runs.",
            RuntimeWarning,
            stacklevel=3,
        )

    def run_python(
        self, code: str, *, files: dict[str, str | bytes] | None = None, stdin: bytes = b""
    ) -> RunResult:
        """Run `code` with the sandbox's Python in isolated mode (-I: no user site, no env)."""
        files = dict(files or {})
        files["__main__.py"] = code
        return self.run([self.python, "-I", "__main__.py"], files=files, stdin=stdin)

    def run(
        self, command: list[str], *, files: dict[str, str | bytes] | None = None, stdin: bytes = b""
    ) -> RunResult:
        """Run `command` in a fresh workspace holding `files` (relative paths -> contents)."""
        with _machine_errors("make its workspace"):
            stage = Path(tempfile.mkdtemp(prefix="agentrl-sandbox-"))
        try:
            with _machine_errors("stage its files"):  # a path clash (the files' names may be
                _stage_files(stage, files or {})  # the model's) stays an OSError: a tool error
            uid = sandbox_uid()
            if self._bwrap is None:
                if os.geteuid() == 0:
                    _chown_tree(stage, uid)
                return self._launch(command, stage, stdin, uid)
            argv = bwrap_argv(
                self._bwrap,
                python=self.python,
                stage=stage,
                tmpfs_bytes=self.config.limits.workspace_mb * 2**20,
                uid=uid,
            )
            return self._launch([*argv, *copy_in(command)], stage, stdin, uid)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _launch(self, argv: list[str], stage: Path, stdin: bytes, uid: int) -> RunResult:
        limits = self.config.limits
        nproc = process_budget(limits, uid)
        wrapper = prlimit_argv(limits, nproc)
        drop = {"user": uid, "group": uid, "extra_groups": []} if os.geteuid() == 0 else {}
        with _machine_errors("buffer its input or run"), tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            start = time.monotonic()
            proc = _popen(
                [*(wrapper or []), *argv],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=stage,
                env=ENV if self._bwrap is None else {},
                start_new_session=True,
                preexec_fn=None if wrapper else preexec(limits, nproc),
                **drop,
            )
            out, err, timed_out = _capture(proc, limits, deadline=start + limits.wall_s)
        code = proc.returncode
        if self._bwrap is not None and code > 128:  # bwrap reports a signal N as 128 + N
            code = -(code - 128)
        return RunResult(
            returncode=code,
            stdout=out.text(),
            stderr=err.text(),
            stdout_dropped=out.dropped,
            stderr_dropped=err.dropped,
            timed_out=timed_out,
            wall_s=time.monotonic() - start,
            backend=self.backend,
        )


@dataclass(slots=True)
class _Capped:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _capture(proc: subprocess.Popen, limits: Limits, *, deadline: float):
    """Read both pipes (keeping `output_bytes` of each) until EOF or the deadline; then make
    sure every process of the run is gone."""
    streams = {proc.stdout: _Capped(limits.output_bytes), proc.stderr: _Capped(limits.output_bytes)}
    selector = selectors.DefaultSelector()
    for pipe in streams:
        selector.register(pipe, selectors.EVENT_READ)
    timed_out = False
    exited_at = None
    while selector.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.5:
            break  # the command is gone but something it left holds the pipes open
        for key, _ in selector.select(timeout=min(0.1, deadline - now)):
            chunk = os.read(key.fd, _CHUNK)
            if chunk:
                streams[key.fileobj].add(chunk)
            else:
                selector.unregister(key.fileobj)
    selector.close()
    if not timed_out:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # let bwrap reap its own children (no orphaned zombies)
    _kill_group(proc)
    for pipe in streams:
        pipe.close()
    return streams[proc.stdout], streams[proc.stderr], timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (with bwrap this tears down its pid namespace), reap."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


MACHINE_ERRNOS = frozenset(
    {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT}
)
"""The OSErrors that say the machine is out of something (processes, memory, descriptors,
disk), never what the run asked for."""


@contextlib.contextmanager
def _machine_errors(doing: str) -> Iterator[None]:
    """An OSError of MACHINE_ERRNOS inside the block as `SandboxLaunchFailed`; others as raised."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in MACHINE_ERRNOS:
            raise
        raise SandboxLaunchFailed(f"the sandbox could not {doing}: {exc}") from exc


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen, with a failure to start (fork or exec) as `SandboxLaunchFailed`: the
    command is the sandbox's own (its Python or bwrap), so any OSError is the machine's."""
    try:
        return subprocess.Popen(argv, **kwargs)
    except OSError as exc:
        raise SandboxLaunchFailed(f"the sandbox could not start {argv[0]}: {exc}") from exc


def _stage_files(stage: Path, files: dict[str, str | bytes]) -> None:
    stage.chmod(0o755)
    for name, content in files.items():
        path = (stage / name).resolve()
        if stage.resolve() not in path.parents:
            raise ValueError(f"sandbox file {name!r} is outside the workspace")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
        path.write_bytes(data)
        for parent in path.relative_to(stage.resolve()).parents:
            (stage / parent).chmod(0o755)
        path.chmod(0o644)


def _chown_tree(root: Path, uid: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, uid, follow_symlinks=False)
