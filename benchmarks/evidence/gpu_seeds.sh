#!/usr/bin/env bash
# Office/TIGER seeds of CE and APAO-pointwise at the paper's full protocol on one CUDA GPU, as many as fit a
# deadline, one seed pair at a time (gpu_full_protocol.py: run_trial, no Ray/MLflow/Optuna), after a tiny
# synthetic trial that tries every path a full trial ends with (selection rules, full-sort test) on this GPU:
# if that fails, the seeds run with --full-sort-test off rather than lose their test results.
#
#   SEEDS="4 5" DEADLINE=560 OUT=/tmp/seeds APAO_DATA_DIR=.gpu/datasets bash benchmarks/evidence/gpu_seeds.sh
#   # back here, per seed:
#   python benchmarks/evidence/gpu_full_protocol.py --out /tmp/seeds --export office-full-gpu-seeds DIR
#
# Each seed's trial files land in $OUT/seeds; a pair is started only while MIN_LEFT s (300) are left (a pair
# still running at the deadline is stopped, its files marked unfinished). Variables: SEEDS, DEADLINE
# (seconds from the script's start), OUT, APAO_DATA_DIR, THREADS (per trial, default 4), PROTOCOL (paper),
# DEVICE (cuda; cpu tries the script), TRAIN_FLAGS (more `apao train` flags, e.g. --test-every-epoch), LOSSES
# (default ce,apao_pointwise; e.g. LOSSES=bear,token_weighted SEEDS=4 for the field's losses beside seed 4's pair).
set -u
cd "$(dirname "$0")/../.."
start=$SECONDS
seeds=${SEEDS-4}
deadline=${DEADLINE:-560}
out=${OUT:?set OUT}
protocol=${PROTOCOL:-paper}
mkdir -p "$out/seeds"
full_sort=on
if ! timeout 120 python3 benchmarks/evidence/gpu_full_protocol.py --dataset synthetic --data-dir /tmp/apao-synthetic \
        --out /tmp/apao-smoke --work /tmp/apao-smoke-work --losses ce --seeds 0 --device "${DEVICE:-cuda}" \
        --train-flags="--epochs 2 --model-size tiny --full-sort-test on" >/dev/null 2>&1 \
        || ! grep -q '"finished": true' /tmp/apao-smoke/ce-seed0.json; then
    full_sort=off
    echo "the synthetic trial failed with --full-sort-test on: seeds run with it off"
    tail -20 /tmp/apao-smoke/trials.log 2>/dev/null
fi
echo "smoke: full sort $full_sort after $((SECONDS - start)) s"
for seed in $seeds; do
    left=$((deadline - (SECONDS - start)))
    if [ "$left" -lt "${MIN_LEFT:-300}" ]; then
        echo "seed $seed not started: $left s left"
        continue
    fi
    python3 benchmarks/evidence/gpu_full_protocol.py --data-dir "$APAO_DATA_DIR" --out "$out/seeds" \
        --work /tmp/apao-seeds --seeds "$seed" --losses "${LOSSES:-ce,apao_pointwise}" --device "${DEVICE:-cuda}" --protocol "$protocol" --threads "${THREADS:-4}" --deadline "$left" \
        --train-flags="--full-sort-test $full_sort ${TRAIN_FLAGS:-}"
    mv "$out/seeds/trials.log" "$out/seeds/trials-seed$seed.log"
done
