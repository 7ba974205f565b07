#!/usr/bin/env bash
# A study on a GPU machine that reaches no package registry, as one job of at most 10 minutes: installs the wheel set
# built beforehand (benchmarks/gpu/wheelset.py, copied beside the checkout as .gpu/wheels-cpXY) into a venv beside
# the machine's own torch, runs `apao sweep` on Office with four trials per GPU, then exports the study from MLflow
# into the output folder. How to build and copy the wheel set: docs/gpu.md.
#
#   bash benchmarks/gpu/study.sh             # on the GPU machine: Office, --gpus-per-trial 0.25, --budget 6m
#   bash benchmarks/gpu/study.sh --smoke     # the synthetic smoke study on CPU (benchmarks/gpu/check_wheelset.py)
#   bash benchmarks/gpu/study.sh --install-only   # the install, then Ray, MLflow (SQLite) and Optuna without torch
#
# Environment: OUT (the output folder; default /tmp/apao-gpu-out), PYTHON (the Python that holds torch; default
# python3), DATASET (office), BUDGET (the study's --budget, 6m; empty: none, the trials' own --epochs and
# --patience in SWEEP_FLAGS), STUDY (the study's name, <dataset>-gpu), GPUS_PER_TRIAL (0.25), CPUS_PER_TRIAL (4),
# STUDY_LIMIT (seconds after which the sweep is interrupted and what finished is exported, 450), SWEEP_FLAGS
# (more sweep flags, e.g. "--losses ce,apao_pointwise").
# Writes into the output folder: runner.log (versions, timings, pip's output), progress.log (the sweep's output),
# gpu.csv (nvidia-smi every 10 s), export.tar.gz (export-study's folder), summary.json, fallback.tar.gz (FALLBACK_SEEDS,
# step 4b); the MLflow store and the
# checkpoints stay in a temporary folder that is deleted at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
OUT=${OUT:-/tmp/apao-gpu-out}
PYTHON=${PYTHON:-python3}
DATASET=${DATASET:-office}
BUDGET=${BUDGET-6m}
GPUS_PER_TRIAL=${GPUS_PER_TRIAL:-0.25}  # four trials per GPU (an H200: 1.25x one trial's throughput)
CPUS_PER_TRIAL=${CPUS_PER_TRIAL:-4}     # 16 CPUs there: one trial per GPU quarter
STUDY_LIMIT=${STUDY_LIMIT:-450}
mode=${1:-gpu}
case "$mode" in
  gpu|--smoke|--install-only) ;;
  *) echo "unknown argument $mode; give --smoke, --install-only or none" >&2; exit 2 ;;
esac
smoke=0
[ "$mode" = --smoke ] && smoke=1
work=$(mktemp -d /tmp/apao-gpu-study.XXXXXX)
mkdir -p "$OUT"
started=$(date +%s)
log() { echo "[study.sh +$(( $(date +%s) - started ))s] $*" | tee -a "$OUT/runner.log" >&2; }
fail() { log "FAILED: $*"; rm -rf "$work"; exit 2; }

# 1. which wheel set: the one built for this Python (the GPU machine's was 3.12.3 when last read)
"$PYTHON" --version 2>&1 | tee -a "$OUT/runner.log"
tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")') || fail "no $PYTHON"
version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
wheels="$root/.gpu/wheels-$tag"
[ -d "$wheels" ] || fail "no wheel set for $tag at $wheels: build it where a package registry is reachable with
  python benchmarks/gpu/wheelset.py --python-version $version --datasets office
and copy .gpu/wheels-$tag beside this checkout (docs/gpu.md)"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 | tee -a "$OUT/runner.log"

# 2. a venv that sees the machine's torch: the Python there lives in a venv itself (/opt/torch/.venv), so
# --system-site-packages would see the system's site-packages, not torch's; a .pth adds that environment's
# site-packages (and the .pth files in it) after the venv's own, so what the wheel set installs comes first
venv="$work/venv"
pip=("$venv/bin/python" -m pip)
if ! "$PYTHON" -m venv "$venv" >>"$OUT/runner.log" 2>&1; then
  # a Python without ensurepip (Debian's, without python3-venv): the machine's pip installs into the venv
  log "python -m venv failed (output above); trying --without-pip and the machine's pip --python"
  rm -rf "$venv"
  "$PYTHON" -m venv --without-pip "$venv" || fail "python -m venv --without-pip"
  pip=("$PYTHON" -m pip --python "$venv/bin/python")
fi
base_sites=$("$PYTHON" -c 'import sysconfig
print(repr(sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})))')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# (one line, executed by site.py in a function's scope: no comprehension, which would not see `site`)
echo "import site; list(map(site.addsitedir, $base_sites))" > "$venv_site/zz_machine_site.pth"
# Python < 3.12 puts setuptools 65 in a new venv, which would shadow the machine's (torch 2.13 asks >= 77)
"${pip[@]}" uninstall --quiet --yes setuptools >/dev/null 2>&1

# 3. only the copied wheels, resolved against what the machine already holds; no index, no pip config
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
t0=$(date +%s)
"${pip[@]}" install --no-index --find-links "$wheels" --no-cache-dir --quiet "$wheels"/*.whl \
  >>"$OUT/runner.log" 2>&1 || fail "pip install of the wheel set (its output above in runner.log)"
install_s=$(( $(date +%s) - t0 ))
log "wheel set installed in ${install_s}s"
"${pip[@]}" check >>"$OUT/runner.log" 2>&1 || log "pip check found problems (above)"
"$venv/bin/python" -c 'import mlflow, optuna, ray, sqlalchemy
print("ray", ray.__version__, "optuna", optuna.__version__, "mlflow", mlflow.__version__,
      "sqlalchemy", sqlalchemy.__version__)' 2>&1 | tee -a "$OUT/runner.log"
"$venv/bin/python" -c 'import torch; print("torch in the venv:", torch.__file__)' 2>&1 | tee -a "$OUT/runner.log"
if [ "$mode" = --install-only ]; then
  # what a study needs of each, without torch: a Ray task, an MLflow run in a SQLite store, Optuna trials in one
  "$venv/bin/python" - "$work" <<'PROBE' 2>&1 | tee -a "$OUT/runner.log"
import sys, mlflow, optuna, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
ray.shutdown()
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}/mlflow.db")
with mlflow.start_run() as run:
    mlflow.log_metric("val/ndcg_at_10", 0.5)
assert mlflow.get_run(run.info.run_id).data.metrics == {"val/ndcg_at_10": 0.5}
study = optuna.create_study(storage=f"sqlite:///{sys.argv[1]}/optuna.db")
study.optimize(lambda trial: trial.suggest_float("beta", 0, 1), n_trials=2)
print("install-only probe: a Ray task, an MLflow run in SQLite, 2 Optuna trials in SQLite: ok")
PROBE
  probe_rc=${PIPESTATUS[0]}
  "$PYTHON" -c "import json; json.dump({'python': '$version', 'install_s': $install_s, 'probe_rc': $probe_rc},
                open('$OUT/summary.json', 'w'), indent=1)"
  rm -rf "$work"
  exit "$probe_rc"
fi

# 4. the study, interrupted (SIGINT: it stops its trials and keeps what finished) if it outlives STUDY_LIMIT
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
store="sqlite:///$work/mlflow.db"
if [ $smoke = 1 ]; then
  study=wheelset-smoke
  flags=(--smoke)
else
  study=${STUDY:-$DATASET-gpu}
  flags=(--dataset "$DATASET" --data-dir "$root/.gpu/datasets" --gpus-per-trial "$GPUS_PER_TRIAL"
         --cpus-per-trial "$CPUS_PER_TRIAL" ${BUDGET:+--budget "$BUDGET"})
  if command -v nvidia-smi >/dev/null; then  # a job of this shell, so `jobs -p` below stops it
    nvidia-smi --query-gpu=timestamp,name,utilization.gpu,memory.used --format=csv -l 10 >"$OUT/gpu.csv" 2>&1 &
  fi
fi
t0=$(date +%s)
# shellcheck disable=SC2086  # SWEEP_FLAGS is a list of flags
timeout --signal=INT --kill-after=60 "$STUDY_LIMIT" "$venv/bin/python" -m apao_ray sweep "${flags[@]}" \
  --study-name "$study" --output-dir "$work/runs" --tracking-uri "$store" ${SWEEP_FLAGS:-} 2>&1 \
  | tee "$OUT/progress.log"
study_rc=${PIPESTATUS[0]}
study_s=$(( $(date +%s) - t0 ))
log "sweep exited $study_rc after ${study_s}s"

# 4b. FALLBACK_SEEDS: a sweep that failed early (a first GPU run of it) leaves the rest of STUDY_LIMIT to the same
# trials without Ray, MLflow or Optuna (benchmarks/evidence/gpu_full_protocol.py), its files in fallback.tar.gz
if [ "$study_rc" != 0 ] && [ -n "${FALLBACK_SEEDS:-}" ] && [ "$study_s" -lt 180 ]; then
  left=$(( STUDY_LIMIT - study_s ))
  log "the sweep failed; gpu_full_protocol.py on seeds $FALLBACK_SEEDS for ${left}s"
  "$venv/bin/python" benchmarks/evidence/gpu_full_protocol.py --data-dir "$root/.gpu/datasets" \
    --out "$work/fallback" --seeds "$FALLBACK_SEEDS" --deadline "$left" ${FALLBACK_FLAGS:-} >>"$OUT/runner.log" 2>&1
  log "gpu_full_protocol.py exited $?"
  tar czf "$OUT/fallback.tar.gz" -C "$work" fallback
fi

# 5. the MLflow export (what the report reads), whatever the sweep's end
"$venv/bin/python" -m apao_ray export-study --study "$study" --tracking-uri "$store" --to "$work/export" \
  >>"$OUT/runner.log" 2>&1 && tar czf "$OUT/export.tar.gz" -C "$work" export
export_rc=$?
log "export-study exited $export_rc"
"$venv/bin/python" - "$OUT/summary.json" <<EOF
import json, sys
json.dump({"python": "$version", "wheel_set": "$wheels", "install_s": $install_s, "study": "$study",
           "smoke": bool($smoke), "budget": None if $smoke else "$BUDGET" or None, "study_rc": $study_rc,
           "study_s": $study_s, "export_rc": $export_rc, "total_s": $(( $(date +%s) - started ))},
          open(sys.argv[1], "w"), indent=1)
EOF
jobs -p | xargs -r kill 2>/dev/null
rm -rf "$work"
[ "$study_rc" = 0 ] && [ "$export_rc" = 0 ]
