"""Running a job: Ray + Redis services, actors, placement, the sync and async training loops,
weight pushes, run state and checkpoints, the curriculum, and why a run stopped.

The only room that imports ray (with rl.cli on top of it).
"""
