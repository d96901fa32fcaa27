"""What a run shows: metrics and trackers, console output, held-out evaluation with intervals,
trajectory records, `agentrl plot`, `agentrl show` and the `agentrl monitor` live view.

Imports rl.learner and rl.config from rl/, nothing above.
"""
