#!/usr/bin/env bash
# A/B saturation replay on a GPU: the step scheduler of an older tree against this one, alternated
# (old, new, old, new) in one call, one model per call (benchmarks/bench_saturation.py --servers step).
#
# Usage (on the GPU machine, in the repository root, with the site pack of ../shared/tools/gpu-site.sh in .gpu/):
#   git archive OLD_COMMIT | tar -x -C .gpu/old      # here, before the call: the older tree, carried in .gpu
#   bash benchmarks/ab_saturation.sh MODEL NEW_COMMIT [OLD_COMMIT]
# Writes sat_<model>_<commit>_r<round>.json and log_<model>.txt under $OUT, and prints each run's images/s.
set -u
model=$1; newc=$2; oldc=${3:-old}
mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site
export PYTHONUNBUFFERED=1
NEW=$PWD; OLD=$PWD/.gpu/old
one() { # tree commit round
  (cd "$1" && PYTHONPATH=$HOME/site:$1 timeout 270 python benchmarks/bench_saturation.py --model "$model" \
     --scratch /dev/shm --commit "$2" --servers step --no-floor --c1-requests 0 --warmup first \
     --out "$OUT/sat_${model}_$2_r$3.json") >> "$OUT/log_${model}.txt" 2>&1 || echo "FAILED $2 r$3" >> "$OUT/log_${model}.txt"
  python - "$OUT/sat_${model}_$2_r$3.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1])); s = d["servers"][0]["summary"]
print(d["commit"], s["images_per_s"], s["wall_s"], s["ok"], s["requests"])
PY
}
one "$OLD" "$oldc" 1; one "$NEW" "$newc" 1; one "$OLD" "$oldc" 2; one "$NEW" "$newc" 2
