"""The paper's Table 1 (SPEC §6): test Recall@10 / NDCG@10 with beam 20, after the paper's schedule."""
from __future__ import annotations

# (dataset, backbone, loss) -> (Recall@10, NDCG@10)
TABLE1: dict[tuple[str, str, str], tuple[float, float]] = {
    ("office", "tiger", "ce"): (0.0608, 0.0292), ("grocery", "tiger", "ce"): (0.0775, 0.0403),
    ("beauty", "tiger", "ce"): (0.0611, 0.0318),
    ("office", "tiger", "apao_pointwise"): (0.0667, 0.0337), ("grocery", "tiger", "apao_pointwise"): (0.0815, 0.0419),
    ("beauty", "tiger", "apao_pointwise"): (0.0637, 0.0332),
    ("office", "tiger", "apao_pairwise"): (0.0671, 0.0337), ("grocery", "tiger", "apao_pairwise"): (0.0811, 0.0418),
    ("beauty", "tiger", "apao_pairwise"): (0.0639, 0.0339),
    ("office", "llama", "ce"): (0.0469, 0.0236), ("grocery", "llama", "ce"): (0.0647, 0.0343),
    ("beauty", "llama", "ce"): (0.0516, 0.0274),
    ("office", "llama", "apao_pointwise"): (0.0559, 0.0265), ("grocery", "llama", "apao_pointwise"): (0.0701, 0.0379),
    ("beauty", "llama", "apao_pointwise"): (0.0564, 0.0300),
    ("office", "llama", "apao_pairwise"): (0.0557, 0.0269), ("grocery", "llama", "apao_pairwise"): (0.0741, 0.0390),
    ("beauty", "llama", "apao_pairwise"): (0.0548, 0.0293),
}
# Table 4 (TIGER, Office, one A100): seconds per epoch
SECONDS_PER_EPOCH_A100 = {"ce": 15, "apao_pointwise": 15, "sdpo": 199, "apao_pairwise": 163}


def table1(dataset: str, backbone: str, loss: str) -> tuple[float, float] | None:
    return TABLE1.get((dataset.lower(), backbone, loss))
