"""`agentrl show RUN_DIR`: one recorded trajectory as a transcript.

The trajectory comes from `<run>/trajectories.jsonl` (rl/observe/trajlog.py): `--id ID`, the
`--worst` or `--best` by reward, or the last one recorded; `--step N` limits the choice to one
step and
`--list` lists the candidates instead. Its tokens are decoded with the run's tokenizer, one
segment per run of the loss mask, so what the policy sampled (and is trained on) stands apart
from what it was given (the prompt, the chat template, tool outputs); each sampled segment is an
assistant turn and names the policy version(s) that sampled it. Colour on a terminal, plain text
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from rl.config.runfile import read_yaml
from rl.observe.trajlog import FILE, expand, read


class ShowError(ValueError):
    """Nothing to show: the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Segment:
    sampled: bool
    start: int
    end: int
    versions: tuple[int, ...]
    """The policy versions that sampled its tokens (empty for a masked segment)."""


def segments(record: dict) -> list[Segment]:
    """One segment per run of the loss mask, with the versions that sampled it."""
    versions = expand(record["versions"])
    out, start = [], 0
    for value, count in record["mask"]:
        end = start + count
        sampled = sorted({v for v in versions[start:end] if v >= 0}) if value else []
        out.append(Segment(bool(value), start, end, tuple(sampled)))
        start = end
    return out


def select(
    records: list[dict],
    *,
    traj_id: str | None = None,
    step: int | None = None,
    worst: bool = False,
    best: bool = False,
) -> dict:
    """The trajectory the flags ask for (the last recorded one when they name none)."""
    pool = [r for r in records if step is None or r["step"] == step]
    if not pool:
        steps = sorted({r["step"] for r in records})
        where = f"step {step}" if step is not None else "this run"
        raise ShowError(f"no trajectory recorded for {where}; recorded steps: {_span(steps)}")
    if traj_id is not None:
        found = [r for r in pool if r["id"] == traj_id]
        if not found:
            sample = ", ".join(r["id"] for r in pool[:3])
            raise ShowError(f"no trajectory {traj_id!r} (ids look like {sample}; see --list)")
        return found[-1]
    if worst:
        return min(pool, key=lambda r: r["reward"])
    if best:
        return max(pool, key=lambda r: r["reward"])
    return pool[-1]


def tokenizer_dir(run_dir: Path) -> Path:
    """Where the run's tokenizer is: the SFT model's, the fresh policy's, or `policy.path`."""
    candidates = [run_dir / "sft-model", run_dir / "policy-init"]
    config = run_dir / "config.yaml"
    if config.exists():
        raw = read_yaml(config, "the run's config")
        policy = raw.get("policy") if isinstance(raw, dict) else None
        path = policy.get("path") if isinstance(policy, dict) else None
        if path:
            candidates.append(Path(path))
    for directory in candidates:
        if (directory / "tokenizer_config.json").exists():
            return directory
    looked = ", ".join(str(c) for c in candidates)
    raise ShowError(f"cannot find the run's tokenizer (looked in {looked})")


def load_decoder(run_dir: Path) -> Callable[[list[int]], str]:
    from policy.hf import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir(run_dir))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def header(record: dict) -> list[str]:
    """The facts of a trajectory, a few lines."""
    r, segs = record, segments(record)
    sampled = sum(s.end - s.start for s in segs if s.sampled)
    versions = sorted({v for s in segs for v in s.versions})
    fate = r["fate"] or "?"
    if r.get("advantage") is not None:
        fate += f" (advantage {r['advantage']:+.3f})"
    parts = ", ".join(f"{k} {v:+.3f}" for k, v in r["parts"].items()) or "none"
    retry = f" · attempt {r['attempt']}" if r.get("attempt", 1) > 1 else ""
    if r.get("resumed"):
        retry += f" · resumed {r['resumed']}x"
    return [
        f"trajectory {r['id']} · step {r['step']} · task {r['task']} · {fate}",
        f"reward {r['reward']:.3f} (terms: {parts}) · success {'yes' if r['success'] else 'no'}"
        f" · {r['status']} ({r['finish'] or 'no detail'}){retry}",
        f"{_n(r['turns'], 'turn')} · {_n(r['tool_calls'], 'tool call')} ({r['tool_errors']} "
        f"failed, {r['parse_errors']} unparsable) · {len(r['tokens'])} tokens: {sampled} "
        f"sampled (trained), {len(r['tokens']) - sampled} masked · policy {_versions(versions)}",
    ]


def titles(segs: list[Segment]) -> list[str]:
    """`prompt`, `turn 1`, `tool output / template`, `turn 2`, ... with counts and versions."""
    out, turn = [], 0
    for i, s in enumerate(segs):
        tokens = f"{s.end - s.start} tokens"
        if s.sampled:
            turn += 1
            out.append(f"turn {turn} · sampled · {tokens} · policy {_versions(list(s.versions))}")
        else:
            name = "prompt" if i == 0 else "tool output / template"
            out.append(f"{name} · masked · {tokens}")
    return out


def show(record: dict, decode: Callable[[list[int]], str], console: Console) -> None:
    for line in header(record):
        console.print(Text(line, style="bold"), soft_wrap=True)
    if console.is_terminal:
        console.print(Text("sampled: green (trained on) · masked: dim (never trained on)"))
    segs = segments(record)
    for seg, title in zip(segs, titles(segs), strict=True):
        console.rule(Text(title), style="green" if seg.sampled else "dim", align="left")
        text = decode(record["tokens"][seg.start : seg.end])
        console.print(Text(text, style="green" if seg.sampled else "dim"), soft_wrap=True)


def listing(records: list[dict], console: Console) -> None:
    console.print(Text("step  id                      reward  success  turns  tokens  fate"))
    for r in records:
        line = (
            f"{r['step']:>4}  {r['id']:<22}  {r['reward']:>6.3f}  "
            f"{'yes' if r['success'] else 'no':<7}  {r['turns']:>5}  {len(r['tokens']):>6}  "
            f"{r['fate']}"
        )
        console.print(Text(line), soft_wrap=True)


def run(args, console: Console | None = None) -> int:
    """`agentrl show` (rl/cli.py parses the flags)."""
    run_dir = Path(args.run_dir)
    try:
        records = read(run_dir)
    except (OSError, ValueError) as exc:
        raise ShowError(f"cannot read {run_dir / FILE}: {exc}") from None
    if not records and not (run_dir / FILE).exists() and not (run_dir / "config.yaml").exists():
        raise ShowError(
            f"{run_dir} is not a run directory (no config.yaml, no {FILE}); pass one made by "
            "agentrl train, e.g. runs/quickstart-YYYYmmdd-HHMMSS"
        )
    if not records:
        raise ShowError(
            f"{run_dir / FILE} is missing or empty: the run recorded no trajectories "
            "(metrics.trajectories is 0, or no step has finished yet)"
        )
    _check_records(records, run_dir / FILE)
    console = console or Console(highlight=False)
    if args.list:
        listing([r for r in records if args.step is None or r["step"] == args.step], console)
        return 0
    record = select(records, traj_id=args.id, step=args.step, worst=args.worst, best=args.best)
    try:
        show(record, load_decoder(run_dir), console)
    except (KeyError, TypeError, IndexError) as exc:
        where = f"{run_dir / FILE}: record {record.get('id')!r}"
        raise ShowError(f"{where} is malformed ({exc!r})") from None
    return 0


def _check_records(records: list, path: Path) -> None:
    """Every line a record of trajlog's shape (a file edited by hand, or cut off, is named)."""
    for line, rec in enumerate(records, 1):
        missing = [k for k in ("step", "id", "reward") if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ShowError(
                f"{path}: record {line} is not a trajectory record (missing {', '.join(missing)}); "
                "the file is written by agentrl train (metrics.trajectories)"
            )


def _versions(versions: list[int]) -> str:
    if not versions:
        return "-"
    return f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}-v{versions[-1]}"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "none"


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"
