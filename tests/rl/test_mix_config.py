"""`env: {mix: [...]}` in a run file: the sugar for agentrl/Mix-v0, what it refuses (naming the
key), a saved config.yaml that loads again, and `agentrl check` on a mix (every entry's id, kwargs,
build and expert; configs/mix.yaml)."""

from __future__ import annotations

from pathlib import Path

import gymnasium
import pytest
import yaml

from envs import Outcome, ToolEnv, tool
from envs.types import user
from rl.cli import main
from rl.config.runfile import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]
CALC, RETR = "agentrl/Calculator-v0", "agentrl/Retrieval-v0"
MIX = [{"id": CALC, "kwargs": {"difficulty": 2}, "weight": 2}, {"id": RETR}]


def env_section(env: dict):
    return build_config({"env": env}).env


def test_mix_maps_to_the_mixture_env_with_its_entries():
    env = env_section({"mix": MIX})
    assert env.id == "agentrl/Mix-v0" and env.entry_point is None
    assert env.kwargs == {
        "envs": [
            {"id": CALC, "kwargs": {"difficulty": 2}, "weight": 2.0},
            {"id": RETR, "kwargs": {}, "weight": 1.0},
        ]
    }
    one = env_section({"mix": [{"kwargs": {"difficulty": 3}}]})  # a mix of one; id: the default
    assert one.kwargs == {"envs": [{"id": CALC, "kwargs": {"difficulty": 3}, "weight": 1.0}]}
    plugin = env_section({"mix": [{"entry_point": "acme_envs.echo:EchoEnv", "weight": 0.5}]})
    assert plugin.kwargs["envs"] == [
        {"id": "acme_envs/EchoEnv-v0", "entry_point": "acme_envs.echo:EchoEnv", "kwargs": {}}
        | {"weight": 0.5}
    ]


def test_a_saved_config_loads_again():
    cfg = build_config({"env": {"mix": MIX}})
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(exclude={"testing"}), sort_keys=False))
    assert build_config(saved).env == cfg.env


@pytest.mark.parametrize(
    ("env", "key", "fragment"),
    [
        ({"mix": []}, "env.mix", "is empty"),
        ({"mix": MIX, "id": CALC}, "env.id", "cannot be set beside mix"),
        ({"mix": MIX, "entry_point": "a.b:C"}, "env.entry_point", "env.mix[i].entry_point"),
        ({"mix": MIX, "kwargs": {"difficulty": 1}}, "env.kwargs", "move it into the entries"),
        ({"mix": [{"id": CALC, "weight": 0}]}, "env.mix[0].weight", "must be > 0"),
        ({"mix": [{"id": CALC, "weight": "2"}]}, "env.mix[0].weight", "expected a number"),
        ({"mix": [{"id": CALC}, {"wieght": 2}]}, "env.mix[1].wieght", "did you mean 'weight'"),
        ({"mix": [{"mix": MIX}]}, "env.mix[0].mix", "cannot be a mix"),
    ],
)
def test_refusals_name_the_key(env, key, fragment):
    with pytest.raises(ConfigError) as info:
        build_config({"env": env})
    assert info.value.key == key and fragment in info.value.message


def test_a_curriculum_cannot_change_a_mix():
    stages = [{"name": "a", "steps": 1, "max_seq_len": 512, "env_kwargs": {"difficulty": 2}}]
    with pytest.raises(ConfigError) as info:
        build_config({"env": {"mix": MIX}, "trainer": {"steps": 1}, "curriculum": stages})
    assert info.value.key == "curriculum[0].env_kwargs" and "env.mix" in info.value.message
    stages[0]["env_kwargs"] = {}
    build_config({"env": {"mix": MIX}, "trainer": {"steps": 1}, "curriculum": stages})


def check(capsys, run_file: Path, *overrides: str) -> tuple[int, str]:
    code = main(["check", str(run_file), *overrides])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_agentrl_check_passes_configs_mix_yaml(capsys):
    code, out = check(capsys, ROOT / "configs/mix.yaml")
    assert code == 0 and "config ok" in out, out
    cfg = build_config(yaml.safe_load((ROOT / "configs/mix.yaml").read_text()))
    assert [e["id"] for e in cfg.env.kwargs["envs"]] == [CALC, RETR]


def write(tmp_path: Path, mix: list[dict]) -> Path:
    run_file = tmp_path / "mix.yaml"
    run_file.write_text(yaml.safe_dump({"env": {"mix": mix}}))
    return run_file


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"id": "agentrl/Retreival-v0"},
            "env.mix[1].id: no environment 'agentrl/Retreival-v0' is registered; did you mean "
            "'agentrl/Retrieval-v0'?",
        ),
        (
            {"id": RETR, "kwargs": {"hopz": 2}},
            "env.mix[1].kwargs.hopz: agentrl/Retrieval-v0 (envs.retrieval:RetrievalEnv) takes no "
            "argument 'hopz'",
        ),
        (
            {"id": RETR, "kwargs": {"difficulty": 9}},
            "env.mix[1].kwargs.difficulty: agentrl/Retrieval-v0 refused difficulty=9 when built",
        ),
        (
            {"id": "acme/Mine-v0", "entry_point": "acme_not_installed.envs:Mine"},
            "env.mix[1].entry_point: cannot import 'acme_not_installed.envs'",
        ),
    ],
)
def test_agentrl_check_names_the_entry_at_fault(capsys, tmp_path, entry, message):
    code, out = check(capsys, write(tmp_path, [{"id": CALC}, entry]))
    assert code == 2 and f"agentrl: config error: {message}" in out, out


class NoExpertEnv(ToolEnv):
    """An env without a scripted expert."""

    @tool
    def noop(self) -> str:
        """Do nothing."""
        return "ok"

    def _new_task(self, options):
        return [user("say ok")]

    def _grade(self, answer):
        return Outcome(success=answer["content"] == "ok")


@pytest.fixture
def no_expert():
    gymnasium.register(id="test/NoExpert-v0", entry_point=NoExpertEnv)
    yield "test/NoExpert-v0"
    gymnasium.registry.pop("test/NoExpert-v0")


def test_an_env_without_an_expert_is_refused_unless_sft_and_the_tokenizer_need_none(
    capsys, tmp_path, no_expert
):
    run_file = write(tmp_path, [{"id": CALC}, {"id": no_expert}])
    code, out = check(capsys, run_file)
    assert code == 2, out
    assert "config error: env.mix[1].id: test/NoExpert-v0 has no scripted expert" in out
    assert "sft.enabled: false and policy.path" in out
    saved = tmp_path / "model"  # what `agentrl check` looks for in a saved model directory
    saved.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (saved / name).write_text("{}")
    code, out = check(capsys, run_file, "sft.enabled=false", f"policy.path={saved}")
    assert code == 0 and "config ok" in out, out
