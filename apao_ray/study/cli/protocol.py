"""``--protocol`` and its per-knob flags, shared by ``studies/train.py`` and ``studies/sweep.py``.

Every knob flag defaults to None ("take the preset"), so an explicit flag beats the preset and
the resolved value is what the TrialConfig (hence MLflow params and checkpoints) records.
"""
from __future__ import annotations

import argparse

from ...config import PROTOCOL_NAMES, WEIGHTING_MODES, TrialConfig
from ...protocol import KNOBS, PRESET_HELP, PRESETS, apply_protocol, selectable_metrics
from ...cli.types import non_negative_float


def _preset_values(knob: str) -> str:
    return ", ".join(f"{name}: {values[knob]}" for name, values in PRESETS.items())


def add_protocol_arguments(parser: argparse.ArgumentParser, with_eta: bool = True) -> None:
    """Adds ``--protocol`` and one flag per knob of ``apao_ray.protocol.KNOBS``.

    Args:
        with_eta: add ``--eta`` too (train.py; sweep.py searches eta and has its own range flag).
    """
    group = parser.add_argument_group(
        "protocol", "which protocol the run follows (docs/PROTOCOLS.md); each knob flag beats the preset")
    group.add_argument("--protocol", choices=PROTOCOL_NAMES, default="paper",
                       help="; ".join(f"{name}: {text}" for name, text in PRESET_HELP.items()) + " (default paper)")
    group.add_argument("--select-by", help="what keeps the epoch, one of "
                       f"{', '.join(selectable_metrics(TrialConfig()))} (named at the default --beam-size): a "
                       "validation metric (higher is better), or 'loss': the lowest validation loss, i.e. the epoch's "
                       "training objective (APAO: CE + beta * weighted prefix loss) as the MEAN over the validation split "
                       "(the released code reads its last evaluation batch only); preset "
                       f"{_preset_values('select_by')}")
    group.add_argument("--weighting", choices=WEIGHTING_MODES,
                       help=f"APAO prefix weighting; preset {_preset_values('weighting')}")
    if with_eta:
        group.add_argument("--eta", type=non_negative_float,
                           help=f"adaptive-weight step size; preset {_preset_values('eta')}")
    group.add_argument("--label-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="labels = the 4 codes + EOS: CE averages 5 tokens, and a beam item's score adds "
                            f"log p(EOS | item); preset {_preset_values('label_eos')}")
    group.add_argument("--clip-summed-grad", action=argparse.BooleanOptionalAction, default=None,
                       help="clip (at 1.0) and step with the SUM of the accumulation steps' gradients, as "
                            "transformers 4.51 does with these models, instead of their mean; logged as "
                            f"train/grad_norm; preset {_preset_values('clip_summed_grad')}")
    group.add_argument("--llama-history-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="Llama only: an EOS between history and target; preset "
                            f"{_preset_values('llama_history_eos')}")
    group.add_argument("--pairwise-scale-plus-one", action=argparse.BooleanOptionalAction, default=None,
                       help="APAO pairwise: scale negatives by (P_m - 1) / (counted + 1) instead of / counted; "
                            f"preset {_preset_values('pairwise_scale_plus_one')}")


def apply_protocol_arguments(config: TrialConfig, args: argparse.Namespace, with_eta: bool = True) -> TrialConfig:
    """``config`` with ``args.protocol``'s preset, then every knob flag that was given.

    Args:
        with_eta: read ``args.eta`` as the eta knob (False for sweep.py, whose --eta is a search range).
    """
    knobs = [knob for knob in KNOBS if with_eta or knob != "eta"]
    return apply_protocol(config, args.protocol, {knob: getattr(args, knob, None) for knob in knobs})
