"""`ray.runtime_env` in the run file (checked when it loads) and the runtime_env a run gives
`ray.init` (rl/run/runtime_env.py): on a cluster, agentrl's packages and the env modules of the
run file that lie in the current directory go to every node. Two tests start Ray: a two-node
cluster on this machine (`ray.cluster_utils.Cluster`), where a module in a directory that no
worker has on its path or as its working directory is importable on the other node only with
that runtime_env (and the run's own start, the task-file check and rl/run/shared_dir.py's
shared-directory check run there too); and a local Ray given the run file's runtime_env."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from rl.config.runfile import ConfigError, load_config
from rl.run.launch import services, start_ray, stop_ray
from rl.run.runtime_env import AGENTRL_PACKAGES, data_files, local_module, runtime_env_for
from rl.run.shared_dir import check_shared_dir, files_problem, probe
from rl.run.shared_dir import main as shared_dir_main

CLUSTER = ["ray.address=auto", "output_dir=/mnt/agentrl/runs"]


def error_for(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return info.value


def test_an_unknown_key_is_refused_by_name():
    error = error_for("ray.runtime_env.conda=env")
    assert error.key == "ray.runtime_env.conda"
    assert "working_dir, py_modules, pip, env_vars, excludes" in error.message


def test_local_paths_must_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert error_for("ray.runtime_env.working_dir=gone").key == "ray.runtime_env.working_dir"
    error = error_for("ray.runtime_env.py_modules=[gone.py]")
    assert error.key == "ray.runtime_env.py_modules[0]" and "gone.py" in error.message
    (tmp_path / "notes.txt").write_text("")
    assert error_for("ray.runtime_env.py_modules=[notes.txt]").key.endswith("py_modules[0]")
    assert error_for("ray.runtime_env.pip=reqs.txt").key == "ray.runtime_env.pip"
    (tmp_path / "lib").mkdir()
    cfg = load_config(
        None, ["ray.runtime_env.py_modules=[lib, gs://bucket/m.zip]", "ray.runtime_env.pip=[six]"]
    )
    assert cfg.ray.runtime_env["pip"] == ["six"]


def test_types_are_checked():
    assert error_for("ray.runtime_env.env_vars.N=1").key == "ray.runtime_env.env_vars.N"
    assert error_for("ray.runtime_env.excludes=runs").key == "ray.runtime_env.excludes"
    assert error_for("ray.runtime_env.working_dir=3").key == "ray.runtime_env.working_dir"


def test_one_machine_gets_the_run_files_runtime_env_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme_local.py").write_text("")
    (tmp_path / "lib").mkdir()
    cfg = load_config(
        None,
        [
            "env.entry_point=acme_local:Env",
            "ray.runtime_env.py_modules=[lib]",
            "ray.runtime_env.env_vars.A=b",
        ],
    )
    env = runtime_env_for(cfg)
    assert env.spec == {"py_modules": [str(tmp_path.resolve() / "lib")], "env_vars": {"A": "b"}}
    assert env.summary() == f"ray runtime_env: py_modules {tmp_path.resolve() / 'lib'}; env_vars A"
    assert runtime_env_for(load_config(None, [])).spec == {}  # nothing: ray.init as before


def test_a_cluster_ships_agentrl_and_the_env_module_from_the_current_directory(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTRL_LOG_LEVEL", "DEBUG")
    package = tmp_path / "acme_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    cfg = load_config(
        None, [*CLUSTER, "env.entry_point=acme_pkg.envs:Env", "ray.runtime_env.env_vars.A=b"]
    )
    env = runtime_env_for(cfg)
    shipped = env.spec["py_modules"]
    assert [Path(p).name for p in shipped] == [*AGENTRL_PACKAGES, "acme_pkg"]
    assert shipped[-1] == str(package.resolve())  # the package, not the directory around it
    assert env.spec["env_vars"] == {"AGENTRL_LOG_LEVEL": "DEBUG", "A": "b"}
    assert env.summary() == (
        "ray runtime_env: py_modules envs, policy, reward, rl, rollout, "
        f"{package.resolve()} (env.entry_point); env_vars AGENTRL_LOG_LEVEL, A"
    )


def test_only_a_module_in_the_current_directory_is_shipped(tmp_path):
    (tmp_path / "acme_file.py").write_text("")
    (tmp_path / "acme_ns").mkdir()  # a namespace package
    assert local_module("acme_file", tmp_path) == tmp_path / "acme_file.py"
    assert local_module("acme_ns.deep.mod", tmp_path) == tmp_path / "acme_ns"
    assert local_module("acme_missing", tmp_path) is None
    assert local_module("yaml", tmp_path) is None  # installed
    assert local_module("json", tmp_path) is None  # the standard library
    assert local_module("envs.calculator", Path.cwd()) is None  # agentrl's own: shipped anyway
    cwd = Path(__file__).resolve().parents[2]  # the repository root: tests/ is found there
    assert local_module("tests.chaos.faulty_env", cwd) == cwd / "tests"


def test_a_node_that_does_not_see_the_probe_says_so(tmp_path):
    assert probe(str(tmp_path), "abc", "n1")[1].startswith("cannot read")
    (tmp_path / ".agentrl-probe-abc").write_text("other")
    assert "not the same directory" in probe(str(tmp_path), "abc", "n1")[1]
    (tmp_path / ".agentrl-probe-abc").write_text("abc")
    assert probe(str(tmp_path), "abc", "n1")[1] is None
    assert (tmp_path / ".agentrl-probe-abc-n1").is_file()


def test_a_task_file_some_node_lacks_is_named_by_its_key():
    files = [("env.mix[1].dataset", "/data/tasks.jsonl")]
    assert files_problem(files, [10], [("head", [10]), ("w1", [10])]) is None
    error = files_problem(files, [10], [("head", [10]), ("w1", [None])])
    assert error.key == "env.mix[1].dataset" and "w1: no such file" in error.message
    assert "w1: 7 bytes" in files_problem(files, [10], [("w1", [7])]).message
    assert "not on this node" in files_problem(files, [None], [("w1", [None])]).message


def test_mix_entries_and_grader_modules_are_shipped_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("acme_a.py", "acme_grade.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "tasks.jsonl").write_text("")
    mix = (
        "env.mix=[{entry_point: acme_a:Env}, {entry_point: yaml:Env},"
        " {dataset: tasks.jsonl, grader: 'acme_grade:grade'}]"
    )
    cfg = load_config(None, [*CLUSTER, mix])
    assert runtime_env_for(cfg).sources == {
        str(tmp_path / "acme_a.py"): "env.mix[0].entry_point",
        str(tmp_path / "acme_grade.py"): "env.mix[2].grader",
    }
    assert data_files(cfg) == [("env.mix[2].dataset", str(tmp_path / "tasks.jsonl"))]


def test_an_agent_harness_and_its_expert_are_shipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text("")
    (tmp_path / "my_expert.py").write_text("")
    (tmp_path / "tasks.jsonl").write_text("")
    env = "env={harness: 'my_agent:run', dataset: tasks.jsonl, kwargs: {expert: 'my_expert:E'}}"
    cfg = load_config(None, [*CLUSTER, env])
    assert runtime_env_for(cfg).sources == {
        str(tmp_path / "my_agent.py"): "env.harness",
        str(tmp_path / "my_expert.py"): "env.kwargs.expert",
    }


ENV_MODULE = """
import os
WHERE = os.path.abspath(__file__)
class ShippedEnv:
    pass
"""


@pytest.fixture()
def two_nodes():
    """A head and one worker node offering `away: 1`, started in the test's own directory."""
    from ray._private.utils import get_ray_address_file, read_ray_address
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, resources={"away": 1}, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        stop_ray()
        address = cluster.address
        cluster.shutdown()
        with contextlib.suppress(OSError):  # Cluster made it what a bare ray.init() joins
            if read_ray_address() == address:
                os.remove(get_ray_address_file(None))


def import_on_the_other_node(name: str, user: Path) -> tuple[str, bool]:
    """What a task on the node offering `away` finds: the module's file (or the error), and
    whether `user` is on that worker's sys.path (Ray puts the driver's cwd there)."""
    import ray

    @ray.remote(num_cpus=0, resources={"away": 1})
    def where(module: str, user: str) -> tuple[str, str, bool]:
        import importlib

        assert os.getcwd() != user
        node, on_path = ray.get_runtime_context().get_node_id(), user in sys.path
        try:
            return node, importlib.import_module(module).WHERE, on_path
        except ModuleNotFoundError as exc:
            return node, f"ModuleNotFoundError: {exc}", on_path

    node, found, on_path = ray.get(where.remote(name, str(user)), timeout=120)
    assert node != ray.get_runtime_context().get_node_id()  # not the driver's node
    return found, on_path


@pytest.mark.slow
@pytest.mark.distributed
def test_a_cluster_run_ships_its_env_module_to_the_other_node(
    two_nodes, tmp_path, monkeypatch, capsys
):
    user = tmp_path / "project"  # the user's directory: on no worker's path, no worker's cwd
    user.mkdir()
    (user / "acme_shipped_env.py").write_text(ENV_MODULE)
    (user / "tasks.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.chdir(user)
    mix = "env.mix=[{entry_point: acme_shipped_env:ShippedEnv}, {dataset: tasks.jsonl}]"
    cfg = load_config(None, [f"ray.address={two_nodes.address}", f"output_dir={tmp_path}", mix])
    env = runtime_env_for(cfg)
    assert env.sources == {str(user / "acme_shipped_env.py"): "env.mix[0].entry_point"}
    # Ray adds the driver's cwd to every worker's sys.path (meant for clusters whose nodes
    # hold the same directories): on one machine that would hide what is shipped, so the
    # driver joins from another directory first
    monkeypatch.chdir(tmp_path)
    start_ray(cfg.ray, {})  # without the runtime_env: no such module there
    found, on_path = import_on_the_other_node("acme_shipped_env", user)
    assert found.startswith("ModuleNotFoundError") and not on_path
    stop_ray()
    start_ray(cfg.ray, env.spec)  # with it: the shipped copy
    found, on_path = import_on_the_other_node("acme_shipped_env", user)
    assert found.endswith("acme_shipped_env.py") and not found.startswith(str(user))
    assert not on_path
    stop_ray()

    monkeypatch.chdir(user)  # the run's own start (runtime_env, task files on every node);
    with services(cfg, tmp_path / "run"):  # here the driver's cwd copy comes first (above)
        found, on_path = import_on_the_other_node("acme_shipped_env", user)
        assert found == str(user / "acme_shipped_env.py") and on_path

        views = check_shared_dir(tmp_path)  # one machine: both nodes see the same directory
        assert len(views) == 2 and all(v.problem is None for v in views)
        assert not list(tmp_path.glob(".agentrl-probe-*"))
        assert shared_dir_main([str(tmp_path)]) == 0  # the docs' one-line check
        assert capsys.readouterr().out.endswith(f"2 of 2 nodes share {tmp_path}\n")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_local_run_passes_the_run_files_runtime_env_to_ray(tmp_path, monkeypatch):
    import ray

    lib = tmp_path / "lib" / "acme_lib"  # a package that only ray.runtime_env makes importable
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    overrides = ["ray.num_cpus=1", "ray.runtime_env.env_vars.ACME=ready"]
    cfg = load_config(None, [*overrides, "ray.runtime_env.py_modules=[lib/acme_lib]"])
    start_ray(cfg.ray, runtime_env_for(cfg).spec)
    try:

        @ray.remote(num_cpus=0)
        def look() -> tuple[str | None, int]:
            import acme_lib

            return os.environ.get("ACME"), acme_lib.VALUE

        assert ray.get(look.remote(), timeout=120) == ("ready", 7)
    finally:
        stop_ray()
