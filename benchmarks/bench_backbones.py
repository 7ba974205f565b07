"""Hand-written TIGER vs HuggingFace T5 on the pairwise workload, paper size, CPU.

Workload (SPEC §3 pairwise): B rows of left-padded history (L tokens), C = 1 + N candidates of
T codes each, teacher-forced logits of every candidate and backward of the summed label
log-probs. Ours encodes each row once and lets its C candidates read the cached cross-attention
K/V; ``transformers`` T5ForConditionalGeneration also encodes once (``encoder_outputs``) but
its decoder needs the encoder output repeated C times. Both get the same weights, and the
script first checks that they compute the same logits. A/B runs are interleaved (order
alternating per round) and medians reported.

    .venv/bin/python benchmarks/bench_backbones.py            # needs `pip install transformers`
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from apao_ray.data.catalog import BOS_TOKEN, EOS_TOKEN, NUM_SPECIAL_TOKENS, PAD_TOKEN
from apao_ray.reuse.export import tiger_to_t5  # the export's TIGER -> T5 weight mapping
from apao_ray.models import TigerBackbone, label_log_probs

NUM_LEVELS, CODES_PER_LEVEL = 4, 256
VOCAB = NUM_SPECIAL_TOKENS + NUM_LEVELS * CODES_PER_LEVEL  # 1027, the paper's size


def make_workload(batch: int, length: int, num_candidates: int, seed: int = 0):
    """Left-padded (B, L) histories of 1..(L-1)/T items + EOS, and (B, C, T) candidates."""
    generator = torch.Generator().manual_seed(seed)
    offsets = NUM_SPECIAL_TOKENS + torch.arange(NUM_LEVELS) * CODES_PER_LEVEL
    max_items = (length - 1) // NUM_LEVELS
    history = torch.full((batch, length), PAD_TOKEN)
    for row in range(batch):
        count = int(torch.randint(1, max_items + 1, (1,), generator=generator))
        items = torch.randint(0, CODES_PER_LEVEL, (count, NUM_LEVELS), generator=generator) + offsets
        history[row, length - 1 - count * NUM_LEVELS:-1] = items.reshape(-1)
    history[:, -1] = EOS_TOKEN
    candidates = torch.randint(0, CODES_PER_LEVEL, (batch, num_candidates, NUM_LEVELS), generator=generator) + offsets
    return history, history != PAD_TOKEN, candidates


def hf_candidate_logits(hf, history, mask, candidates):
    """(B, C, T, V) logits from HF T5: encoder once, its output repeated per candidate."""
    batch, num_candidates, num_levels = candidates.shape
    encoded = hf.encoder(input_ids=history, attention_mask=mask.long()).last_hidden_state   # (B, L, d)
    encoded = encoded.repeat_interleave(num_candidates, dim=0)                             # (B*C, L, d)
    decoder_ids = torch.cat([torch.full_like(candidates[..., :1], BOS_TOKEN), candidates[..., :-1]], -1)
    out = hf(encoder_outputs=(encoded,), attention_mask=mask.long().repeat_interleave(num_candidates, 0),
             decoder_input_ids=decoder_ids.view(batch * num_candidates, num_levels), use_cache=False)
    return out.logits.view(batch, num_candidates, num_levels, -1)


def step(run_logits, model, candidates) -> float:
    """Seconds for one forward + backward (train mode, dropout on) of the summed label log-probs."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = -label_log_probs(run_logits(), candidates).mean()
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--history-len", type=int, default=61)
    parser.add_argument("--candidates", type=int, default=101, help="1 positive + N negatives")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json-out", default="benchmarks/results/backbones.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = TigerBackbone(VOCAB, NUM_LEVELS)
    history, mask, candidates = make_workload(args.batch, args.history_len, args.candidates)
    runners = {"ours (hand-written TIGER)": (ours, lambda: ours(history, mask, candidates))}
    versions = {"torch": torch.__version__}
    try:
        import transformers
        hf = tiger_to_t5(ours)
        versions["transformers"] = transformers.__version__
        versions["hf_attn_implementation"] = hf.config._attn_implementation
        runners["transformers T5ForConditionalGeneration"] = (
            hf, lambda: hf_candidate_logits(hf, history, mask, candidates))
        ours.eval(), hf.eval()
        with torch.no_grad():
            diff = (ours(history, mask, candidates) - hf_candidate_logits(hf, history, mask, candidates)).abs().max()
        print(f"same weights, eval mode: max |logit difference| = {diff:.2e}")
        versions["max_abs_logit_diff"] = float(diff)
    except ImportError:
        print("transformers is not importable: skipping the transformers row (pip install transformers)")
    print(f"parameters: ours {ours.num_parameters():,}"
          + (f", transformers {sum(p.numel() for p in hf.parameters()):,}" if len(runners) > 1 else ""))
    for model, _ in runners.values():
        model.train()
    times: dict[str, list[float]] = {name: [] for name in runners}
    load_before = os.getloadavg()  # other processes on the machine skew absolute times, not the A/B order
    for round_index in range(args.warmup + args.repeats):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))  # interleaved A/B
        for name in order:
            model, run_logits = runners[name]
            seconds = step(run_logits, model, candidates)
            if round_index >= args.warmup:
                times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    workload = f"B={args.batch} L={args.history_len} C={args.candidates} T={NUM_LEVELS} V={VOCAB}"
    print(f"\nforward+backward, {workload}, {args.threads} CPU threads, median of {args.repeats} (train mode)")
    baseline = next(iter(times))
    # paired per-round ratios are robust to load that drifts between rounds
    paired = {name: statistics.median(v / b for v, b in zip(values, times[baseline])) for name, values in times.items()}
    print("| model | median s | min s | max s | median ratio | median paired ratio |\n|---|---|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {medians[name]:.3f} | {min(values):.3f} | {max(values):.3f} | "
              f"{medians[name] / medians[baseline]:.2f}x | {paired[name]:.2f}x |")
    result = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
              "cpu_threads": args.threads, "cpu_count": os.cpu_count(), "workload": workload,
              "load_average_before_after": [load_before[0], os.getloadavg()[0]], "repeats": args.repeats,
              "versions": versions, "seconds": times, "median_seconds": medians,
              "median_paired_ratio_vs_ours": paired}
    path = Path(args.json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"1-min load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
