"""The run's weight board (async mode): the latest published weights, for a worker that starts
or restarts to fetch by itself (rl/run/fleet.py starts it and wraps its calls).

Import-free on purpose: the board's Ray process imports only this module, so it is up in well
under a second (a module that imports torch kept it starting for ~3 s of a core, during the
first step of every async run, while the workers waited for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.run.weights import Manifest


class WeightBoard:
    """The latest published weights (a manifest and its object-store refs), as a tiny named
    actor (`<run id>-weights`): the learner posts every publication, and a worker that starts or
    restarts fetches the latest itself instead of waiting for the next push. Holding the refs
    keeps that one version's objects alive; an older post never wins."""

    def __init__(self) -> None:
        self.latest: tuple[Manifest, list] | None = None

    def post(self, manifest: Manifest, refs: list) -> None:
        if self.latest is None or manifest.version > self.latest[0].version:
            self.latest = (manifest, refs)

    def get(self) -> tuple[Manifest, list] | None:
        return self.latest
