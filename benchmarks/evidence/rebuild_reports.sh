#!/usr/bin/env bash
# Rebuild every committed report and the grid from the committed study exports (no training, no MLflow):
# run after a change to what the report computes or prints. Needs the datasets for the training-free rows
# (DATA, default ../shared/datasets or $APAO_DATA_DIR).
#   bash benchmarks/evidence/rebuild_reports.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-${APAO_DATA_DIR:-../shared/datasets}}
PY=${PY:-python}
R=benchmarks/results
E=benchmarks/evidence
report() { "$PY" -m apao_ray report --data-dir "$DATA" "$@"; }

report --exports $R/office-budget4-b256-seed{0,1,2} $R/office-budget4-b256-apao_pairwise-seed0 --out $E/report
report --exports $R --study office-budget4-b256-seed{0,1,2} office-budget4-b256-bear_token_weighted-seed{0,1,2} \
    office-budget4-b256-msl-seed{0,1,2} --out $E/report-office-budget4-field
report --exports $R --baseline msl --study office-budget4-b256-bear_token_weighted-seed{0,1,2} \
    office-budget4-b256-msl-seed{0,1,2} --out $E/report-office-budget4-bear-vs-msl
report --exports $R --baseline msl --study office-budget4-b256-bear_token_weighted-seed{0,1,2} \
    office-budget4-b256-msl-bf16-seed{0,1,2} --out $E/report-office-budget4-bear-vs-msl-bf16
report --exports $R --study office-full-tiger-seed{0,1,2,4} --out $E/report-office-full-tiger-4seeds
for study in office-full-tiger-seed0 office-full-tiger-seed4 office-full-tiger-reference-ce-seed0 office-budget20m-seed0; do
    report --exports $R --study "$study" --out "$E/report-$study"
done
report --exports $R/grocery-budget3h-seed0 --out $E/report-grocery-budget3h-seed0
report --grid --exports $R --out $E/grid
