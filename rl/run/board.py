"""The run's weight board (async mode): the latest published weights, for a worker that starts
or restarts to fetch by itself (rl/run/fleet.py starts it and wraps its calls).

Import-free on purpose: the board's Ray process imports only this module, so it is up in well
under a second, and it only ever holds refs (below), so it never imports anything later either
(a module that imports torch kept it busy for ~3 s of a core, during the first step of every
async run, while the workers or the learner's first post waited for it).
"""

from __future__ import annotations


class WeightBoard:
    """The latest published weights, as a tiny named actor (`<run id>-weights`): the learner
    posts every publication, and a worker that starts or restarts fetches the latest itself
    instead of waiting for the next push. An older post never wins.

    A post is (version, held): `held` is [a ref to the Manifest, *the buckets' refs]. Refs
    nested in a list are never deserialized here, so this process never imports the Manifest's
    module (rl/run/weights.py imports torch: ~3 s of a core, which the learner's first post
    waited for). Holding the refs keeps that one version's objects alive."""

    def __init__(self) -> None:
        self.latest: tuple[int, list] | None = None

    def post(self, version: int, held: list) -> None:
        if self.latest is None or version > self.latest[0]:
            self.latest = (version, held)

    def get(self) -> tuple[int, list] | None:
        return self.latest
