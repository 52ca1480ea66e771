"""What the layouts share, so each class states only what is its own: the checkpoint of a step is
named by `names.step_name`, a checkpoint needs only itself, and nothing is left to sweep. A chain
(reference.chain.layout) overrides the last two: its deltas need their ancestors, and pieces no
manifest uses are swept."""
from __future__ import annotations

from pathlib import Path

from .. import names


class LayoutBase:
    """The defaults of the layout protocol (kinds.Layout); `name` is set by the subclass."""

    name: str

    def path_for(self, directory: Path, step: int) -> Path:
        return directory / names.step_name(step, self.name)

    def needs(self, path: Path) -> tuple[str, ...]:
        return (path.name,)

    def sweep(self, directory: Path) -> list[Path]:
        return []
