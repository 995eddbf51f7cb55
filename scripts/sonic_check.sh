#!/usr/bin/env bash
# SonicMoE beside kittenmoe on a GPU machine without a network, in one command (from the repository root, with
# .sonic/sonic.tar.xz carried there: scripts/sonicmoe_wheels.sh pack makes it):
#
#   bash scripts/sonic_check.sh
#
# Steps, each output to its own log under $OUT (default /tmp/kittenmoe-out), never through a pipe:
#   setup       unpack .sonic/sonic.tar.xz (scripts/sonicmoe_wheels.sh unpack), import sonicmoe, print versions
#   gpu-test    tests/test_sonic.py's GPU test: the real SonicMoE vs the fp32 reference, forward and gradients
#               (T=512, H=1024, I=512, E=8, K=2, bf16)
#   bench-*     kittenmoe bench --shape S --ep 1 --mode both --baseline grouped_mm,sonicmoe --no-shared for the
#               shapes in SHAPES below: kittenmoe, grouped_mm and SonicMoE timed in the same interleaved rounds,
#               kittenmoe without its shared expert so that all three compute the same routed experts
#   profile-*   benchmarks/probes/phase_profile.py on the same shapes: each provider's kernels, by name, under
#               torch.profiler (forward and forward+backward), for the phase-by-phase comparison
# STEPS (default "test bench profile") names which of the last three kinds run; SHAPES (space-separated) and
# STEP_LIMIT (seconds a step, default 240) narrow a run: on the H200 all three shapes' bench steps once ran past
# 240 s each, so one shape a call (SHAPES=2048,7168,2048,48,8 STEP_LIMIT=500) is the safer start. Logs and the profiles' JSON go
# to $OUT/logs and are packed into $OUT/logs.tar.gz at the end (a device call brings back 8 files), QuACK's cache
# into $OUT/quack-cache.tar.gz (carry it back as .sonic/quack-cache.tar.gz: scripts/sonicmoe_wheels.sh says why);
# then rows.json
# (every bench row) and, printed last, a short table: the rows, then each step's exit status, time and last line.
#
# Time: SonicMoE compiles and autotunes its GEMMs on each shape's first call (50-90 s a shape; its forward alone
# and its forward+backward compile apart), kittenmoe compiles its megakernels too. The whole run is held under
# BUDGET seconds (default 560, inside a 600 s call): each step's time limit is the smaller of its own and what is
# left, and a step that no longer fits is skipped, named in the summary. REPS (default 30) and WARMUP (default 3)
# are bench's timed and warm-up runs of each provider; BENCH_ARGS adds bench flags (e.g.
# BENCH_ARGS="--config forward_kernel=gluon" times that kernel config against SonicMoE).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kittenmoe-out}
BUDGET=${BUDGET:-560}
REPS=${REPS:-30}
WARMUP=${WARMUP:-3}
SHAPES=(${SHAPES:-32768,4096,512,128,8 32768,4096,2048,64,4 2048,7168,2048,48,8})
STEPS=${STEPS:-test bench profile}
STEP_LIMIT=${STEP_LIMIT:-240}  # seconds a bench or profile step may take (each prints a line per stage)
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (one GPU here; kept as on every device command)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SonicMoE's compile caches in /tmp; QuACK compiles its autotuning candidates in worker processes, one per core
# (their caches, and a carried .sonic/quack-cache.tar.gz in them, come from scripts/sonicmoe_wheels.sh unpack)
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
# QuACK prints each autotuning step (configs pre-compiled, timed, chosen): where a long first call goes
export QUACK_PRINT_AUTOTUNING=${QUACK_PRINT_AUTOTUNING:-1}
LOG=$OUT/logs
mkdir -p "$LOG"
rows_dir=$(mktemp -d /tmp/sonic-rows.XXXX)
summary=()
start=$SECONDS

step() {  # step NAME SECONDS COMMAND...: COMMAND's output to $LOG/NAME.log, within its limit and the budget
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - start)))
  if ((left < 30)); then
    summary+=("$(printf '%-26s %-6s %5ss  %s' "$name" skip 0 "not run: ${left} s of the ${BUDGET} s budget left")")
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  [[ $rc == 124 ]] && echo "(stopped by the step's ${limit} s limit)" >> "$LOG/$name.log"
  summary+=("$(printf '%-26s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(tail -n 1 "$LOG/$name.log" | cut -c1-100)")")
}

setup() {
  bash scripts/sonicmoe_wheels.sh unpack > /tmp/sonic-env.sh || return 1
  cat /tmp/sonic-env.sh
  # shellcheck disable=SC1091
  . /tmp/sonic-env.sh
  python3 - <<'EOF'
import importlib.metadata as md
import time

import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}; torch's own DLPack "
      f"exchange API: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
t0 = time.perf_counter()
import sonicmoe  # noqa: E402
from sonicmoe.functional import moe_general_routing_inputs  # noqa: E402,F401

print(f"import sonicmoe: {time.perf_counter() - t0:.1f} s")
for dist in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "cuda-bindings",
             "cuda-python", "cuda-pathfinder", "apache-tvm-ffi", "torch-c-dlpack-ext", "einops", "triton"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} not found")
print(f"sonicmoe {sonicmoe.__version__} from {sonicmoe.__file__}")
EOF
}

export -f setup  # a function: timeout runs it through bash -c
step setup 90 bash -c setup
if [[ -f /tmp/sonic-env.sh ]]; then
  # shellcheck disable=SC1091
  . /tmp/sonic-env.sh
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
[[ $STEPS == *test* ]] && step gpu-test 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_sonic.py
if [[ $STEPS == *bench* ]]; then
  for s in "${SHAPES[@]}"; do
    step "bench-${s//,/-}" "$STEP_LIMIT" python3 -m kittenmoe.cli bench --shape "$s" --ep 1 --mode both \
      --baseline grouped_mm,sonicmoe --no-shared --reps "$REPS" --warmup "$WARMUP" --out "$rows_dir" \
      ${BENCH_ARGS:-}
  done
fi
if [[ $STEPS == *profile* ]]; then
  for s in "${SHAPES[@]}"; do
    step "profile-${s//,/-}" "$STEP_LIMIT" python3 benchmarks/probes/phase_profile.py --shape "$s" --out "$LOG"
  done
fi
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOG"
bash scripts/sonicmoe_wheels.sh pack-cache "$OUT"

python3 - "$rows_dir" "$OUT/rows.json" <<'EOF'
import json
import pathlib
import sys

rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    rows += json.loads(path.read_text())
pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")


def ms(v):
    return "-" if v is None else f"{v:.3f}"


print(f"\n{'pass':<17}{'shape':<22}{'T':>6}{'kittenmoe':>10}{'grouped_mm':>11}{'sonicmoe':>10}{'x gmm':>7}"
      f"{'x sonic':>8}{'kmoe L1':>9}{'sonic L1':>9}{'sonic 1st s':>12}")
for r in rows:
    x_sonic = r.get("speedup_vs_sonicmoe")
    sonic_l1 = r.get("rel_l1_sonicmoe")
    first = r.get("sonicmoe_first_call_s")
    print(f"{r['kind']:<17}{r['shape']:<22}{r['tokens']:>6}{ms(r['ms_kittenmoe']):>10}{ms(r['ms_grouped_mm']):>11}"
          f"{ms(r.get('ms_sonicmoe')):>10}{r['speedup']:>6.2f}x{'-' if x_sonic is None else f'{x_sonic:.2f}x':>8}"
          f"{r['rel_l1']:>9.1e}{'-' if sonic_l1 is None else f'{sonic_l1:.1e}':>9}"
          f"{'-' if first is None else f'{first:.0f}':>12}")
    if r.get("sonicmoe_note"):
        print(f"  sonicmoe: {r['sonicmoe_note'][:200]}")
EOF
echo
printf '%-26s %-6s %6s  %s\n' step rc time "last line of the log"
printf '%s\n' "${summary[@]}"
