"""The study's Tune callbacks, always this session's, also after ``Tuner.restore``.

Tune pickles a run's callbacks when the run first starts, and ``Tuner.restore`` brings those pickles back;
Ray 2.60 has no public way to hand a restored run new ones (ray-project/ray#41364). The study's callbacks
hold a live MLflow client, the parent run, the tracking URI and a progress clock, which must be this
session's. So the run config holds a ``LiveCallbacks`` that pickles nothing but a key and forwards every
hook to the callbacks registered under that key in this process (``register``): the driver registers its
fresh callbacks before it creates or restores the Tuner.
"""
from __future__ import annotations

from typing import Any

from ray.tune import Callback

_LIVE: dict[str, list[Callback]] = {}


def register(key: str, callbacks: list[Callback]) -> None:
    """This process's callbacks for the run known by ``key`` (its directory): what its LiveCallbacks call."""
    _LIVE[key] = list(callbacks)


class LiveCallbacks(Callback):
    # Tune's metaclass then checks that every hook below is defined: a hook added in a later Ray is an
    # error at import, not a silently dropped event
    IS_CALLBACK_CONTAINER = True

    def __init__(self, key: str):
        self.key = key

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.key = state["key"]

    @property
    def callbacks(self) -> list[Callback]:
        try:
            return _LIVE[self.key]
        except KeyError:
            raise RuntimeError(f"no callbacks registered for study {self.key!r} in this process: the driver "
                               "calls register(key, callbacks) before it creates or restores the Tuner") from None

    def _each(self, hook: str, info: dict[str, Any]) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(**info)

    def setup(self, **info: Any) -> None:
        self._each("setup", info)

    def on_step_begin(self, **info: Any) -> None:
        self._each("on_step_begin", info)

    def on_step_end(self, **info: Any) -> None:
        self._each("on_step_end", info)

    def on_trial_start(self, **info: Any) -> None:
        self._each("on_trial_start", info)

    def on_trial_restore(self, **info: Any) -> None:
        self._each("on_trial_restore", info)

    def on_trial_save(self, **info: Any) -> None:
        self._each("on_trial_save", info)

    def on_trial_result(self, **info: Any) -> None:
        self._each("on_trial_result", info)

    def on_trial_complete(self, **info: Any) -> None:
        self._each("on_trial_complete", info)

    def on_trial_recover(self, **info: Any) -> None:
        self._each("on_trial_recover", info)

    def on_trial_error(self, **info: Any) -> None:
        self._each("on_trial_error", info)

    def on_checkpoint(self, **info: Any) -> None:
        self._each("on_checkpoint", info)

    def on_experiment_end(self, **info: Any) -> None:
        self._each("on_experiment_end", info)


def run_callbacks(key: str) -> list[Any]:
    """A Tune run config's callbacks: the ones registered under ``key`` behind a ``LiveCallbacks`` (so that
    a restored run calls this session's, see live_callbacks.py), and Tune's CSV and JSON result files."""
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    return [LiveCallbacks(key), CSVLoggerCallback(), JsonLoggerCallback()]
