"""Own data: Office as an interactions CSV + item texts, indexed by the paper's file or by `python -m apao_ray tokenize`
(optionally --disambiguate), trained with the tests' tiny TIGER; validation Recall@10 per epoch on all users next
to the popularity baseline (benchmarks/RESULTS.md, 2026-11-23, evening). Reuses the tests' Office-as-a-table builder.

    APAO_DATA_DIR=../shared/datasets .venv/bin/python benchmarks/bench_tokenize_vs_popularity.py BATCH LR EPOCHS paper,tokenized,disamb
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests")); sys.path.insert(0, str(ROOT))
from test_own_data import office_as_table
from test_semantic_ids import popularity_recall_at_10
from conftest import TINY_MODEL
from apao_ray.data import load_dataset
from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
import torch
torch.set_num_threads(1)
batch, lr, epochs = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
kinds = sys.argv[4].split(",")
tmp = Path(f"/tmp/apao_tokenize_vs_popularity/b{batch}"); shutil.rmtree(tmp, ignore_errors=True); tmp.mkdir(parents=True)
out_json = tmp.parent / f"b{batch}_lr{lr}_e{epochs}.json"
out = {}
for kind in kinds:
    d = office_as_table(tmp / kind, with_index=(kind == "paper"))
    if kind != "paper":
        extra = ["--disambiguate"] if kind == "disamb" else []
        r = subprocess.run([sys.executable, "-m", "apao_ray", "tokenize", "--dataset", str(d), *extra], capture_output=True, text=True, cwd=ROOT)
        print(r.stdout[-600:], r.stderr[-600:], flush=True)
    ds = load_dataset(str(d))
    cfg = TrialConfig(DataConfig(dataset=str(d)), ModelConfig(backbone="tiger", **TINY_MODEL), LossConfig(name="ce"),
                      TrainConfig(epochs=epochs, batch_size=batch, effective_batch_size=batch, lr=lr, patience=epochs,
                                  precision="fp32", eval_max_users=None, retention_users=16))
    hooks = TrainingHooks(tmp / f"run-{kind}", verbose=False)
    run_trial(cfg, hooks, ds)
    curve = [round(r["val/recall_at_10"], 4) for r in hooks.reports if not r.get("done")]
    pop = popularity_recall_at_10(ds)
    out[kind] = {"val_recall10_per_epoch": curve, "popularity": round(pop, 4), "users": len(ds.splits["valid"])}
    print(kind, out[kind], flush=True)
out_json.write_text(json.dumps(out, indent=1))
print(f"wrote {out_json}")
