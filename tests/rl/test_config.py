from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from rl.cli import parser
from rl.config.runfile import ConfigError, RunConfig, TrainerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def error_for(
    *overrides: str, text: str | None = None, tmp_path: Path | None = None
) -> ConfigError:
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value


def test_quickstart_loads_and_overrides_apply():
    cfg = load_config(
        ROOT / "configs/quickstart.yaml", ["trainer.lr=3e-4", "rollout.num_workers=3"]
    )
    assert cfg.trainer.lr == 3e-4 and cfg.rollout.num_workers == 3
    assert cfg.trainer.tasks_per_step * cfg.trainer.group_size == cfg.trainer.batch_size


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("trainer.lrr=1e-3", "trainer.lrr", "did you mean 'lr'"),
        ("trainer.group_size=1", "trainer.group_size", "must be >= 2"),
        ("trainer.batch_size=100", "trainer.batch_size", "multiple of group_size"),
        ("rollout.max_new_tokens=-5", "rollout.max_new_tokens", "must be > 0"),
        ("rollout.max_seq_len=-1", "rollout.max_seq_len", "must be > 0"),
        ("trainer.lr=fast", "trainer.lr", "expected a number"),
        ("trainer.steps=2.5", "trainer.steps", "expected an integer"),
        ("sft.enabled=3", "sft.enabled", "true or false"),
        ("trainer.algorithm=ppo2", "trainer.algorithm", "must be one of 'grpo'"),
        ("ray.address=nowhere", "ray.address", "local, auto"),
        ("trainer.lr=.nan", "trainer.lr", "finite"),
        ("trainer=3", "trainer", "expected a mapping"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last", "must be >= 0"),
        ("seed=-1", "seed", "must be >= 0"),  # numpy's seeds are 0 .. 2^32 - 1
        ("metrics.collapse_window=0", "metrics.collapse_window", "must be > 0"),
        ("metrics.collapse_drop=-0.5", "metrics.collapse_drop", "must be > 0"),
        ("ray.object_store_mb=50", "ray.object_store_mb", "must be >= 75"),  # Ray's minimum
        ("trainer.segment_tokens=256", "trainer.segment_tokens", "use agentrl_k3 or set it to 0"),
        ("policy.vocab_size=100", "policy.vocab_size", "use at least 263"),  # failed after Ray
    ],
)
def test_bad_values_name_the_key(override, key, fragment):
    err = error_for(override)
    assert err.key == key
    assert fragment in str(err)


def test_cispo_clips_are_its_cap_or_nothing():
    """cispo's clip_high is the weight cap itself (5.0 by default): 0.28, the dapo habit,
    would scale every token's gradient down to at most 0.28 without a word; clip_low is unused."""
    err = error_for("trainer.algorithm=cispo", "trainer.clip_high=0.28")
    assert err.key == "trainer.clip_high" and "importance-weight cap itself" in str(err)
    err = error_for("trainer.algorithm=cispo", "trainer.clip_low=0.2")
    assert err.key == "trainer.clip_low" and "no lower clip" in str(err)
    cfg = load_config(None, ["trainer.algorithm=cispo", "trainer.clip_high=3"])
    assert cfg.trainer.clip_high == 3
    assert error_for("rollout.max_grader_error_rate=0").key == "rollout.max_grader_error_rate"


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["policy.model_type=qwen3"], "policy.config.preset", "presets exist for agentrl_k3 only"),
        (["policy.model_type=qwen4"], "policy.model_type", "closest: qwen3"),
        (["policy.config.preset=k3-huge"], "policy.config.preset", "unknown preset 'k3-huge'"),
        (["policy.config.hiden_size=64"], "policy.config", "did you mean 'hidden_size'"),
        (["policy.config.num_experts_per_token=64"], "policy.config", "num_experts"),
        (["policy.model_type=qwen3", "policy.config={hiden_size: 64}"], "policy.config",
         "'hiden_size' is not a field of qwen3's config; did you mean 'hidden_size'"),
        (["policy.path=."], "policy.path", "has no config.json"),
        (["trainer.world_size=2", "trainer.expert_parallel=2", "policy.model_type=qwen3",
          "policy.config={}"], "trainer.expert_parallel", "the policy has none"),
        (["trainer.world_size=5", "trainer.expert_parallel=5"], "trainer.expert_parallel",
         "48 routed experts do not split evenly over 5 ranks"),
        (["policy.config.vocab_size=1000"], "policy.config.vocab_size", "policy.vocab_size=1000"),
    ],
)  # fmt: skip
def test_a_policy_that_cannot_be_built_fails_at_check_time(overrides, key, fragment):
    """Before, each of these passed `agentrl check` and failed after Redis, Ray and the
    tokenizer had started (policy/hf.py build_model), or (a misspelled field) was silently
    kept as an unused attribute of the model's config."""
    from rl.run.env_checks import check_policy

    cfg = load_config(ROOT / "configs/quickstart.yaml", overrides)
    with pytest.raises(ConfigError) as info:
        check_policy(cfg)
    assert info.value.key == key and fragment in str(info.value)


def test_a_run_directory_as_policy_path_points_at_its_final_model(tmp_path):
    from rl.run.env_checks import check_policy

    (tmp_path / "final-model").mkdir()
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"policy.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"did you mean '.*/final-model'"):
        check_policy(cfg)
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    check_policy(load_config(ROOT / "configs/quickstart.yaml", [f"policy.path={tmp_path}"]))


def test_k3_only_settings_over_a_saved_dense_policy_fail_at_check_time(tmp_path):
    """The run file's validators check only a fresh policy's model_type: a saved qwen3 with
    trainer.segment_tokens failed at the learner's start, after SFT."""
    from rl.run.env_checks import check_policy

    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for key, value in (("segment_tokens", 128), ("exact_logprobs", "true")):
        over = [f"policy.path={tmp_path}", f"trainer.{key}={value}"]
        with pytest.raises(ConfigError, match=r"policy\.path is a qwen3 model") as info:
            check_policy(load_config(ROOT / "configs/quickstart.yaml", over))
        assert info.value.key == f"trainer.{key}"


def test_a_harness_env_without_an_expert_fails_at_check_time(monkeypatch):
    """configs/harness.yaml with env.kwargs.expert=null passed `agentrl check` and failed with
    a KeyError while the policy was prepared, after Redis and Ray had started."""
    from rl.run.env_checks import check_env

    monkeypatch.chdir(ROOT)  # the run file's task file is relative to the repository
    cfg = load_config(ROOT / "configs/harness.yaml", ["env.kwargs.expert=null"])
    with pytest.raises(ConfigError, match="has no scripted expert") as info:
        check_env(cfg)
    assert info.value.key == "env.id"


def test_the_fresh_vocabulary_floor_is_the_tokenizers():
    from policy.tokenizer import SPECIAL_TOKENS
    from rl.config.sections import MIN_FRESH_VOCAB

    assert 256 + len(SPECIAL_TOKENS) == MIN_FRESH_VOCAB


def test_expert_parallel_over_a_saved_policy_is_checked_against_its_experts(tmp_path):
    """A saved K3 policy with 8 experts splits over 2 or 4 ranks, not 3; a saved dense one over
    none (before, the learner failed at its start, or split nothing without a word)."""
    from rl.run.env_checks import check_policy

    (tmp_path / "tokenizer_config.json").write_text("{}")
    saved = {"model_type": "agentrl_k3", "num_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    path = f"policy.path={tmp_path}"
    for ep in (2, 4):
        check_policy(
            load_config(
                ROOT / "configs/quickstart.yaml",
                [path, f"trainer.world_size={ep}", f"trainer.expert_parallel={ep}"],
            )
        )
    three = [path, "trainer.world_size=3", "trainer.expert_parallel=3"]
    with pytest.raises(ConfigError, match="8 routed experts do not split evenly over 3 ranks"):
        check_policy(load_config(ROOT / "configs/quickstart.yaml", three))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="the policy has none"):
        check_policy(
            load_config(
                ROOT / "configs/quickstart.yaml",
                [*three[:1], "trainer.world_size=2", "trainer.expert_parallel=2"],
            )
        )


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("trainer.learning_rate=1e-3", "TRL's learning_rate is 'lr' here"),
        ("sft.learning_rate=1e-3", "TRL's learning_rate is 'lr' here"),
        ("trainer.num_generations=8", "TRL's num_generations is 'group_size' here"),
        ("trainer.beta=0.04", "TRL's beta is 'kl_coef' here"),
        ("sft.num_train_epochs=3", "TRL's num_train_epochs is 'epochs' here"),
        ("trainer.max_completion_length=64", "is rollout.max_new_tokens in a run file"),
        ("trainer.clip_ratio_high=0.28", "verl's clip_ratio_high is 'clip_high' here"),
        ("trainer.n=8", "verl's rollout.n is 'group_size' here"),
    ],
)
def test_a_peers_key_name_points_to_ours(override, fragment):
    """Users arrive with TRL's GRPOConfig or verl's names: the error says which key is ours."""
    err = error_for(override)
    assert err.key == override.split("=")[0] and "unknown key" in err.message
    assert fragment in err.message and "valid keys here" in err.message


def test_unknown_top_level_and_nested_keys_in_a_file(tmp_path):
    assert error_for(text="nmae: x\n", tmp_path=tmp_path).key == "nmae"
    err = error_for(text="rollout:\n  tempreature: 0.7\n", tmp_path=tmp_path)
    assert err.key == "rollout.tempreature" and "temperature" in str(err)


def test_yaml_scientific_notation_without_dot_is_a_number(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 3e-4\n")
    assert load_config(path).trainer.lr == 3e-4


def test_cli_typo_fails_fast_without_starting_anything(tmp_path):
    path = tmp_path / "typo.yaml"
    text = (ROOT / "configs/quickstart.yaml").read_text()
    typo = re.sub(r"^  steps: ", "  stpes: ", text, count=1, flags=re.M)
    assert typo != text, "the quickstart has no trainer.steps line to misspell"
    path.write_text(typo)
    command = [sys.executable, "-X", "importtime", "-m", "rl.cli", "train", str(path)]
    proc = subprocess.run(
        [*command, f"output_dir={tmp_path}/runs"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "trainer.stpes: unknown key; did you mean 'steps'" in proc.stderr
    # fast: refused before the seconds-long imports of a run (torch, transformers, ray, redis);
    # -X importtime lists every module imported ("import time: self | cumulative | name")
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "rl.config.runfile" in imported  # the listing is there
    assert not imported & {"torch", "transformers", "ray", "redis"}, imported
    assert not (tmp_path / "runs").exists()


def test_cli_rejects_an_unknown_env_id():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl.cli",
            "check",
            str(ROOT / "configs/quickstart.yaml"),
            "env.id=agentrl/Nope-v0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "env.id: no environment 'agentrl/Nope-v0'" in proc.stderr


def test_several_errors_are_reported_together_first_one_as_the_key():
    err = error_for("trainer.lrr=1e-3", "rollout.top_p=1.5")
    assert err.key == "rollout.top_p" and "must be <= 1" in err.message
    assert "\ntrainer.lrr: unknown key; did you mean 'lr'?" in str(err)


def test_sections_built_in_python_raise_config_errors_too(tmp_path):
    with pytest.raises(ConfigError) as info:
        TrainerConfig(lrr=1e-3)
    assert info.value.key == "lrr" and "did you mean 'lr'" in info.value.message
    err = error_for(text="curriculum:\n  - {name: a, steps: 0}\n", tmp_path=tmp_path)
    assert err.key == "curriculum[0].steps" and "curriculum[0].max_seq_len: is required" in str(err)


def test_routing_replay_without_recorded_routes_is_refused():
    err = error_for("trainer.routing_replay=true", "rollout.record_routing=false")
    assert err.key == "trainer.routing_replay"
    assert "rollout.record_routing: true" in err.message and "routing_replay: false" in err.message
    assert load_config(None, ["trainer.routing_replay=true"]).rollout.record_routing


def test_the_resolved_config_in_a_run_dir_loads_back_the_same(tmp_path):
    cfg = load_config(ROOT / "configs/long_context.yaml", ["trainer.tis_cap=2.0"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    again = load_config(path)
    assert again == cfg and again.trainer.off_policy == "decoupled"


def test_the_exported_json_schema_accepts_every_shipped_run_file(tmp_path, capsys):
    def cli(*argv: str) -> int:  # `agentrl config schema ...` without main's logging setup
        args = parser().parse_args(argv)
        return args.fn(args)

    assert cli("config", "schema") == 0
    schema = json.loads(capsys.readouterr().out)
    out = tmp_path / "agentrl.schema.json"
    assert cli("config", "schema", "--output", str(out)) == 0
    assert json.loads(out.read_text()) == schema
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        data = yaml.safe_load(path.read_text())
        assert not list(validator.iter_errors(data)), path.name
        load_config(path)  # and the loader agrees
    data = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    for section, key, value in [
        ("trainer", "stpes", 4),  # a typo
        ("trainer", "algorithm", "ppo2"),
        ("rollout", "top_p", 1.5),
        ("trainer", "steps", "many"),
    ]:
        bad = {**data, section: {**data[section], key: value}}
        assert not validator.is_valid(bad), (section, key, value)
    assert RunConfig.model_json_schema()["additionalProperties"] is False


def test_live_episodes_default_to_the_room_the_staleness_bound_gives():
    """rollout.max_episodes null: 64 in sync mode; async: every group max_staleness lets start
    fits (2 x 128 trajectories over 2 workers: 128 each); an explicit value is kept."""
    quickstart = ROOT / "configs/quickstart.yaml"
    assert load_config(quickstart).rollout.max_episodes == 64
    run = load_config(quickstart, ["trainer.mode=async", "rollout.num_workers=2"])
    assert run.rollout.max_episodes == 128
    run = load_config(quickstart, ["trainer.mode=async", "trainer.max_staleness=2"])
    assert run.rollout.max_episodes == -(-3 * run.trainer.batch_size // run.rollout.num_workers)
    run = load_config(quickstart, ["trainer.mode=async", "rollout.max_episodes=32"])
    assert run.rollout.max_episodes == 32


def test_tool_threads_default_to_one_per_live_episode():
    quickstart = ROOT / "configs/quickstart.yaml"
    assert load_config(quickstart).rollout.tool_threads == 64
    run = load_config(quickstart, ["trainer.mode=async", "trainer.max_staleness=2"])
    assert run.rollout.tool_threads == run.rollout.max_episodes > 64
    assert load_config(quickstart, ["rollout.tool_threads=4"]).rollout.tool_threads == 4
