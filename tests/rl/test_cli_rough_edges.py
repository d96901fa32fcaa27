"""What a newcomer hits first: every `agentrl` command given a missing path, a file for a
directory (or the reverse), an empty directory, a run file that is not UTF-8, empty, or not YAML
answers with one `agentrl: ...` line naming the problem and exits 2, never with a traceback;
`agentrl check` builds the env once, so a kwarg value its constructor refuses is a config error;
an unknown env id fails at once with the closest registered id; `agentrl plot --output PATH`;
trainer.context_parallel sizes the learner mesh cannot hold are refused by `agentrl check`; so
is an opening prompt that leaves no room for a turn (every episode would end "context full");
RL from a random policy (sft.enabled false, no policy.path) is warned about. Each command runs
the CLI in a fresh process, as a user would."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config.errors import ConfigError
from rl.config.runfile import load_config
from rl.run.env_checks import check_env_id, check_prompt_room

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
RUN_DIR_FIX = "pass a run directory made by agentrl train"


def agentrl(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2, no traceback, one `agentrl...` error line holding every fragment."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentrl"), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], proc.stderr


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A missing path, a file, an empty directory, and bad run files."""
    root = tmp_path_factory.mktemp("rough")
    (root / "empty").mkdir()
    (root / "a-file.txt").write_text("not a run\n")
    (root / "latin1.yaml").write_bytes(b"# caf\xe9 au lait\nname: latin\n")
    (root / "blank.yaml").write_text("# nothing set yet\n\n")
    (root / "broken.yaml").write_text("trainer:\n  steps: [1, 2\n")
    run = root / "latin1-run"  # a run directory whose config.yaml is not UTF-8
    run.mkdir()
    (run / "config.yaml").write_bytes(b"name: caf\xe9\n")
    (run / "trajectories.jsonl").write_text('{"step": 1, "id": "1-0/0", "reward": 0}\n')
    run = root / "bad-metrics-run"  # a metrics line that is not JSON, before others
    run.mkdir()
    (run / "config.yaml").write_text("name: bad\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "phase": "train", oops}\n{"step": 2}\n')
    run = root / "bad-traj-run"  # trajectory records edited by hand
    run.mkdir()
    (run / "config.yaml").write_text("name: bad\n")
    (run / "trajectories.jsonl").write_text('{"step": 1, "id": "1-0/0", "reward": 1.0}\n[3]\n')
    run = root / "short-traj-run"  # a record with the keys to find it but not to show it
    run.mkdir()
    (run / "config.yaml").write_text("name: short\n")
    (run / "trajectories.jsonl").write_text('{"step": 1, "id": "1-0/0", "reward": 1.0}\n')
    return root


CASES = [
    # (argv; {p}: the place), the fragments of the error line
    (["plot", "{p}/missing"], ["RUN_DIR", "missing does not exist", RUN_DIR_FIX]),
    (["plot", "{p}/a-file.txt"], ["a-file.txt is a file, not a run directory"]),
    (["plot", "{p}/empty"], ["empty is not a run directory (no metrics.jsonl)"]),
    (["show", "{p}/missing"], ["missing does not exist", RUN_DIR_FIX]),
    (["show", "{p}/a-file.txt"], ["a-file.txt is a file, not a run directory"]),
    (["show", "{p}/empty"], ["empty is not a run directory (no config.yaml"]),
    (["monitor", "{p}/missing", "--once"], ["missing does not exist"]),
    (["monitor", "{p}/a-file.txt", "--once"], ["a-file.txt is a file, not a run directory"]),
    (["monitor", "{p}/empty", "--once"], ["not a run directory (no config.yaml)"]),
    (["monitor", "{p}/latin1-run", "--once"], ["is not UTF-8 text (byte 0xe9 at line 1"]),
    (["monitor", "{p}/bad-metrics-run", "--once"], ["metrics.jsonl is not JSON"]),
    (["monitor", "--redis", "localhost:6379", "--run", "x", "--once"], ["--redis", "scheme"]),
    (
        ["monitor", "--redis", "redis://127.0.0.1:1", "--run", "x", "--once"],
        ["--redis: cannot reach redis://127.0.0.1:1", "is Redis up?"],
    ),
    (["plot", "{p}/bad-metrics-run"], ["metrics.jsonl line 1 is not a JSON record"]),
    (["show", "{p}/latin1-run"], ["config.yaml is not UTF-8 text"]),
    (["train", "--resume", "{p}/missing"], ["--resume", "missing does not exist"]),
    (["train", "--resume", "{p}/a-file.txt"], ["--resume", "is a file, not a run directory"]),
    (["train", "--resume", "{p}/empty"], ["--resume", "not a run directory (no config.yaml)"]),
    (["check", "{p}/missing.yaml"], ["run file", "missing.yaml' does not exist"]),
    (["check", "{p}/empty"], ["empty' is a directory, not a YAML file"]),
    (
        ["check", "{p}/latin1.yaml"],
        ["latin1.yaml is not UTF-8 text (byte 0xe9 at line 1, column 6); save it as UTF-8"],
    ),
    (["train", "{p}/latin1.yaml"], ["latin1.yaml is not UTF-8 text"]),
    (["check", "{p}/blank.yaml"], ["blank.yaml' is empty", "configs/template.yaml"]),
    (["check", "{p}/broken.yaml"], ["broken.yaml is not valid YAML", "line 2, column 10"]),
    (["config", "schema", "--output", "{p}/a-file.txt/schema.json"], ["--output", "is a file"]),
    (["config", "docs", "--output", "{p}/a-file.txt/x/docs.md"], ["--output", "is a file"]),
    (["envs", "check", "agentrl/Calculater-v0"], ["did you mean 'agentrl/Calculator-v0'?"]),
    (["show", "{p}/bad-traj-run"], ["record 2 is not a trajectory record", "missing step"]),
]


@pytest.mark.parametrize(("argv", "fragments"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_error_line_not_a_traceback(place, argv, fragments):
    proc = agentrl(*(a.format(p=place) for a in argv))
    refused(proc, *fragments)


def test_show_on_a_missing_directory_does_not_blame_metrics_trajectories(place):
    proc = agentrl("show", str(place / "missing"))
    refused(proc, "does not exist")
    assert "metrics.trajectories" not in proc.stderr


# 2. `agentrl check` builds the env once


def test_check_builds_the_env_so_a_refused_kwarg_value_is_a_config_error():
    proc = agentrl("check", QUICKSTART, "env.kwargs.difficulty=7")
    refused(
        proc,
        "agentrl: config error: env.kwargs.difficulty: agentrl/Calculator-v0 refused "
        "difficulty=7 when built: ValueError: difficulty must be 1, 2, 3 or 4, got 7",
    )


def test_check_build_names_the_kwarg_and_passes_good_ones():
    from envs.registry import RegistrationError, check_build

    check_build("agentrl/Calculator-v0", {"difficulty": 2, "max_turns": 3})
    with pytest.raises(RegistrationError) as info:
        check_build("agentrl/Calculator-v0", {"max_turns": 3, "difficulty": 0})
    assert info.value.key == "difficulty" and "got 0" in str(info.value)


# 3. an unknown env id: fast, with the closest registered id


def test_an_unknown_env_id_fails_fast_with_the_closest_id(monkeypatch):
    import gymnasium

    import envs.registry  # (and envs, which registers the built-in ids, as `agentrl` does)

    # fast: the id is looked up in the registry; no entry point is imported, no env is built
    loaded = []
    monkeypatch.setattr(envs.registry, "load_object", lambda *a: loaded.append(a))
    monkeypatch.setattr(envs.registry, "check_build", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(gymnasium, "make", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError) as info:
        check_env_id({"env": {"id": "agentrl/Calculater-v0"}})
    assert info.value.key == "env.id"
    assert "did you mean 'agentrl/Calculator-v0'?" in info.value.message
    assert loaded == []
    check_env_id({"env": {"id": "agentrl/Calculator-v0"}})  # a known id passes
    check_env_id({"env": {"id": "acme/New-v0", "entry_point": "acme.new:NewEnv"}})


def test_check_of_an_unknown_env_id_stops_before_the_policy_is_imported():
    """`agentrl check` reports the id before the policy's settings are checked: those import
    torch and transformers (seconds); the CLI's own work is light (no torch, transformers or
    ray imported)."""
    script = (
        "import sys\n"
        "from rl.cli import main\n"
        f"code = main(['check', {QUICKSTART!r}, 'env.id=agentrl/Calculater-v0'])\n"
        "print(code, *(m in sys.modules for m in ('torch', 'transformers', 'ray')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (
        "env.id: no environment 'agentrl/Calculater-v0' is registered; did you mean "
        "'agentrl/Calculator-v0'?" in proc.stderr
    )
    assert proc.stdout.split() == ["2", "False", "False", "False"], proc.stdout


# 4. `agentrl plot RUN_DIR --output PATH`


def fake_run(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: fake\n")
    records = [
        {"step": 0, "phase": "eval", "eval/label": "sft", "eval/mode": "greedy"}
        | {"eval/success": 0.5, "eval/ci_low": 0.4, "eval/ci_high": 0.6},
        *(
            {"step": s, "phase": "train", "reward/mean": 0.2 * s, "reward/std": 0.1}
            | {"rollout/success_rate": 0.2 * s}
            for s in (1, 2, 3)
        ),
    ]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "phase": "tr')  # a live run's last line
    return run


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_where_asked_creating_directories(tmp_path):
    run = fake_run(tmp_path)
    out = tmp_path / "figures" / "new" / "curve.png"
    proc = agentrl("plot", str(run), "--output", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == str(out) and is_png(out)
    assert not (run / "reward_curve.png").exists()
    proc = agentrl("plot", str(run))  # the default place stays
    assert proc.returncode == 0 and proc.stdout.strip() == str(run / "reward_curve.png")
    assert is_png(run / "reward_curve.png")


def test_plot_output_that_cannot_be_written(tmp_path):
    run = fake_run(tmp_path)
    (tmp_path / "taken").write_text("a file where a directory is asked for\n")
    refused(
        agentrl("plot", str(run), "--output", str(tmp_path / "taken" / "curve.png")),
        "--output: cannot create the directory",
        "taken is a file; pick another path",
    )


def test_plot_output_in_a_format_matplotlib_does_not_know(tmp_path):
    run = fake_run(tmp_path)
    refused(
        agentrl("plot", str(run), "--output", str(tmp_path / "curve.txt")),
        "--output: cannot write",
        "Format 'txt' is not supported",
    )


def test_plot_of_a_run_without_a_finished_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: fresh\n")
    refused(agentrl("plot", str(run)), "has no metrics.jsonl yet")
    (run / "metrics.jsonl").write_text("")
    refused(agentrl("plot", str(run)), "has no finished training step yet")


def test_show_names_a_record_it_cannot_draw(place, monkeypatch):
    """A record with the keys to pick it but not to draw it: ShowError naming it, no KeyError."""
    import argparse

    from rl.observe import show

    monkeypatch.setattr(show, "load_decoder", lambda run_dir: lambda ids: "")
    args = argparse.Namespace(
        run_dir=str(place / "short-traj-run"),
        list=False,
        id=None,
        step=None,
        worst=True,
        best=False,
    )
    with pytest.raises(show.ShowError, match="record '1-0/0' is malformed"):
        show.run(args)


# 4. trainer.context_parallel: sizes the learner's mesh cannot hold, named before anything runs


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["trainer.world_size=4", "trainer.context_parallel=3"], "trainer.context_parallel"),
        (["trainer.world_size=4", "trainer.context_parallel=2", "trainer.expert_parallel=4"],
         "trainer.expert_parallel"),
        (["trainer.world_size=2", "trainer.context_parallel=2", "trainer.algorithm=ppo"],
         "trainer.context_parallel"),
        (["trainer.world_size=2", "trainer.context_parallel=2", "policy.model_type=qwen3",
          "policy.config={}"], "trainer.context_parallel"),
    ],
    ids=["not-dividing-world", "ep-over-data-ranks", "ppo", "not-k3"],
)  # fmt: skip
def test_check_refuses_context_sizes_the_mesh_cannot_hold(args, key):
    refused(agentrl("check", QUICKSTART, *args), f"config error: {key}:")


def test_check_accepts_context_parallel_with_expert_parallel():
    proc = agentrl(
        "check", QUICKSTART, "trainer.world_size=4", "trainer.context_parallel=2",
        "trainer.expert_parallel=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# 5. an opening prompt that leaves no room for a turn: every episode would end "context full"


def test_check_refuses_a_prompt_that_leaves_no_room_for_a_turn(model_dir):
    """Before, the run started and every episode ended "context full" before its first token:
    nothing was trained, and nothing said why."""
    saved = f"policy.path={model_dir}"
    proc = agentrl("check", QUICKSTART, saved, "rollout.max_seq_len=64")
    refused(
        proc, "config error: rollout.max_seq_len: 64 (the policy takes 1024: max_position_",
        "+ rollout.max_new_tokens 48 > 64", '"context full"', "raise rollout.max_seq_len to",
    )  # fmt: skip
    assert agentrl("check", QUICKSTART, saved).returncode == 0  # 1024 leaves room


def test_a_fresh_tokenizer_is_checked_at_each_curriculum_stage(tokenizer):
    """A fresh policy's tokenizer exists once the run trains it (rl/run/build.py
    prepare_policy checks then); each stage is checked with its own limits."""
    stages = (
        "curriculum=[{name: a, steps: 1, max_seq_len: 1024}, "
        "{name: b, steps: 1, max_seq_len: 64, max_new_tokens: 8}]"
    )
    cfg = load_config(QUICKSTART, ["trainer.steps=2", stages])
    with pytest.raises(ConfigError) as info:
        check_prompt_room(cfg, tokenizer)
    assert info.value.key == "curriculum[1].max_seq_len"
    assert "curriculum[1].max_new_tokens 8 > 64" in info.value.message
    check_prompt_room(load_config(QUICKSTART), tokenizer)  # the quickstart's 1024 leaves room
    check_prompt_room(load_config(QUICKSTART, ["rollout.max_seq_len=64"]))  # no tokenizer yet


# 6. RL from a randomly initialised policy: allowed (the test suite's runs do it for speed), said


def test_rl_from_a_random_policy_is_warned_about_once(tmp_path, monkeypatch, caplog):
    import rl.run.train as train

    monkeypatch.setattr(train, "prepare_policy", lambda cfg, run_dir: tmp_path)
    with caplog.at_level(logging.WARNING, logger="rl.run.train"):
        state, report = train.warm_start(load_config(QUICKSTART, ["sft.enabled=false"]), tmp_path)
    assert state.base_label == "init" and report == {}
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"!!! {train.UNTRAINED_START}"]
    assert "sft.enabled is false and policy.path is not set" in warned[0]
    caplog.clear()
    saved = load_config(QUICKSTART, ["sft.enabled=false", f"policy.path={tmp_path}"])
    with caplog.at_level(logging.WARNING, logger="rl.run.train"):
        train.warm_start(saved, tmp_path)  # a saved policy: RL from it is what was asked
    assert caplog.records == []


def test_the_prompt_probe_runs_no_agent_and_waits_on_a_failing_reset_once(tokenizer, monkeypatch):
    """A harness env's reset runs the user's agent (and waits up to its first-request timeout),
    an MCP env's starts servers: neither is probed. Any other env's failing reset ends the probe
    at once (it was tried on every probe seed, each wait in full)."""
    import gymnasium

    monkeypatch.chdir(ROOT)  # the run files' task paths are relative to the repository root
    tight = ["rollout.max_seq_len=64", "rollout.max_new_tokens=8"]
    made: list[str] = []
    real_make = gymnasium.make
    monkeypatch.setattr(gymnasium, "make", lambda *a, **k: made.append(a[0]) or real_make(*a, **k))
    check_prompt_room(load_config(str(ROOT / "configs" / "harness.yaml"), tight), tokenizer)
    assert made == []  # not built, not reset: nothing to refuse
    mcp = "env.kwargs.mcp=[{command: python, args: [configs/mcp/calc_server.py]}]"
    check_prompt_room(load_config(str(ROOT / "configs" / "dataset.yaml"), [*tight, mcp]), tokenizer)
    assert made == []
    resets: list[int] = []

    class Broken:
        def reset(self, seed=None):
            resets.append(seed)
            raise ConnectionError("the tool service did not answer in 60 s")

        def close(self):
            pass

    monkeypatch.setattr(gymnasium, "make", lambda *a, **k: Broken())
    check_prompt_room(load_config(QUICKSTART, tight), tokenizer)  # can't tell: not refused
    assert resets == [0]
