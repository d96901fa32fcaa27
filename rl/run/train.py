"""`train(cfg)`: the whole run on one screen: warm start -> evaluate -> RL steps -> evaluate.

`train(cfg, run_dir, resume=True)` continues a run from its latest checkpoint with the same step
counter, optimizer, RNG states and stream position.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import ray
import yaml

from policy.export import complete_export
from rl import faults
from rl.config.runfile import RunConfig
from rl.learner import ledger
from rl.observe import trajlog
from rl.observe.evaluate import EvalResult
from rl.observe.metrics import (
    MetricsLogger,
)
from rl.observe.trackers import closed_on_error, open_trackers
from rl.run.async_loop import async_train
from rl.run.build import prepare_policy
from rl.run.evals import evals_at_longest, fit_evals
from rl.run.runstate import RunState, load_latest, truncate_metrics
from rl.run.sync_loop import sync_train
from rl.run.weights import push_weights
from rollout.keys import RunKeys
from rollout.render import ChatRenderer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resume:
    """How to resume; the two switches exist for the resume test's negative controls."""

    rng: bool = True
    stream: bool = True


def make_run_dir(cfg: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = Path(cfg.output_dir) / f"{cfg.name}-{stamp}-{suffix}"
    run_dir.mkdir(parents=True)
    # injected faults (testing) hold for one invocation: a --resume must not repeat the fault
    # that stopped the run
    settings = cfg.model_dump(exclude={"testing"})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return run_dir


def train(cfg: RunConfig, run_dir: Path, resume: Resume | None = None) -> dict:
    from rl.run.actors import start_actors
    from rl.run.launch import services
    from rl.run.placement import check_cluster

    run_id = run_dir.name
    with services(cfg, run_dir) as svc:
        cfg = fit_evals(resolved_devices(cfg))  # eval.tasks within a task file's rows
        check_cluster(cfg)  # before any work: a request the cluster cannot meet fails now
        say(f"run directory: {run_dir}")
        if (banner := faults.banner(cfg.testing.faults)) is not None:
            logger.warning(banner)  # a test run: loud, before anything else happens
        checkpoint, state = load_latest(run_dir, rng=resume.rng) if resume else (None, None)
        svc.redis.delete(RunKeys(run_id).learner_stop)  # set when an earlier job stopped
        sft_report: dict[str, float] = {}
        # opened before SFT (a W&B login that fails, fails at once) and closed if the start fails
        with closed_on_error(open_trackers(cfg, run_dir)) as trackers:
            if state is None:
                state, sft_report = warm_start(cfg, run_dir)
            say(f"starting {cfg.rollout.num_workers} rollout workers and the learner on Ray")
            learner, workers = start_actors(cfg, Path(state.model_dir), svc.redis_url, run_id)
            if checkpoint is not None:
                restore(cfg, run_dir, checkpoint, state, learner, workers, resume)
            log = MetricsLogger(
                run_dir,
                client=svc.redis,
                stream=RunKeys(run_id).metrics,
                tensorboard=cfg.metrics.tensorboard,
                purge_step=state.step + 1 if checkpoint else None,
                trackers=trackers,
            )
        with log:  # closed at the end; on an error or Ctrl-C the trackers mark the run failed
            base_report = sft_report if checkpoint is None else None  # a fresh run: evals first
            final = rl_and_evals(
                cfg, run_dir, svc.redis, (learner, workers), log, state, base_report
            )
    algo = cfg.trainer.algorithm
    base = {mode: EvalResult(**r) for mode, r in state.base_evals.items()}
    summary = report({state.base_label: base, algo: final}, state.base_label, algo, run_dir)
    from rl.observe.plot import plot_run

    say(f"reward curve: {plot_run(run_dir)}")
    return summary


def rl_and_evals(
    cfg: RunConfig, run_dir: Path, redis, actors, log, state: RunState, base_report: dict | None
) -> dict:
    """A fresh run's evaluations of its starting policy (`base_report` not None: the SFT
    figures, maybe empty), the RL loop, the final evaluation and the final model; returns the
    final evaluation {mode: EvalResult}."""
    learner, workers = actors
    renderer = ChatRenderer(_tokenizer(state.model_dir))
    if base_report is not None:  # evaluations run at the curriculum's longest stage
        evals = evals_at_longest(cfg, workers, renderer, log, step=0, label=state.base_label)
        state.base_evals = {mode: r.to_dict() for mode, r in evals.items()}
        if base_report:
            report_sft(cfg, base_report, evals, log)
    if cfg.trainer.mode == "async":
        async_train(cfg, learner, workers, renderer, log, state, run_dir, redis)
    else:
        sync_train(cfg, learner, workers, renderer, log, state, run_dir)
    algo = cfg.trainer.algorithm
    final = evals_at_longest(cfg, workers, renderer, log, step=cfg.trainer.steps, label=algo)
    ray.get(learner.save_model.remote(str(run_dir / "final-model")))
    complete_export(run_dir / "final-model", _tokenizer(state.model_dir))  # policy/export.py
    return final


def resolved_devices(cfg: RunConfig) -> RunConfig:
    """`cfg` with trainer.device and rollout.device resolved against the GPUs Ray has."""
    from rl.run.devices import with_devices

    gpus = int(ray.cluster_resources().get("GPU", 0))
    out = with_devices(cfg, gpus, "the Ray cluster")
    say(
        f"devices: learner {out.trainer.device} (trainer.device: {cfg.trainer.device}), "
        f"rollout workers {out.rollout.device} (rollout.device: {cfg.rollout.device}); "
        f"{gpus} GPU(s) in Ray"
    )
    return out


UNTRAINED_START = (
    "sft.enabled is false and policy.path is not set: RL starts from a randomly initialised "
    "policy, which rarely earns a reward to learn from; set policy.path to a trained model (e.g. "
    "a run's sft-model) or sft.enabled: true"
)


def warm_start(cfg: RunConfig, run_dir: Path) -> tuple[RunState, dict[str, float]]:
    """A fresh policy, then (if enabled) SFT on the expert's demonstrations with TRL; returns
    the run state and the SFT figures on held-out demonstrations (rl/sft/check.py)."""
    model_dir = prepare_policy(cfg, run_dir)
    if not cfg.sft.enabled:
        if cfg.policy.path is None:
            logger.warning(f"!!! {UNTRAINED_START}")
        return RunState.start(cfg.seed, model_dir, "init"), {}
    from policy.hf import load_model
    from rl.run.devices import sft_device
    from rl.sft.check import heldout_report
    from rl.sft.warm_start import (
        expert_demonstrations,
        rehearsal_examples,
        release_gpu,
        run_sft,
        sft_examples,
    )

    tokenizer = _tokenizer(model_dir)
    demos = expert_demonstrations(
        cfg, cfg.sft.demonstrations, error_rate=cfg.sft.expert_error_rate, seed=cfg.seed
    )
    good = sum(d.outcome["success"] for d in demos)
    say(
        f"SFT warm start: {len(demos)} expert demonstrations ({good / len(demos):.0%} correct), "
        f"{cfg.sft.epochs:g} epochs with TRL SFTTrainer"
    )
    model = load_model(model_dir)
    examples = sft_examples(ChatRenderer(tokenizer), demos)
    if cfg.sft.copy_rehearsal:
        copies = round(len(demos) * cfg.sft.copy_rehearsal)
        examples += rehearsal_examples(tokenizer, copies, seed=cfg.seed)
        say(f"SFT rehearses copying: {copies} copy sequences among the examples")
    device = sft_device(cfg)
    stats = run_sft(cfg, model, tokenizer, examples, run_dir / "sft", device=device)
    out = run_dir / "sft-model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = heldout_report(cfg, model, ChatRenderer(tokenizer))
    if device == "cuda":  # the learner and the workers may use this GPU next
        release_gpu(model)
    say(
        f"SFT done in {stats['sft/seconds']:.0f} s (mean loss {stats['sft/loss']:.3f}; token "
        f"accuracy on held-out demonstrations {report['sft/token_accuracy']:.1%}; random spans "
        f"copied {report['sft/copy_accuracy']:.1%})"
    )
    return RunState.start(cfg.seed, out, "sft"), {**stats, **report}


def report_sft(cfg: RunConfig, report: dict, evals: dict, log: MetricsLogger) -> None:
    """The SFT figures as one metrics record, and a warning for each sign that SFT did not take."""
    from rl.sft.check import diagnose

    warnings = diagnose(cfg, report, evals)
    log.log(0, report, phase="sft")
    if "sft/tool_call_ok" in report:
        say(
            f"after SFT: {report['sft/tool_call_ok']:.0%} of tool calls ran without an error, "
            f"greedy success {report['sft/greedy_success']:.0%} (expert "
            f"{report['sft/expert_success']:.0%})"
        )
    for text in warnings:
        logger.warning(f"!!! {text}")


def rerun_final_eval(cfg: RunConfig) -> int | None:
    """The step whose evaluation records a resume replaces (the last: from its checkpoint the
    final evaluation runs again), or None when this resume evaluates nothing (eval.tasks 0: the
    records already there are the only ones)."""
    return cfg.trainer.steps if cfg.eval.tasks else None


def restore(
    cfg, run_dir: Path, checkpoint: Path, state: RunState, learner, workers, resume
) -> None:
    rewind = cfg.trainer.mode == "async"
    entries = ray.get(
        learner.load_checkpoint.remote(
            str(checkpoint), rng=resume.rng, stream=resume.stream, rewind=rewind
        )
    )
    push_weights(
        learner, workers, timeout_s=cfg.weights.push_timeout_s, transport=cfg.weights.transport
    )
    dropped = truncate_metrics(run_dir, state.step, final=rerun_final_eval(cfg))
    ledger.truncate(run_dir, state.step)
    trajlog.truncate(run_dir, state.step)
    fate = "will be trained (none is lost)" if rewind else "are discarded and will be redone"
    say(
        f"resumed from {checkpoint.name}: step {state.step}; {entries} stream entries after "
        f"it {fate}; {dropped} metric records after it are redone"
    )


def report(evals: dict[str, dict[str, EvalResult]], base: str, algo: str, run_dir: Path) -> dict:
    """Print the before/after table and write summary.json."""
    lines = ["", "Held-out evaluation (success rate, 95% Wilson interval, clustered by task)"]
    for label, results in evals.items():
        for mode, result in results.items():
            lines.append(f"  after {label.upper():<7} {mode:<28} {result}")
    summary = {label: {m: r.to_dict() for m, r in res.items()} for label, res in evals.items()}
    mode_after = next((m for m in evals.get(algo, {}) if m.startswith("sampled")), None)
    mode_before = next((m for m in evals.get(base, {}) if m.startswith("sampled")), None)
    if mode_after and mode_before:  # a resume may have changed eval.samples or the temperature
        before, after = evals[base][mode_before], evals[algo][mode_after]
        separated = after.ci_low > before.ci_high
        verdict = "beyond the intervals" if separated else "NOT beyond the intervals"
        differ = f" (settings differ: {mode_before} before)" if mode_before != mode_after else ""
        lines.append(
            f"{algo.upper()} vs {base.upper()} (sampled): "
            f"{100 * (after.success - before.success):+.1f} points, {verdict}{differ}"
        )
        summary["rl_beats_base_beyond_intervals"] = separated
    logger.info("\n".join(lines))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _tokenizer(model_dir):
    from policy.hf import load_tokenizer

    return load_tokenizer(model_dir)


def say(text: str) -> None:
    """A progress line for the console (`[agentrl] text` under the CLI; rl/observe/console.py)."""
    logger.info(text)
