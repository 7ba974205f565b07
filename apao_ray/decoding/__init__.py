"""Decoding: constrained beam search, exact full sorting, and evaluation (SPEC §4)."""
from .beam import BeamResult, beam_search
from .evaluate import PerUser, evaluate, evaluate_per_user
from .full_sort import full_sort, topk_from_scores

__all__ = ["BeamResult", "beam_search", "PerUser", "evaluate", "evaluate_per_user", "full_sort", "topk_from_scores"]
