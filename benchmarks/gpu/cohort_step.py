"""Whether fusing K trials into one batched model pays (issue #48 item 1, before the cohort is built).

K TIGER models of different seeds are stacked (``torch.func.stack_module_state``) and trained as one:
``vmap(functional_call)`` over the members, each on its own micro-batch of real Office samples, CE loss,
one AdamW over the stacked parameters (elementwise, so each member's update is its own). Timed against one
model trained alone on the same micro-batch size; the table gives samples/s of all members together and the
ratio to the solo model's samples/s. First it checks, in float32 on a few samples, that each member's logits
and gradients equal its model's trained alone (max abs differences printed).

What the fused path needs from the model, found here (2026-11-27, CPU): the padded history pass (packing sizes
tensors by the rows' lengths), no row groups (models/packing.row_groups reads lengths on a CPU), and on a CPU
scaled-dot-product attention's math backend (the fused CPU kernel has no gradient for a batched bias). The
rows of a member's micro-batch are padded to the longest history of all members.

    python benchmarks/gpu/cohort_step.py --data-dir datasets --cohorts 1,4,10,20 --json-out $OUT/cohort.json
    python benchmarks/gpu/cohort_step.py --device cpu --batch-size 32 --cohorts 1,3 --steps 2   # try it
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import apao_ray.models.tiger as tiger_module  # noqa: E402
from apao_ray.config import ModelConfig  # noqa: E402
from apao_ray.data import PAD_TOKEN, collate, load_dataset  # noqa: E402
from apao_ray.models import build_model  # noqa: E402
from apao_ray.protocol import with_end_token  # noqa: E402

tiger_module.row_groups = lambda *args, **kwargs: None  # see the docstring: no data-dependent groups under vmap


def plain_cpu_dropout() -> None:
    """On a CPU, the product's dropout kernels (models/dropout.py: autograd Functions without functorch
    support) replaced by ``F.dropout`` for this script, so vmap can run them; on a GPU they are F.dropout."""
    from types import SimpleNamespace

    import apao_ray.models.dropout as dropout_module

    dropout_module._Dropout = SimpleNamespace(apply=lambda x, p: F.dropout(x, p, True))
    dropout_module._ReluDropout = SimpleNamespace(apply=lambda x, p: F.dropout(F.relu(x), p, True))
    dropout_module._DropoutTo = SimpleNamespace(apply=lambda x, p, dtype: F.dropout(x, p, True).to(dtype))


def attention_backend(device: torch.device):
    """The math backend on a CPU (see the docstring); the device's own choice elsewhere."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def member_batches(dataset, k: int, batch_size: int, step: int, device: torch.device):
    """K micro-batches of different training samples, padded to one width: ids, mask, candidates (K, B, ...)."""
    split = dataset.splits["train"]
    rng = np.random.default_rng([k, step])
    batches = [collate(dataset.catalog, split, rng.choice(len(split), batch_size, replace=False)) for _ in range(k)]
    width = max(b.history_ids.shape[1] for b in batches)
    ids = torch.stack([F.pad(b.history_ids, (width - b.history_ids.shape[1], 0), value=PAD_TOKEN) for b in batches])
    sem = torch.as_tensor(dataset.catalog.sem_tokens)
    candidates = torch.stack([with_end_token(sem[b.target_sem[:, None]], True) for b in batches])
    return ids.to(device), (ids != PAD_TOKEN).to(device), candidates.to(device)


def ce(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Mean token CE of one member: logits (B, 1, T, V), candidates (B, 1, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), candidates.reshape(-1))


def models_of(k: int, dataset, device: torch.device) -> list[torch.nn.Module]:
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        model = build_model(ModelConfig(backbone="tiger"), dataset.catalog.vocab_size, dataset.catalog.num_levels)
        model.pack_histories = False
        models.append(model.to(device).train())
    return models


def check(dataset, device: torch.device) -> dict:
    """Three members in float32, dropout off: logits and gradients against each model alone."""
    models = models_of(3, dataset, device)
    for model in models:
        model.eval()  # dropout off: the streams of a fused and a solo model cannot match draw for draw
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    ids, mask, candidates = member_batches(dataset, 3, 8, 0, device)
    with attention_backend(device):
        logits = vmap(lambda p, b, i, m, c: functional_call(base, (p, b), (i, m, c)))(params, buffers, ids, mask,
                                                                                     candidates)
    sum(ce(logits[k], candidates[k]) for k in range(3)).backward()
    logit_diff = grad_diff = 0.0
    for k, model in enumerate(models):
        solo = model(ids[k], mask[k], candidates[k])
        logit_diff = max(logit_diff, (solo - logits[k]).abs().max().item())
        ce(solo, candidates[k]).backward()
        grad_diff = max(grad_diff, max((params[name].grad[k] - p.grad).abs().max().item()
                                       for name, p in model.named_parameters()))
    return {"max_logit_diff": logit_diff, "max_grad_diff": grad_diff}


def time_cohort(dataset, k: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Samples/s of K members trained as one (K = 0: one model alone, not fused)."""
    solo = k == 0
    models = models_of(max(k, 1), dataset, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    if solo:
        model = models[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    else:
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        optimizer = torch.optim.AdamW(params.values(), lr=5e-4, weight_decay=0.01)
        forward = vmap(lambda p, b, i, m, c: functional_call(base, (p, b), (i, m, c)), randomness="different")
    timings = []
    for step in range(args.steps + 1):  # the first is a warm-up
        ids, mask, candidates = member_batches(dataset, max(k, 1), args.batch_size, step, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with attention_backend(device), autocast:
            if solo:
                loss = ce(model(ids[0], mask[0], candidates[0]), candidates[0])
            else:
                logits = forward(params, buffers, ids, mask, candidates)
                loss = sum(ce(logits[m], candidates[m]) for m in range(k))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            timings.append(time.perf_counter() - start)
    seconds = float(np.median(timings))
    return {"members": max(k, 1), "fused": not solo, "step_seconds": seconds,
            "samples_per_second": max(k, 1) * args.batch_size / seconds,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--cohorts", default="1,4,10,20", help="members per fused model (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per member per step (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (default %(default)s)")
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="no bf16 autocast")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script (default %(default)s)")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        plain_cpu_dropout()
    dataset = load_dataset("office", args.data_dir, allow_download=False)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": vars(args), "check": check(dataset, device), "rows": []}
    print("equivalence (float32, 3 members, dropout off):", result["check"], flush=True)
    rows = [0] + [int(k) for k in args.cohorts.split(",")]
    for k in rows:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            row = time_cohort(dataset, k, args, device)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory at a large K: reported, the next runs
            row = {"members": k, "fused": True, "error": f"{type(error).__name__}: {error}"[:300]}
        result["rows"].append(row)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
        solo = result["rows"][0].get("samples_per_second")
        text = row.get("error") or (f"{row['step_seconds'] * 1e3:8.1f} ms/step {row['samples_per_second']:10.0f} "
                                    f"samples/s {row['samples_per_second'] / solo:6.2f}x solo "
                                    f"{row['peak_gpu_gib']:6.1f} GiB")
        print(f"{'solo' if k == 0 else f'K={k}':<6}{text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
