#!/usr/bin/env bash
# The ε table (issue: privacy): FedAvg, FedRep, RepPer and FedPick on the cross-device fleet
# (400 clients, a tenth a round, Poisson sampling, add-or-remove accounting) at ε 1, 3, 8
# (δ 1e-5) and without DP, seed by seed so that whole seeds finish first.
#   bash research/dp_table.sh [ROUNDS] [SEEDS...]      (defaults: 60 rounds, seeds 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-60}; shift || true
seeds=${*:-0 1 2}
for seed in $seeds; do
  for eps in none 1 3 8; do
    args=(--settings cross_device --methods fedavg,fedrep,repper,fedpick --rounds "$rounds" --fraction 0.1
          --seeds "$seed" --skip-done --runs-root runs/dp_table)
    if [ "$eps" = none ]; then
      OMP_NUM_THREADS=1 .venv/bin/python research/run_methods.py --tag "dp-cross-r$rounds-none" "${args[@]}" >/dev/null
    else
      OMP_NUM_THREADS=1 .venv/bin/python research/run_methods.py --tag "dp-cross-r$rounds-e$eps" "${args[@]}" \
        --epsilon "$eps" --sampling poisson >/dev/null
    fi
    echo "seed $seed, epsilon $eps: done at $(date -u +%H:%M:%S)"
  done
done
