"""A loss defined here, outside the package, with a knob no loss of the package has (``gamma``): declared once on
its class, it is searched, passed to the loss, logged and reported with nothing else edited.

Run as a plugin (``APAO_PLUGINS=test_toy_loss``, tests/ on PYTHONPATH) this module registers the loss when it is
imported, in the study's driver, its probes and its Ray workers; inside pytest the ``toy_loss`` fixture registers
it for one test only, so the package's registry stays as the other tests expect it.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from apao_ray.losses import LOSSES, Knob, Loss, LossOutput, register
from apao_ray.losses.registry import at_least_float32
from apao_ray.names import PLUGINS_ENV
from losses_helpers import catalog, make_inputs  # noqa: F401  (catalog: a fixture)

NAME, KNOB = "toy_smooth", "gamma"
PAPER_GAMMA = 0.05  # its "paper setting" on Office, hence on synthetic data too


class ToySmoothLoss(Loss):
    """CE with label smoothing: (1 - gamma) L_CE + gamma x the mean over the vocabulary of -log p(v)."""

    display_name = "CE-smooth"
    help = "CE with label smoothing gamma (a test's plugin loss)"
    knobs = (Knob(KNOB, 0.01, 0.3, 0.1, log=True, help="label smoothing weight"),)
    paper_settings = {"tiger": {"office": {KNOB: PAPER_GAMMA}}}

    def __call__(self, inputs):
        self.check_candidates(inputs)
        loss_ce = -self.token_log_probs(inputs, num_candidates=1)[:, 0].mean()
        uniform = -torch.log_softmax(at_least_float32(inputs.logits[:, 0]), dim=-1).mean()  # (B, T, V) -> ()
        gamma = self.knob(KNOB)
        loss = (1 - gamma) * loss_ce + gamma * uniform
        return LossOutput(loss=loss, metrics={"loss": loss.detach(), "loss_ce": loss_ce.detach()})


if __name__ in os.environ.get(PLUGINS_ENV, "").split(","):
    register(NAME)(ToySmoothLoss)


@pytest.fixture
def toy_loss():
    if NAME in LOSSES:  # imported as a plugin already
        yield LOSSES[NAME]
        return
    register(NAME)(ToySmoothLoss)
    try:
        yield ToySmoothLoss
    finally:
        LOSSES.pop(NAME)


def test_a_knob_declared_only_on_the_class_is_searched_passed_to_the_loss_and_logged(toy_loss, catalog):
    import optuna

    from apao_ray.config import LossConfig, TrialConfig
    from apao_ray.losses import build_loss
    from apao_ray.study.record.mlflow_callback import child_params
    from apao_ray.study.spec.space import SearchSpec, is_baseline, param_name, trial_choices, trial_config

    spec = SearchSpec(("tiger",), ("ce", NAME), trials_per_tuned=4, dataset="synthetic")
    assert not is_baseline(NAME) and spec.allocation()[:2] == [("tiger", "ce", False), ("tiger", NAME, True)]
    param = param_name("tiger", NAME, KNOB)
    assert spec.points_to_evaluate() == [{}, {param: PAPER_GAMMA}]  # synthetic data: the Office setting
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for point in spec.points_to_evaluate():
        study.enqueue_trial(point)
    define_by_run, configs = spec.define_by_run(), []
    for _ in range(spec.num_trials):
        trial = study.ask()
        configs.append({**define_by_run(trial), **trial.params})
        study.tell(trial, 0.0)
    toy = [c for c in configs if c["loss"] == NAME]
    assert [c[param] for c in toy][0] == PAPER_GAMMA and len({c[param] for c in toy}) == 4
    assert all(0.01 <= c[param] <= 0.3 for c in toy)
    assert isinstance(study.trials[2].distributions[param], optuna.distributions.FloatDistribution)
    assert study.trials[2].distributions[param].log  # the Knob's scale

    config = trial_config(TrialConfig(), toy[1])
    assert config.loss.name == NAME and config.loss.extra == {KNOB: toy[1][param]}
    # the MLflow param `gamma`, shown to 3 significant digits (the trial trains on the exact value above)
    assert child_params(config, trial_choices(toy[1]))[KNOB] == float(f"{toy[1][param]:.3g}") != toy[1][param]
    assert KNOB not in child_params(config, trial_choices(toy[1]))["base"]["loss"]["extra"]
    assert TrialConfig.from_dict(config.to_dict()) == config  # checkpoints and resume round-trip it
    old = TrialConfig().to_dict()
    del old["loss"]["extra"]  # a config written before extra knobs existed
    assert TrialConfig.from_dict(old).loss.extra == {}

    loss_fn = build_loss(config.loss, catalog.tensors())
    assert loss_fn.knob(KNOB) == toy[1][param]
    assert build_loss(LossConfig(name=NAME), catalog.tensors()).knob(KNOB) == 0.1  # not given: the Knob's default

    narrowed = SearchSpec(("tiger",), (NAME,), knob_ranges={KNOB: (0.1, 0.2)}, trials_per_tuned=2)
    assert narrowed.points_to_evaluate() == [{param: 0.1}]  # the paper setting clipped to the range searched
    with pytest.raises(ValueError, match=r"none of the losses \['ce'\] tunes 'gamma'"):
        SearchSpec(("tiger",), ("ce",), knob_ranges={KNOB: (0.1, 0.2)})
    with pytest.raises(ValueError, match="log scale"):
        SearchSpec(("tiger",), (NAME,), knob_ranges={KNOB: (0.0, 0.2)})


def test_the_loss_trains_down_with_its_knob(toy_loss, catalog):
    """The toy loss is a real objective: gradient steps on the logits lower it, and its gamma is the one given."""
    from apao_ray.config import LossConfig
    from apao_ray.losses import build_loss

    inputs = make_inputs(catalog, 4, 0, seed=1)
    low, high = (build_loss(LossConfig(name=NAME).with_knobs({KNOB: g}), catalog.tensors()) for g in (0.01, 0.3))
    assert not torch.isclose(low(inputs).loss, high(inputs).loss)
    optimizer = torch.optim.SGD([inputs.logits], lr=1.0)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        output = high(inputs)
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    assert losses[-1] < 0.85 * losses[0] and losses == sorted(losses, reverse=True)


def test_registered_losses_declare_their_facts():
    """Every loss of the package says what a study needs from it, and the paper's Table 5 per dataset."""
    assert {name for name, loss in LOSSES.items() if loss.needs_ce_stage} == {"dpo", "dmpo", "sdpo"}
    assert {name for name, loss in LOSSES.items() if loss.uses_negatives} == {"apao_pairwise", "dpo", "dmpo", "sdpo",
                                                                                "ce_sdpo"}
    assert {name: [k.name for k in loss.knobs] for name, loss in LOSSES.items() if loss.knobs} == {
        "apao_pointwise": ["beta", "eta"], "apao_pairwise": ["beta", "eta", "num_negatives"],
        "ce_sdpo": ["beta", "num_negatives"], "dmpo": ["num_negatives"], "sdpo": ["num_negatives"],
        "bear": ["bear_b", "bear_xi", "bear_lambda"], "token_weighted": ["front_alpha"]}
    assert all(loss.display_name and loss.help for loss in LOSSES.values())
    pointwise, pairwise = LOSSES["apao_pointwise"], LOSSES["apao_pairwise"]
    assert pointwise.paper_point("tiger", "grocery") == {"beta": 0.1, "eta": 5e-5}
    assert pointwise.paper_point("llama", "Beauty") == {"beta": 0.3, "eta": 1e-4}
    assert pairwise.paper_point("tiger", "synthetic") == {"beta": 0.2, "eta": 3e-5, "num_negatives": 100}  # Office's
    assert LOSSES["sdpo"].paper_point("tiger", "office") == {"num_negatives": 100}  # no setting: the knob's default


def test_knob_flag_on_the_command_line_reaches_the_study_spec(toy_loss):
    """``--knob`` is an append option: the command's check of which flags were written must not break it."""
    from apao_ray.study.cli import sweep as cli_sweep

    parser = cli_sweep.build_parser()
    argv = ["--smoke", "--losses", f"ce,{NAME}", "--knob", f"{KNOB}=0.05:0.2"]
    given = cli_sweep.given_flags(parser, argv)
    assert {"knob_ranges", "losses", "smoke"} <= given and "epochs" not in given
    args = parser.parse_args(argv)
    cli_sweep.apply_quick(args, given)
    spec = cli_sweep.spec_from_args(args)
    assert spec.knob_ranges == {KNOB: (0.05, 0.2)}
    assert cli_sweep.given_flags(parser, ["--smoke"]) == {"smoke"}  # not written: no knob range


def test_every_knob_takes_one_route_and_its_range_comes_from_its_class(toy_loss, monkeypatch):
    """--knob works for the paper's knobs too, --beta/--eta/--negatives are its aliases, and a range not given is
    the loss class's Knob range: changing the Knob changes the study."""
    import dataclasses

    from apao_ray.losses.apao import APAOPointwiseLoss
    from apao_ray.study.cli import sweep as cli_sweep
    from apao_ray.study.run.driver import space_param

    parser = cli_sweep.build_parser()

    def search(*flags):
        argv = ["--smoke", "--losses", f"ce,apao_pointwise,{NAME}", *flags]
        args = parser.parse_args(argv)
        cli_sweep.apply_quick(args, cli_sweep.given_flags(parser, argv))
        return cli_sweep.spec_from_args(args).search

    by_knob = search("--knob", "beta=0.1:0.5", "--knob", "eta=1e-5:1e-4", "--knob", f"{KNOB}=0.02:0.2")
    by_alias = search("--beta", "0.1:0.5", "--eta", "1e-5:1e-4", "--knob", f"{KNOB}=0.02:0.2")
    assert by_knob == by_alias and space_param(by_knob) == space_param(by_alias)
    assert (by_knob.range_named("beta"), by_knob.range_named(KNOB)) == ((0.1, 0.5), (0.02, 0.2))
    plain = search()
    assert plain.range_named("beta") == (0.05, 0.4) and plain.range_named(KNOB) == (0.01, 0.3)  # the Knobs' own
    wider = tuple(dataclasses.replace(k, high=0.6) if k.name == "beta" else k for k in APAOPointwiseLoss.knobs)
    monkeypatch.setattr(APAOPointwiseLoss, "knobs", wider)
    assert search().range_named("beta") == (0.05, 0.6)


def test_train_sets_any_knob_its_loss_declares(toy_loss):
    """``train --knob``: a plugin's knob reaches the loss; the paper's knobs take the same route, eta over the
    protocol's preset, an integer knob as an int."""
    from apao_ray.study.cli.train import build_parser, trial_config_from_args

    def loss(*flags):
        return trial_config_from_args(build_parser().parse_args(["--smoke", *flags])).loss

    assert loss("--loss", NAME, "--knob", f"{KNOB}=0.2").extra == {KNOB: 0.2}
    pointwise = loss("--loss", "apao_pointwise", "--knob", "beta=0.3", "--knob", "eta=2e-5")
    assert (pointwise.beta, pointwise.eta) == (0.3, 2e-5)  # the paper preset's eta is 1e-4
    pairwise = loss("--loss", "apao_pairwise", "--knob", "num_negatives=40")
    assert pairwise.num_negatives == 40 and isinstance(pairwise.num_negatives, int)
    assert loss("--loss", "apao_pairwise", "--num-negatives", "40") == pairwise  # the alias


def test_an_unknown_plugin_module_is_named():
    from apao_ray.losses import import_plugins

    with pytest.raises(ModuleNotFoundError, match=f"{PLUGINS_ENV} names the module 'no_such_losses'"):
        import_plugins("no_such_losses")


def _plugin_env() -> dict[str, str]:
    from conftest import ROOT

    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), PLUGINS_ENV: "test_toy_loss"}


@pytest.mark.parametrize("command, flag", [("sweep", "--losses"), ("train", "--loss")])
def test_help_lists_every_loss_the_command_accepts_plugins_included(command, flag, tmp_path):
    from conftest import run_script

    from apao_ray.losses import LOSSES

    result = run_script(["-m", "apao_ray", command, "--help"], cwd=tmp_path, env=_plugin_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    entry = help_text[help_text.index(f"{flag} {flag[2:].upper()} "):]
    listed = entry[:entry.index("(default")]
    for name in [*LOSSES, NAME]:
        assert f" {name}," in listed or f" {name} " in listed, (name, listed)


@pytest.mark.e2e
def test_dry_run_plans_the_plugin_loss_as_a_tuned_method(tmp_path):
    from conftest import run_script

    result = run_script(["-m", "apao_ray", "sweep", "--smoke", "--losses", f"ce,{NAME}", "--num-samples", "2", "--output-dir",
                         str(tmp_path / "runs"), "--dry-run", "--json"], cwd=tmp_path, env=_plugin_env(),
                        timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    methods = {m["loss"]: m for m in json.loads(result.stdout.strip().splitlines()[-1])["methods"]}
    assert methods[NAME]["search_trials"] == 2  # the plugin's own paper setting first (no Table 5 row for synthetic)
    assert methods[NAME]["reason"] == (f"first trial the paper's Office setting (none for synthetic), gamma "
                                       f"{PAPER_GAMMA:g}; then Optuna TPE + ASHA")
    assert methods["ce"]["reason"] == "baseline, runs once"


@pytest.mark.e2e
def test_smoke_study_tunes_and_reports_the_plugin_knob(tmp_path):
    from conftest import mlflow_sqlite, run_script

    from apao_ray.tracking import Tracker

    uri, env = mlflow_sqlite(tmp_path), _plugin_env()
    result = run_script(["-m", "apao_ray", "sweep", "--smoke", "--losses", NAME, "--num-samples", "2",
                         "--knob", f"{KNOB}=0.04:0.2", "--epochs", "2", "--output-dir", str(tmp_path / "runs"),
                         "--tracking-uri", uri],
                        cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = [r for r in Tracker(uri, "apao-synthetic").child_runs() if r.data.tags.get("loss") == NAME]
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    # the two trials start together: the enqueued paper point and one draw from the range written with --knob,
    # not the Knob's own (0.01, 0.3)
    gammas = [float(r.data.params[KNOB]) for r in runs]
    assert sorted(g == PAPER_GAMMA for g in gammas) == [False, True] and all(0.04 <= g <= 0.2 for g in gammas)
    best = run_script(["-m", "apao_ray", "best", "--dataset", "synthetic", "--tracking-uri", uri, "--format", "json",
                       "--no-register"], cwd=tmp_path, env=env, timeout=300)
    assert best.returncode == 0, best.stderr[-3000:]
    row, = [r for r in json.loads(best.stdout) if r["loss"] == NAME]
    assert row[KNOB] in gammas and 0 <= row["test/ndcg_at_10"] <= 1 and row["test/recall_at_10"] is not None
    # without the plugin loaded, best still shows the knob the runs recorded (no loss here declares it)
    unloaded = {k: v for k, v in env.items() if k != PLUGINS_ENV}
    plain = run_script(["-m", "apao_ray", "best", "--dataset", "synthetic", "--tracking-uri", uri, "--no-register"],
                       cwd=tmp_path, env=unloaded, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    header = plain.stdout.splitlines()[0]
    assert f"| {KNOB} |" in header, header
