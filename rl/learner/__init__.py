"""The learner: advantages, packing, losses and the sharded optimizer step, with its exactly-once
ledger and checkpoint files. `reference.grpo_step` is the whole algorithm on one screen.

Imports only rl.config (and rl.faults) from rl/.
"""
