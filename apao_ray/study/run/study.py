"""``Study``: a study ready to run (spec, setup, plan and the command line), what the driver and the repeats
phase both take."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types only: a study is made from them, never makes them
    from ..plan.plan import Plan
    from ..setup import StudySetup
    from ..spec.study import StudySpec


def invocation(argv: list[str]) -> list[str]:
    """The command as a user would type it again: ``python -m apao_ray sweep ...`` rather than the absolute
    path of ``apao_ray/__main__.py`` that ``sys.argv[0]`` holds under ``-m``."""
    if argv and Path(argv[0]).parts[-2:] == ("apao_ray", "__main__.py"):
        return ["python", "-m", "apao_ray", *argv[1:]]
    return list(argv)


@dataclass(frozen=True)
class Study:
    """A study ready to run, from its three sources, none repeating another:

    * ``spec``: what the user asked (``spec.study.StudySpec``): the user's choices (address, GPUs, failures,
      overwrite, retry, the budget, the Optuna storage as given);
    * ``setup``: what checking it found (``study.setup.StudySetup``): the dataset, every trial's config as
      asked, the study's name, paths and URIs, the CPUs per trial;
    * ``plan``: what fits (``plan.plan.Plan``): the trials' schedule (``plan.base``, ``plan.search``), slots,
      ASHA's grace period, the repeat seeds, and the record the parent run keeps.
    """

    spec: StudySpec
    setup: StudySetup
    plan: Plan
    command_line: list[str] = field(default_factory=lambda: invocation(sys.argv))

    @property
    def study_dir(self) -> str:
        return self.setup.study_dir

    @property
    def seeds(self) -> list[int]:
        """The search's seed, then the repeats'."""
        return [self.plan.base.train.seed, *self.plan.run_repeat_seeds]
