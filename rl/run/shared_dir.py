"""Is a directory the same directory on every node of the Ray cluster? A multi-node run needs
`output_dir` to be (docs/cluster.md, "The shared filesystem"); agentrl does not check it by
itself, this does, from any node of a running cluster:

    .venv/bin/ray exec configs/cluster/gcp.yaml \\
        'cd ~/agentrl && .venv/bin/python -m rl.run.shared_dir /mnt/agentrl/runs'

This process writes a probe file with a random token into the directory; a zero-CPU task pinned
to each live node reads it back and writes its own answer file next to it, which this process
then reads. A node that cannot see the token, or whose answer does not arrive, is reported; the
exit status is 1 if any is.

`check_files_everywhere` is the same idea for a run's task files (env.dataset): rl/run/launch.py
calls it when a multi-node run starts, so a file that only the head has fails then, naming the
key, not in a rollout worker on another node.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.config.errors import ConfigError


@dataclass(frozen=True)
class NodeView:
    """What one node saw: its host name and the problem (None: the directory is shared)."""

    node_id: str
    host: str
    problem: str | None


def probe(directory: str, token: str, node_id: str) -> tuple[str, str | None]:
    """On a node: read the token back and leave an answer file; (host, problem or None)."""
    host, file = socket.gethostname(), Path(directory) / f".agentrl-probe-{token}"
    try:
        seen = file.read_text()
    except OSError as exc:
        return host, f"cannot read {file}: {exc.strerror or exc}"
    if seen != token:
        return host, f"{file} holds something else: not the same directory"
    try:
        (Path(directory) / f".agentrl-probe-{token}-{node_id}").write_text(host)
    except OSError as exc:
        return host, f"cannot write in {directory}: {exc.strerror or exc}"
    return host, None


def on_every_node(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """`fn(*args, node_id)` run once on each live node of the cluster Ray is connected to (a
    zero-CPU task pinned there); [(node_id, its result)]."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=0)(fn)
    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            *args, node
        )
        for node in nodes
    ]
    return list(zip(nodes, ray.get(refs, timeout=timeout), strict=True))


def check_shared_dir(directory: Path, timeout: float = 120.0) -> list[NodeView]:
    """Ask every live node whether it sees `directory` as this process does (the directory
    must exist here; the probe files are removed afterwards)."""
    token = secrets.token_hex(8)
    (directory / f".agentrl-probe-{token}").write_text(token)
    try:
        views = []
        for node, (host, problem) in on_every_node(probe, str(directory), token, timeout=timeout):
            answer = directory / f".agentrl-probe-{token}-{node}"
            if problem is None and not answer.is_file():
                problem = f"wrote {answer.name} in its {directory}, which this node does not see"
            views.append(NodeView(node, host, problem))
        return views
    finally:
        for file in directory.glob(f".agentrl-probe-{token}*"):
            file.unlink(missing_ok=True)


def sizes(paths: list[str], node_id: str = "") -> tuple[str, list[int | None]]:
    """On a node: (host, the size of each file, None where there is no such file)."""
    found = [os.path.getsize(p) if os.path.isfile(p) else None for p in paths]
    return socket.gethostname(), found


def check_files_everywhere(files: list[tuple[str, str]], timeout: float = 120.0) -> None:
    """Raise the ConfigError of `files_problem` for `files` ((run-file key, absolute path)) as
    the live nodes of the cluster see them: a run's task files are read by its rollout
    workers, wherever Ray placed them."""
    if files:
        paths = [path for _, path in files]
        answers = [answer for _, answer in on_every_node(sizes, paths, timeout=timeout)]
        problem = files_problem(files, sizes(paths)[1], answers)
        if problem is not None:
            raise problem


def files_problem(
    files: list[tuple[str, str]], here: list[int | None], answers: list[tuple[str, list]]
) -> ConfigError | None:
    """The first of `files` that this node (sizes `here`) or a node of `answers` ((host,
    sizes)) lacks, or holds with another size, as a ConfigError naming its key."""
    for i, (key, path) in enumerate(files):
        differ = [
            f"{host}: {'no such file' if seen[i] is None else f'{seen[i]} bytes'}"
            for host, seen in answers
            if seen[i] != here[i] or seen[i] is None
        ]
        if here[i] is None or differ:
            mine = "not on this node" if here[i] is None else f"{here[i]} bytes here"
            return ConfigError(
                key,
                f"{path} ({mine}) is not the same file on every node of the cluster "
                f"({'; '.join(differ) or 'the others agree'}), and the rollout workers read it "
                "wherever they run. Put it on the shared filesystem (e.g. /mnt/agentrl, where "
                "output_dir is) or in the repository directory the cluster file copies to "
                "every node, and give that path (docs/cluster.md)",
            )
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(
            "usage: python -m rl.run.shared_dir DIRECTORY (an existing directory, e.g. the "
            "output_dir of your runs) on a node of a running Ray cluster",
            file=sys.stderr,
        )
        return 2
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level="warning")
    views = check_shared_dir(Path(args[0]).resolve())
    for view in views:
        print(f"{view.host} ({view.node_id[:8]}): {view.problem or 'shared'}")
    bad = [v for v in views if v.problem]
    print(f"{len(views) - len(bad)} of {len(views)} nodes share {args[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
