"""Tasks from a data file: TaskSet (loading, bad rows, the train / held-out split, which seed plays
which row) and agentrl/Dataset-v0 (gymnasium's checks, save and continue, the expert, MCP tools)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.check import check_tool_env
from envs.dataset import DatasetEnv, DatasetExpert, arithmetic_rows
from envs.taskset import TaskSet
from envs.types import DEMO_SEEDS, HELDOUT_SEEDS, assistant, tool_call

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "configs" / "data" / "arith.jsonl"


def write_jsonl(path: Path, rows: list, blank_lines: bool = False) -> Path:
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in rows]
    text = ("\n\n" if blank_lines else "\n").join(lines) + "\n"
    path.write_text(text)
    return path


def qa_rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "answer": 2 * i, "id": i} for i in range(n)]


@pytest.fixture
def tasks(tmp_path) -> Path:
    return write_jsonl(tmp_path / "tasks.jsonl", qa_rows(50), blank_lines=True)


# --- loading --------------------------------------------------------------------------------------
def test_jsonl_and_parquet_load_the_same_rows(tmp_path, tasks):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(qa_rows(50)), parquet)
    from_jsonl, from_parquet = TaskSet.load(tasks), TaskSet.load(parquet)
    assert len(from_jsonl) == len(from_parquet) == 50  # blank lines skipped
    assert from_jsonl.train == from_parquet.train and from_jsonl.heldout == from_parquet.heldout
    assert from_jsonl.train[0].keys() == {"prompt", "answer", "id"}  # other columns kept
    assert from_parquet.source == str(parquet)


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1?", "a": "2"}, {"q": "2+2?", "a": "4"}])
    env = DatasetEnv(path=str(path), prompt_key="q", answer_key="a", grader="numeric")
    obs, _ = env.reset(seed=0)
    assert obs[0]["content"] in ("1+1?", "2+2?")
    assert env.step(assistant(env.row["a"]))[1] == 1.0


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"prompt": "a", "answer": 1}, {"prompt": "b"}], "t.jsonl line 2: no 'answer' value"),
        ([{"prompt": "a", "answer": 1}, "", {"answer": 2}], "t.jsonl line 3: no 'prompt' value"),
        ([{"prompt": "a", "answer": None}], "line 1: no 'answer' value (its keys: 'prompt', "),
        ([{"prompt": "a", "answer": 1}, "{broken"], "t.jsonl line 2: not valid JSON"),
        (["[1, 2]"], "t.jsonl line 1: a task must be a JSON object, got list"),
        ([{"prompt": 3, "answer": 1}], "line 1: 'prompt' must be a non-empty string"),
        ([{"prompt": "a", "answer": []}], "line 1: 'answer' is an empty list"),
        ([{"prompt": "a", "answer": " "}], "line 1: 'answer' is blank"),  # "" would pass exact
        ([{"prompt": "a", "answer": ["b", ""]}], "line 1: 'answer' is blank"),
        ([{"prompt": "a", "answer": 1, "split": "dev"}], "split must be train, heldout, test"),
        ([""], "t.jsonl: no tasks in the file"),
        ([{"prompt": "a", "answer": 1, "split": "test"}], "every row is held out"),
    ],
)
def test_bad_rows_name_the_file_the_line_and_the_key(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    with pytest.raises(ValueError) as caught:
        TaskSet.load(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_byte_order_mark_is_read_and_other_encodings_named(tmp_path):
    """A BOM (Windows editors) was "line 1: not valid JSON"; latin-1 bytes a bare
    UnicodeDecodeError naming neither the file nor the line."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a", "answer": "1"}\n')
    loaded = TaskSet.load(path)
    assert (loaded.train + loaded.heldout)[0]["prompt"] == "a"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl line 2: not UTF-8 text"):
        TaskSet.load(path)


def test_bad_parquet_rows_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": 1}, {"prompt": "b"}]), path)
    with pytest.raises(ValueError, match=r"t\.parquet row 2: no 'answer' value"):
        TaskSet.load(path)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read as Parquet"):
        TaskSet.load(tmp_path / "junk.parquet")


def test_wrong_suffix_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"must be \.jsonl or \.parquet, not \.csv"):
        TaskSet.load(tmp_path / "t.csv")
    with pytest.raises(FileNotFoundError, match="no such task file"):
        TaskSet.load(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \[0, 1\)"):
        TaskSet.load(ARITH, heldout_fraction=1.0)


# --- the split ------------------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_about_the_fraction(tasks):
    first, again = TaskSet.load(tasks), TaskSet.load(tasks)
    assert first == again
    train_ids = {r["id"] for r in first.train}
    held_ids = {r["id"] for r in first.heldout}
    assert not train_ids & held_ids and train_ids | held_ids == set(range(50))
    assert 4 <= len(held_ids) <= 18  # about 0.2 of 50
    assert [r["id"] for r in first.heldout] == sorted(held_ids)  # file order
    other = TaskSet.load(tasks, split_seed=1)
    assert {r["id"] for r in other.heldout} != held_ids
    bigger = TaskSet.load(tasks, heldout_fraction=0.5)
    assert held_ids <= {r["id"] for r in bigger.heldout}  # a row's hash is fixed


def test_appending_rows_moves_no_old_row(tmp_path):
    short = TaskSet.load(write_jsonl(tmp_path / "a.jsonl", qa_rows(40)))
    longer = TaskSet.load(write_jsonl(tmp_path / "b.jsonl", qa_rows(80)))
    assert {r["id"] for r in short.heldout} == {r["id"] for r in longer.heldout if r["id"] < 40}


def test_two_rows_give_one_of_each_and_zero_holds_out_nothing(tmp_path):
    for seed in range(20):
        two = TaskSet.load(write_jsonl(tmp_path / "two.jsonl", qa_rows(2)), split_seed=seed)
        assert len(two.train) == len(two.heldout) == 1
    one = TaskSet.load(write_jsonl(tmp_path / "one.jsonl", qa_rows(1)), heldout_fraction=0.9)
    assert len(one.train) == 1 and not one.heldout
    none = TaskSet.load(write_jsonl(tmp_path / "ten.jsonl", qa_rows(10)), heldout_fraction=0)
    assert len(none.train) == 10 and not none.heldout
    assert none.eval_rows == none.train and two.eval_rows == two.heldout
    # evaluation then plays the training rows, in file order
    assert [none.row_for(HELDOUT_SEEDS + i)["id"] for i in range(12)] == [*range(10), 0, 1]


def test_split_column_overrides_the_hash(tmp_path):
    rows = qa_rows(30)
    for row in rows[:5]:
        row["split"] = "test"
    for row in rows[5:]:
        row["split"] = "train"
    rows[7]["split"] = "eval"
    rows[8]["split"] = "heldout"
    tasks = TaskSet.load(write_jsonl(tmp_path / "t.jsonl", rows))
    assert [r["id"] for r in tasks.heldout] == [0, 1, 2, 3, 4, 7, 8]
    assert len(tasks.train) == 23


def test_seeds_choose_rows_by_range(tasks):
    taskset = TaskSet.load(tasks)
    held = [taskset.row_for(HELDOUT_SEEDS + i) for i in range(len(taskset.heldout) * 2)]
    assert held == list(taskset.heldout) * 2  # evaluation's seeds enumerate the held-out rows
    train = [taskset.row_for(s) for s in range(300)]
    assert all(row in taskset.train for row in train)
    assert len({row["id"] for row in train}) > len(taskset.train) * 0.8
    assert taskset.row_for(7) == taskset.row_for(7)
    demos = [taskset.row_for(DEMO_SEEDS + i) for i in range(100)]  # SFT never sees held-out
    assert all(row in taskset.train for row in demos)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        taskset.row_for(-1)


# --- the env --------------------------------------------------------------------------------------
def test_registered_and_passes_gymnasium_and_agentrl_checks(tasks):
    assert "agentrl/Dataset-v0" in envs.env_ids()
    env = gymnasium.make("agentrl/Dataset-v0", path=str(tasks), grader="numeric")
    check_env(env.unwrapped)
    report = check_tool_env(
        "agentrl/Dataset-v0", kwargs={"path": str(tasks), "system": "Be brief."}, episodes=3
    )
    assert report.passed, report.format()


def test_without_a_path_it_plays_the_built_in_sample():
    env = gymnasium.make("agentrl/Dataset-v0")
    obs, info = env.reset(seed=0)
    assert obs[0]["content"].endswith("Answer with the number.") and info["tools"] == []
    assert env.unwrapped.taskset.source == "<built-in arithmetic sample>"
    assert arithmetic_rows(5) == arithmetic_rows(5) and len(env.unwrapped.taskset) == 64


def test_episode_opening_answer_and_outcome(tasks):
    env = DatasetEnv(path=str(tasks), grader="numeric", system="Answer with a number.")
    obs, info = env.reset(seed=HELDOUT_SEEDS)
    row = env.taskset.heldout[0]
    assert obs == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": row["prompt"]},
    ]
    obs, reward, terminated, truncated, info = env.step(assistant(f"It is {row['answer']}."))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["outcome"] == {
        "success": True,
        "details": {"expected": row["answer"], "given": float(row["answer"])},
    }
    env.reset(seed=HELDOUT_SEEDS)
    assert env.step("no idea")[1] == 0.0  # a plain string is an assistant message


def test_an_unseeded_reset_plays_a_training_row(tasks):
    env = DatasetEnv(path=str(tasks))
    env.reset(seed=3)
    for _ in range(20):
        env.reset()
        assert env.row in env.taskset.train


def test_one_turn_ends_with_a_tool_call_truncated(tasks):
    env = DatasetEnv(path=str(tasks), max_turns=1)
    env.reset(seed=0)
    action = assistant("", [tool_call("search", {"q": "x"})])
    obs, _, terminated, truncated, _ = env.step(action)
    assert obs[0]["content"].startswith("Error: unknown tool") and truncated and not terminated


def test_save_and_continue(tasks):
    env = DatasetEnv(path=str(tasks), grader="numeric", max_turns=3)
    env.reset(seed=HELDOUT_SEEDS + 2)
    env.step(assistant("", [tool_call("nothing", {})]))  # a turn to replay
    state = json.loads(json.dumps(env.get_state()))
    assert state["options"] == {"task_seed": HELDOUT_SEEDS + 2}
    answer = assistant(str(env.row["answer"]))
    expected = env.step(answer)
    other = DatasetEnv(path=str(tasks), grader="numeric", max_turns=3)
    other.set_state(state)  # a fresh env, never reset
    assert other.row == env.row == env.taskset.heldout[2]
    assert other.step(answer)[:4] == expected[:4] and expected[1] == 1.0
    unseeded = DatasetEnv(path=str(tasks))
    unseeded.reset()
    copy = DatasetEnv(path=str(tasks))
    copy.set_state(unseeded.get_state())
    assert copy.row == unseeded.row


def test_a_numeric_grader_refuses_a_reference_without_a_number(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "lots"}])
    with pytest.raises(ValueError, match=r"'lots' .* is not a number"):
        DatasetEnv(path=str(path), grader="numeric")
    assert DatasetEnv(path=str(path), grader="exact").taskset.train


def test_bad_kwargs_fail_when_built(tasks):
    with pytest.raises(ValueError, match=r"env\.grader must be"):
        DatasetEnv(path=str(tasks), grader="fuzzy")
    with pytest.raises(ValueError, match=r"mcp\[0\]: MCP server spec #0 has unknown key 'cmd'"):
        DatasetEnv(path=str(tasks), mcp=[{"command": "x", "cmd": "y"}])
    with pytest.raises(ValueError, match="prompt_key and answer_key need a task file"):
        DatasetEnv(answer_key="solution")


# --- the expert -----------------------------------------------------------------------------------
@pytest.mark.parametrize("grader", ["numeric", "exact"])
def test_the_perfect_expert_solves_every_task(grader):
    env = gymnasium.make("agentrl/Dataset-v0", path=str(ARITH), grader=grader)
    expert = envs.make_expert("agentrl/Dataset-v0", error_rate=0.0, seed=0)
    demos = [envs.demonstrate(env, expert, seed=DEMO_SEEDS + s) for s in range(100)]
    assert all(d.outcome["success"] for d in demos)
    assert all(len(d.messages) == 2 and d.tools == [] for d in demos)


def test_the_imperfect_expert_fails_at_about_its_error_rate(tmp_path):
    env = gymnasium.make("agentrl/Dataset-v0", path=str(ARITH), grader="numeric")
    expert = DatasetExpert(error_rate=0.3, seed=1)
    failed = sum(not envs.demonstrate(env, expert, seed=s).outcome["success"] for s in range(400))
    assert 90 <= failed <= 150
    words = [{"prompt": f"Say {w}", "answer": [w, w.upper()]} for w in ("cat", "dog", "owl")]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "w.jsonl", words)))
    always_wrong = DatasetExpert(error_rate=1.0, seed=0)  # no digit: another row's answer
    assert not any(
        envs.demonstrate(env, always_wrong, seed=s).outcome["success"] for s in range(20)
    )


def test_the_example_file_is_what_its_script_writes():
    rows = [json.loads(line) for line in ARITH.read_text().splitlines()]
    assert rows == arithmetic_rows(300, seed=0)
    assert all(isinstance(r["answer"], int) for r in rows)


# --- MCP tools ------------------------------------------------------------------------------------
def test_mcp_tools_join_on_the_first_reset_and_stop_on_close(tasks):
    server = {"command": sys.executable, "args": [str(ROOT / "configs/mcp/calc_server.py")]}
    env = DatasetEnv(path=str(tasks), grader="numeric", max_turns=3, mcp=[server])
    assert env.tools == [] and env._mcp is None  # nothing started yet
    obs, info = env.reset(seed=HELDOUT_SEEDS)
    assert "calculate" in [t["function"]["name"] for t in info["tools"]]
    row = env.row
    obs, *_ = env.step(assistant("", [tool_call("calculate", {"expression": "2 * 21"})]))
    assert obs == [{"role": "tool", "name": "calculate", "content": "42"}]
    assert env.step(assistant(str(row["answer"])))[1] == 1.0
    env.close()
    assert env._mcp is None


def test_a_close_while_the_mcp_servers_start_stops_them_at_once(monkeypatch):
    """A restore past its timeout is abandoned while its reset is still starting the env's MCP
    servers on the tool pool, and the rollout closes the env on another thread
    (rollout/episode.py discard): the servers that come up after the close are stopped then
    (not left running until garbage collection), and that reset fails saying why."""
    import envs.mcp

    started, release, closed = threading.Event(), threading.Event(), []

    class SlowTools:  # MCPTools whose start() blocks until the test releases it
        def __init__(self, servers, timeout_s):
            pass

        def start(self):
            started.set()
            release.wait(10)
            return self

        def close(self):
            closed.append(self)

    monkeypatch.setattr(envs.mcp, "MCPTools", SlowTools)
    monkeypatch.setattr(envs.mcp, "attach", lambda toolbox, client: None)  # no tools to add
    env = DatasetEnv(mcp=[{"command": "python", "args": ["server.py"]}])
    errors = []

    def reset():
        try:
            env.reset(seed=1)
        except RuntimeError as exc:
            errors.append(str(exc))

    resetting = threading.Thread(target=reset)
    resetting.start()
    assert started.wait(10)
    env.close()  # nothing to stop yet: the servers are still starting
    assert closed == []
    release.set()
    resetting.join(10)
    assert len(closed) == 1 and errors == ["the env was closed while its MCP servers were starting"]
