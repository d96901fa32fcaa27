"""Did the SFT warm start take? Figures after SFT, and warnings in plain words with what to change.

- token accuracy: the SFT model's greedy next-token accuracy on the assistant tokens of held-out
  demonstrations (the expert without deliberate errors, seeds disjoint from the SFT set);
- tool calls that ran: of the tool calls the model attempted in the post-SFT evaluation, the
  share that parsed, named a tool, had valid arguments and did not raise;
- imitation: greedy success after SFT against the expert's own success on held-out tasks;
- copying: the share of random spans the SFT model copies (the copy warm-up's task, held-out
  sequences), which SFT on demonstrations alone erodes (`sft.copy_rehearsal` keeps it).
"""

from __future__ import annotations

import torch

from rl.config.runfile import RunConfig
from rl.observe.evaluate import EvalResult

HELDOUT_DEMOS = 32
HELDOUT_SEED = 7_000_003  # disjoint from the SFT demonstrations' seeds
HELDOUT_COPIES = 64
_COPY_FLOOR = 0.5  # with the copy warm-up on, less than this after SFT is a warning


@torch.no_grad()
def token_accuracy(model, examples: list[dict[str, list[int]]]) -> float:
    """Greedy next-token accuracy on the assistant tokens (assistant_masks) of `examples`."""
    was_training = model.training
    model.eval()
    correct = total = 0
    param = next(model.parameters(), None)
    device = "cpu" if param is None else param.device  # the model's (after SFT on a GPU: it)
    for example in examples:
        ids = torch.tensor([example["input_ids"]], device=device)  # [1, T]
        mask = torch.tensor(example["assistant_masks"][1:], dtype=torch.bool, device=device)
        predicted = model(input_ids=ids).logits[0, :-1].argmax(-1)  # [T-1]
        correct += int((predicted[mask] == ids[0, 1:][mask]).sum())
        total += int(mask.sum())
    model.train(was_training)
    return correct / max(total, 1)


def heldout_report(cfg: RunConfig, model, renderer) -> dict[str, float]:
    """Token accuracy on held-out expert demonstrations, the expert's success on them, and the
    share of held-out random spans the model copies."""
    from rl.sft.warm_start import expert_demonstrations, rehearsal_examples, sft_examples

    demos = expert_demonstrations(cfg, HELDOUT_DEMOS, error_rate=0.0, seed=HELDOUT_SEED)
    copies = rehearsal_examples(renderer.tokenizer, HELDOUT_COPIES, seed=HELDOUT_SEED)
    return {
        "sft/token_accuracy": token_accuracy(model, sft_examples(renderer, demos)),
        "sft/expert_success": sum(d.outcome["success"] for d in demos) / len(demos),
        "sft/copy_accuracy": token_accuracy(model, copies),
    }


_TRUNCATED = 0.2  # a larger share of truncated post-SFT episodes is a warning of its own

# Measured (docs/environments.md, "Starting from the template"): a policy that fits the
# demonstrations' tokens yet fails the tasks usually misses the one span it must copy.
_COPYING = (
    "It predicts {accuracy:.0%} of the demonstrations' tokens, so it is most likely missing "
    "the few it must copy (a name from the question, a tool's result): `agentrl show RUN_DIR "
    "--worst` shows which. More epochs (sft.epochs) usually teach a dense policy the copy; a "
    "fresh K3 policy learns it first from the copy warm-up (policy.copy_warmup_steps: 3000), "
    "and a larger policy did not in our probes."
)


def diagnose(cfg: RunConfig, report: dict[str, float], evals: dict[str, EvalResult]) -> list[str]:
    """Adds the evaluation figures to `report` and returns warnings (empty: SFT took)."""
    greedy = evals.get("greedy") or next(iter(evals.values()), None)
    warnings = []
    accuracy = report.get("sft/token_accuracy")
    bigger = (
        f"more demonstrations (sft.demonstrations, now {cfg.sft.demonstrations}), more epochs "
        f"(sft.epochs, now {cfg.sft.epochs:g}) or a larger policy (policy.config: hidden_size, "
        "num_hidden_layers)"
    )
    if accuracy is not None and accuracy < 0.9:
        warnings.append(
            f"SFT did not fit the demonstrations: token accuracy on held-out ones is "
            f"{accuracy:.0%} (want 90%+). Try {bigger}."
        )
    copied = report.get("sft/copy_accuracy")
    if cfg.policy.copy_warmup_steps and copied is not None and copied < _COPY_FLOOR:
        warnings.append(
            f"SFT erased the copying the warm-up taught: the SFT model copies {copied:.0%} of "
            f"random spans. Mix copy sequences into SFT (sft.copy_rehearsal, now "
            f"{cfg.sft.copy_rehearsal:g}; 0.25 kept k3-tiny at 84% where 0 left 7%, spans at "
            "the sequence's start), and compare held-out success with and without it."
        )
    if greedy is None:
        return warnings
    report.update(
        {
            "sft/tool_call_ok": greedy.tool_call_ok,
            "sft/greedy_success": greedy.success,
            "sft/truncated": greedy.truncated,
        }
    )
    if greedy.tool_calls and greedy.tool_call_ok < 0.8:
        warnings.append(
            f"after SFT only {greedy.tool_call_ok:.0%} of the policy's {greedy.tool_calls} tool "
            f"calls ran without an error (unparsable, unknown tool, bad arguments, or the tool "
            f"raised). Try {bigger}; `agentrl show RUN_DIR --worst` shows what it writes."
        )
    expert = report.get("sft/expert_success", 1.0)
    copying = (accuracy or 0) >= 0.95 and greedy.truncated <= _TRUNCATED  # not a turn cut off
    if greedy.success < 0.5 * expert:
        warnings.append(
            f"after SFT the policy solves {greedy.success:.0%} of held-out tasks greedily, the "
            f"expert {expert:.0%}: RL has little to start from. "
            + (_COPYING.format(accuracy=accuracy) if copying else f"Try {bigger}.")
        )
    if greedy.truncated > _TRUNCATED:
        warnings.append(
            f"{greedy.truncated:.0%} of the post-SFT evaluation episodes were truncated: raise "
            f"rollout.max_new_tokens (now {cfg.rollout.max_new_tokens}) if turns are cut off, or "
            f"rollout.max_turns (now {cfg.rollout.max_turns}) and env.kwargs.max_turns if "
            "episodes run out of turns."
        )
    return warnings
