"""configs/cluster/*.yaml are valid Ray cluster files: they pass Ray's own cluster-config schema
(the ray-schema.json that ships with the installed ray) and the preparation `ray up` does
before it contacts a provider (defaults filled in, node types resolved, then Ray's
validate_config), and they carry what docs/cluster.md says they do."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "configs" / "cluster").glob("*.yaml"))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_is_an_on_premises_and_a_cloud_cluster():
    providers = {load(f)["provider"]["type"] for f in FILES}
    assert "local" in providers
    assert providers & {"aws", "gcp"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_valid_against_rays_schema(path):
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = load(path)
    jsonschema.validate(config, schema)  # the file as written
    prepared = prepare_config(copy.deepcopy(config))  # as `ray up` prepares it
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_installs_agentrl_as_the_readme_does_and_mounts_the_run_files(path):
    config = load(path)
    assert config["file_mounts"] == {"~/agentrl": "."}  # the repository, configs/ included
    assert ".gitignore" in config["rsync_filter"]  # no .venv or runs/ copied
    assert "cd ~/agentrl && make setup" in config["setup_commands"]
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("~/agentrl/.venv/bin/ray " in c for c in starts)  # the venv's Ray on every node


def test_node_roles_carry_learner_and_rollout_resources():
    for path in FILES:
        config = load(path)
        if config["provider"]["type"] == "local":  # roles through `ray start --resources`
            head = resources_in(config["head_start_ray_commands"])
            worker = resources_in(config["worker_start_ray_commands"])
            assert head.get("learner", 0) > 0 and worker.get("rollout", 0) > 0, path.name
        else:
            types = config["available_node_types"].values()
            assert any(t["resources"].get("learner", 0) > 0 for t in types), path.name
            assert any(t["resources"].get("rollout", 0) > 0 for t in types), path.name
            assert any(t["resources"].get("GPU", 0) > 0 for t in types), path.name


def resources_in(commands: list[str]) -> dict:
    found = re.search(r"--resources='(\{.*?\})'", " ".join(commands))
    return json.loads(found.group(1)) if found else {}


SHARED = "/mnt/agentrl"  # output_dir=/mnt/agentrl/runs on every node (docs/cluster.md)


def setup_of(prepared: dict, node_type: str, head: bool) -> list[str]:
    """The setup commands `ray up` (the head) or the autoscaler (a worker) runs on a node of
    `node_type`: a node type's own worker_setup_commands replace the merged global ones."""
    if head:
        return prepared["head_setup_commands"]
    own = prepared["available_node_types"][node_type].get("worker_setup_commands")
    return own if own is not None else prepared["worker_setup_commands"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_node_is_set_up_and_mounts_the_shared_directory(path):
    prepared = prepare_config(copy.deepcopy(load(path)))
    for node_type in prepared["available_node_types"]:
        for head in {node_type == prepared["head_node_type"], False}:
            commands = " ".join(setup_of(prepared, node_type, head))
            assert "cd ~/agentrl && make setup" in commands, (node_type, head)
            local = load(path)["provider"]["type"] == "local"
            if local and head:  # on premises the head exports the directory over NFS
                assert f"{SHARED} $clients(rw" in commands and "exportfs -ra" in commands
            else:  # every other node mounts it at the same path
                assert re.search(rf"mount -t nfs .*\S+ {SHARED}\b", commands), (node_type, head)
                assert f"test -w {SHARED}" in commands  # a share it cannot write fails setup


def test_the_cluster_guide_names_every_file():
    guide = (ROOT / "docs" / "cluster.md").read_text()
    for path in FILES:
        assert f"configs/cluster/{path.name}" in guide
