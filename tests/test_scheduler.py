"""study/search/scheduler.py driven with synthetic results (no training, no Ray cluster): who is stopped when."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

METRIC = "best/val/ndcg_at_10"


def _trial(trial_id: str, loss: str, backbone: str = "tiger"):
    return SimpleNamespace(trial_id=trial_id, config={"backbone": backbone, "loss": loss})


def _report(scheduler, trial, epoch: int, value: float) -> str:
    return scheduler.on_trial_result(None, trial, {"training_iteration": epoch, "epoch": epoch, METRIC: value})


@pytest.fixture
def scheduler():
    from apao_ray.study.search.scheduler import PerMethodASHA

    # 5 epochs (max_t one past the last); rungs at epochs 1 and 4 (reduction factor 4)
    return PerMethodASHA(metric=METRIC, mode="max", max_t=6, grace_period=1)


def _add(scheduler, *trials):
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    return trials


def test_apao_trials_behind_ce_are_not_cut_by_ce(scheduler):
    """One ASHA over all trials stopped every APAO trial behind CE at the grace epoch."""
    from ray.tune.schedulers import TrialScheduler

    ce, apao = _add(scheduler, _trial("ce", "ce"), _trial("a1", "apao_pointwise"))
    assert _report(scheduler, ce, 1, 0.9) == TrialScheduler.CONTINUE
    assert _report(scheduler, apao, 1, 0.1) == TrialScheduler.CONTINUE  # first of its method: nothing to compare


def test_a_baseline_runs_to_the_end_however_far_behind(scheduler):
    from ray.tune.schedulers import TrialScheduler

    apao = _add(scheduler, *(_trial(f"a{k}", "apao_pointwise") for k in range(3)))
    ce, = _add(scheduler, _trial("ce", "ce"))
    for epoch in range(1, 6):
        for k, trial in enumerate(apao):
            _report(scheduler, trial, epoch, 0.8 + 0.01 * k)
        assert _report(scheduler, ce, epoch, 0.0) == TrialScheduler.CONTINUE, epoch


def test_within_a_method_the_weak_trial_is_pruned_and_its_epoch_recorded(scheduler):
    from ray.tune.schedulers import TrialScheduler

    from apao_ray.study.record.outcomes import pruned_epoch

    strong = _add(scheduler, *(_trial(f"p{k}", "apao_pointwise") for k in range(3)))
    weak, other_method = _add(scheduler, _trial("weak", "apao_pointwise"), _trial("pair", "apao_pairwise"))
    for k, trial in enumerate(strong):
        assert _report(scheduler, trial, 1, 0.5 + 0.1 * k) == TrialScheduler.CONTINUE
    # as weak as the pointwise one, but the only pairwise trial: compared with nobody
    assert _report(scheduler, other_method, 1, 0.1) == TrialScheduler.CONTINUE
    assert _report(scheduler, weak, 1, 0.1) == TrialScheduler.STOP  # below its method's rung cutoff
    assert pruned_epoch("weak") == 1 and pruned_epoch("pair") is None and pruned_epoch("p0") is None
    # the last epoch's report is not taken for the end (max_t is one past it), and the final (test) report
    # of a trial that reached the end is not a pruning, even where ASHA says stop
    scheduler.on_trial_complete(None, weak, {"training_iteration": 1, METRIC: 0.1})
    assert _report(scheduler, strong[2], 5, 0.8) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(None, strong[2], {"training_iteration": 6, "epoch": 6, METRIC: 0.8,
                                                       "done": True}) == TrialScheduler.STOP
    assert pruned_epoch("p2") is None


def test_a_resumed_trial_meets_the_rung_of_its_epoch_not_of_its_reports_since_the_restart(scheduler):
    """Tune's training_iteration restarts at 1 when a study resumes: the rungs must count epochs."""
    from ray.tune.schedulers import TrialScheduler

    from apao_ray.study.record.outcomes import pruned_epoch

    strong = _add(scheduler, *(_trial(f"s{k}", "apao_pointwise") for k in range(3)))
    for epoch in range(1, 5):  # weak at first (rung 1), strong by rung 4
        for k, trial in enumerate(strong):
            _report(scheduler, trial, epoch, (0.1 if epoch == 1 else 0.8) + 0.05 * k)
    resumed, = _add(scheduler, _trial("resumed", "apao_pointwise"))
    # its first report after the restart: iteration 1, epoch 4; 0.5 passes rung 1's cutoff, not rung 4's
    result = {"training_iteration": 1, "epoch": 4, METRIC: 0.5}
    assert scheduler.on_trial_result(None, resumed, result) == TrialScheduler.STOP
    assert pruned_epoch("resumed") == 4


def test_a_resumed_study_puts_its_trials_back_in_the_rungs_they_had_reached(tmp_path):
    """Tune saves no scheduler state: the rungs of a resumed study are rebuilt from the trials' reports."""
    import json

    from ray.tune.schedulers import TrialScheduler

    from apao_ray.names import REPORTS_FILE, train_run_name
    from apao_ray.study.search.scheduler import PerMethodASHA

    def write_reports(trial_id: str, values: list[float], final: bool = False) -> None:
        run_dir = tmp_path / train_run_name(trial_id)
        run_dir.mkdir()
        lines = [{"epoch": e, "training_iteration": e, METRIC: v} for e, v in enumerate(values, 1)]
        lines += [{"epoch": len(values), METRIC: 0.0, "done": True}] if final else []  # not a rung result
        (run_dir / REPORTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))

    for k in range(3):  # finished before the interruption
        write_reports(f"s{k}", [0.1, 0.8, 0.8, 0.8 + 0.05 * k, 0.9], final=True)
    write_reports("resumed", [0.1, 0.3, 0.4])  # stopped by the interruption after epoch 3
    scheduler = PerMethodASHA(metric=METRIC, mode="max", max_t=6, grace_period=1, train_root=tmp_path)
    resumed = _trial("resumed", "apao_pointwise")
    _add(scheduler, *(_trial(f"s{k}", "apao_pointwise") for k in range(3)), resumed)
    # its first report after the restart: compared with the others' epoch 4, which only their files still hold
    assert scheduler.on_trial_result(None, resumed, {"training_iteration": 1, "epoch": 4, METRIC: 0.5}) \
        == TrialScheduler.STOP
    # a fresh scheduler without the files would have let it through
    fresh = PerMethodASHA(metric=METRIC, mode="max", max_t=6, grace_period=1)
    _add(fresh, _trial("resumed", "apao_pointwise"))
    assert fresh.on_trial_result(None, resumed, {"training_iteration": 1, "epoch": 4, METRIC: 0.5}) \
        == TrialScheduler.CONTINUE


def test_a_pruned_trial_is_tested_on_a_checkpoint_the_scheduler_saw_not_one_saved_after_the_stop(tmp_path):
    """A worker can save epoch e+1 before the stop for epoch e reaches it; the tested checkpoint is the
    newest at or before the pruned epoch (its validation result is the one MLflow logged)."""
    from apao_ray.study.run.pruned import latest_checkpoint
    from apao_ray.names import train_run_name

    from apao_ray.training.checkpoint import save_checkpoint

    run_dir = tmp_path / train_run_name("t1") / "checkpoint_x"
    for epoch in (1, 2, 3):  # real (tiny) checkpoints: the reader verifies what it finds
        save_checkpoint(run_dir / f"epoch_{epoch:04d}", {"epoch": epoch}, {}, {})
    (run_dir / "epoch_0004-scratch").mkdir()  # a scratch dir, not a checkpoint
    assert latest_checkpoint(tmp_path, "t1", up_to_epoch=2) == str(run_dir / "epoch_0002")
    assert latest_checkpoint(tmp_path, "t1", up_to_epoch=1) == str(run_dir / "epoch_0001")
    assert latest_checkpoint(tmp_path, "t1") == str(run_dir / "epoch_0003")
    assert latest_checkpoint(tmp_path, "t1", up_to_epoch=0) is None
    assert latest_checkpoint(tmp_path, "nope") is None
