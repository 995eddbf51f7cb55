#!/usr/bin/env bash
# GPU checks and measurements with fixed, named targets. Run from the repository root on a CUDA machine:
#
#   bash scripts/gpu.sh tests [forward|backward|multiprocess]   the GPU test suite (-m gpu), all three groups or one
#   bash scripts/gpu.sh bench [MODEL]     kittenmoe bench, forward and forward+backward, on the four seed EP8 slices
#                                         (or one), rows into $RESULTS for scripts/perf_table.py
#   bash scripts/gpu.sh tune [MODEL]      kittenmoe tune of one seed EP8 slice (default kimi-k2.7), record in $RESULTS
#   bash scripts/gpu.sh ep [MODEL]        expert parallelism across processes (torchrun over symmetric memory):
#                                         examples/ep_layer.py, then kittenmoe bench --ep 8 --mode both; one process
#                                         a GPU, or with a single GPU two processes sharing it
#                                         (KITTENMOE_EP_SHARE_GPU=1: a smoke test of the path, not a measurement)
#   bash scripts/gpu.sh gluon [MODELS]    the Gluon forward's forms (KernelConfig.forward_kernel "gluon",
#                                         "gluon-gather"): each one's GPU tests (the Triton forward's bits),
#                                         then benchmarks/fwd_round.py timing those that passed
#                                         against the Triton forward in the same rounds (MODELS comma-separated,
#                                         default kimi-k2.7, qwen3.5-397b-a17b and the fine-grained
#                                         32768x4096x512x128x8, fwd_round's T x H x I x E x K form, no shared
#                                         expert); about 2 + 1 a shape minutes
#   bash scripts/gpu.sh gluon-bwd [SHAPES]  the Gluon backward (KernelConfig.backward_kernel "gluon"): its GPU tests
#                                         (the Triton backward's bits), then kittenmoe bench forward+backward
#                                         without a shared expert, per shape (T,H,I,E,K, ';'-separated; default the
#                                         fine-grained 32768,4096,512,128,8 and Qwen3-30B-A3B's 8192,2048,768,128,8)
#                                         the one-rank default config (BWD_BASE overrides), with the Triton
#                                         and then the Gluon backward; about 3 + 2 a shape minutes
#   bash scripts/gpu.sh train [MODEL]     benchmarks/train_step.py: whole training steps of MODEL (qwen3-30b-a3b,
#                                         the default, or moonlight-16b-a3b; LAYERS deep, default 4) with every experts
#                                         implementation, BATCH sequences (default 1) of SEQ tokens (default
#                                         8192), STACK hf or torchtitan
#                                         (default hf; TITAN_ATTN flex, the default, or sdpa for a torch
#                                         older than torchtitan 0.3's FlexAttention), COMPILE off, on or both
#                                         (default off), PROVIDERS (comma list,
#                                         default all), KNOBS (KernelConfig fields k=v,... on kittenmoe's
#                                         config); SonicMoE from a carried .sonic/sonic.tar.xz
#                                         (scripts/sonicmoe_wheels.sh)
#   bash scripts/gpu.sh kernels [SHAPES]  benchmarks/probes/kernel_times.py: GPU ms of each kernel of one forward+backward
#                                         through kittenmoe.moe per shape (T,H,I,E,K, ';'-separated; default Qwen3-30B-A3B's
#                                         8192,2048,768,128,8 and the fine-grained 32768,4096,512,128,8), for each of
#                                         CONFIGS ('|'-separated KernelConfig overrides, default the heuristic config
#                                         and forward_kernel=triton); GPU_TESTS=1 first runs the public path's and
#                                         the Gluon kernels' GPU tests; about 1 minute a shape
#   bash scripts/gpu.sh host [SHAPES]    benchmarks/probes/public_host_probe.py: the public path's host time a call
#                                         (forward, forward+backward) against its wall time, and where it goes,
#                                         per shape (T,H,I,E,K, ';'-separated; default Qwen3-30B-A3B's and the
#                                         fine-grained one); about 1 minute a shape; GPU_TESTS=1 first runs the
#                                         public path's and its custom ops' GPU tests (test_api, test_layer)
#   bash scripts/gpu.sh ab [SLICES]       benchmarks/ab_revisions.py run: the revision prepared in a carried .ab against
#                                         this tree, interleaved rounds and equal-bits checks per seed slice
#                                         (SLICES model:tokens or TxHxIxExK,... as ab_revisions takes them; ROUNDS,
#                                         default 5; CONFIG / CONFIG_BEFORE its --config / --config-before;
#                                         ROUTING / MODES its --routing / --modes; TAG
#                                         names the log; AB_LIMIT seconds, default 280); GPU_TESTS=1 first runs
#                                         the public path's, the backward's and FP8's GPU tests
#   bash scripts/gpu.sh ncu [MODEL]       Nsight Compute counters of one forward+backward, ours and grouped_mm's
#                                         (MODEL a seed slice, default kimi-k2.7, or T,H,I,E,K without a shared
#                                         expert), summarised one line a kernel
#
# Every target puts torchtitan's MoE modules on PYTHONPATH from a carried .titan/wheels (scripts/titan_wheels.sh).
# MODEL is a seed shape: kimi-k2.7, deepseek-v4-pro, qwen3.5-397b-a17b, glm-5.2 (Qwen's slice takes 4,096 tokens,
# the others 2,048: kittenmoe.config.SLICE_TOKENS). Environment:
#   OUT       where every step writes <step>.log, and whatever else it produces (default /tmp/kittenmoe-out)
#   RESULTS   where bench and tune write their JSON rows (default benchmarks/results; copies go to $OUT/results)
#   NCU_CONFIG  KernelConfig overrides k=v,... for the ncu target (default: the heuristic config)
#   NEWER_TRITON  1: run the target with the Triton of a carried .triton-next (3.9, scripts/triton_next.sh) first
#             on PYTHONPATH instead of the machine's (the Gluon kernels build with both; the ab target's own
#             PYTHONPATH keeps the machine's)
#
# Each step's output goes to its own log, never through a pipe (a filter would hide a hang and the last lines);
# a step's failure does not stop the next, and each step has a time limit so the summary always prints. The
# last thing printed is a short table: step, exit status, seconds, the log's last line. Timings: about 17 minutes
# for all of `tests` (forward ~4, backward ~5, multiprocess ~7), 2-3 minutes a model for `bench`, 4-5 for `ncu`.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast stays off: the megakernels do not use it, and a multicast program can take down GPUs that the
# host shares with others.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/kittenmoe-out}
RESULTS=${RESULTS:-benchmarks/results}
target=${1:-}
arg=${2:-}
if [[ ! $target =~ ^(tests|bench|tune|ep|ncu|gluon|gluon-bwd|train|kernels|host|ab)$ ]]; then  # no target or an unknown one: this header
  sed -n '2,/^set -u/p' "$0" | sed '$d'
  [[ -z $target ]] && exit 0
  echo "unknown target: $target" >&2
  exit 2
fi
mkdir -p "$OUT" "$RESULTS"
summary=()
# torchtitan's MoE modules (the torchtitan tests and the train target's torchtitan stack), where carried
if compgen -G ".titan/wheels/*.whl" > /dev/null; then
  eval "$(bash scripts/titan_wheels.sh unpack 2> "$OUT/titan-setup.log")" || echo "torchtitan wheels: see $OUT/titan-setup.log"
fi
if [[ ${NEWER_TRITON:-0} == 1 ]]; then
  eval "$(bash scripts/triton_next.sh unpack 2> "$OUT/triton-next-setup.log")" \
    || { echo "NEWER_TRITON=1 but no Triton from .triton-next: see $OUT/triton-next-setup.log"; exit 2; }
  export PYTHONPATH=$TRITON_NEXT:$PYTHONPATH
fi
SEEDS=(kimi-k2.7 deepseek-v4-pro qwen3.5-397b-a17b glm-5.2)

step() {  # step NAME SECONDS COMMAND...: COMMAND's output to $OUT/NAME.log, under a time limit
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [[ $rc == 124 ]] && echo "(stopped by the step's ${limit} s limit)" >> "$OUT/$name.log"
  summary+=("$(printf '%-24s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(tail -n 1 "$OUT/$name.log" | cut -c1-110)")")
}

tokens_of() {  # the seed slice's token count (kittenmoe.config.SLICE_TOKENS)
  python3 -c "from kittenmoe.config import SLICE_TOKENS as s; print(s['$1'])"
}

models() {  # the MODEL argument, or every seed shape
  if [[ -n $arg ]]; then echo "$arg"; else echo "${SEEDS[@]}"; fi
}

keep_rows() {  # copy the result files written since the stamp file $1 into $OUT/results
  mkdir -p "$OUT/results"
  find "$RESULTS" -maxdepth 1 -name '*.json' -newer "$1" -exec cp {} "$OUT/results/" \;
}

rows_table() {  # a short table of the rows in the JSON files given
  python3 - "$@" <<'EOF'
import json, sys
print(f"{'pass':<17}{'shape':<20}{'T':>6}{'R':>3}  {'kittenmoe ms':>12}{'baseline ms':>12}{'speedup':>9}  file")
for path in sys.argv[1:]:
    rows = json.load(open(path))
    for r in rows if isinstance(rows, list) else [rows]:
        if "ms_kittenmoe" in r:
            print(f"{r['kind']:<17}{r['shape']:<20}{r['tokens']:>6}{r['ranks']:>3}  {r['ms_kittenmoe']:>12.3f}"
                  f"{r.get('ms_baseline', r.get('ms_grouped_mm', float('nan'))):>12.3f}{r['speedup']:>8.2f}x  "
                  f"{path.rsplit('/', 1)[-1]}")
EOF
}

gpus() {
  python3 -c 'import torch; print(torch.cuda.device_count())'
}

case $target in
tests)
  # Three groups, each within a 10-minute call: the multi-process tests (several processes sharing the GPU through
  # symmetric memory); the backward's, the layer's, FP8's and bench's; everything else (forward megakernel,
  # schedule, trace, training, transformers). -v names each test in the log, so a cut run says how far it got.
  mp=(tests/test_distributed.py)
  bwd=(tests/test_bench_tune.py tests/test_layer.py tests/test_megakernel_bwd.py tests/test_megakernel_fp8.py
       tests/test_fp8.py)
  pytest=(python3 -m pytest -v --durations=20 -p no:cacheprovider -m gpu)
  if [[ -z $arg || $arg == forward ]]; then
    step tests-forward 560 "${pytest[@]}" tests "${mp[@]/#/--ignore=}" "${bwd[@]/#/--ignore=}"
    # the schedule's Triton kernels on CUDA tensors (not marked gpu: they skip without CUDA)
    step tests-schedule 60 python3 -m pytest -q -p no:cacheprovider tests/test_schedule.py -k triton
  fi
  if [[ -z $arg || $arg == backward ]]; then
    step tests-backward 560 "${pytest[@]}" "${bwd[@]}"
  fi
  if [[ -z $arg || $arg == multiprocess ]]; then
    step tests-multiprocess 560 "${pytest[@]}" "${mp[@]}"
  fi
  ;;
bench)
  stamp="$OUT/.bench-start"
  touch "$stamp"
  for m in $(models); do
    step "bench-$m" 560 python3 -m kittenmoe.cli bench --model "$m" --ep 8 --tokens "$(tokens_of "$m")" \
      --mode both --out "$RESULTS"
  done
  keep_rows "$stamp"
  ;;
tune)
  m=${arg:-kimi-k2.7}
  stamp="$OUT/.tune-start"
  touch "$stamp"
  # the tuned config goes to $OUT/cache unless KITTENMOE_CACHE_DIR says where (the user's cache is not touched)
  step "tune-$m" 590 env KITTENMOE_CACHE_DIR="${KITTENMOE_CACHE_DIR:-$OUT/cache}" \
    python3 -m kittenmoe.cli tune --model "$m" --ep 8 --tokens "$(tokens_of "$m")" --out "$RESULTS"
  keep_rows "$stamp"
  ;;
ep)
  m=${arg:-kimi-k2.7}
  n=$(gpus)
  run=(python3 -m torch.distributed.run --nproc-per-node)
  share=()
  if [[ $n -lt 2 ]]; then  # one GPU: two processes share it (gloo group, overlapping symmetric memory allowed)
    n=2
    share=(env KITTENMOE_EP_SHARE_GPU=1)
  fi
  stamp="$OUT/.ep-start"
  touch "$stamp"
  step ep-layer 300 ${share[@]+"${share[@]}"} "${run[@]}" "$n" examples/ep_layer.py
  # each process one EP8 slice's experts and tokens, against NCCL all-to-all + grouped_mm in the same run; rows from
  # processes sharing one GPU are marked share_gpu and left out of perf_table's tables
  step "ep-bench-$m" 560 ${share[@]+"${share[@]}"} "${run[@]}" "$n" -m kittenmoe.cli bench --model "$m" --ep 8 \
    --tokens "$(tokens_of "$m")" --mode both --out "$RESULTS"
  keep_rows "$stamp"
  ;;
gluon)
  stamp="$OUT/.gluon-start"
  touch "$stamp"
  # each form's bit tests apart (a form that hangs its GPU is stopped by its own limit), then the timing of the
  # Triton forward against the forms whose tests passed, in the same rounds
  # (FORMS: test id:forward_kernel pairs; TIMING_ONLY=1 skips the tests and times every form, for a second call)
  configs=""
  for form in ${FORMS:-pull:gluon gather:gluon-gather}; do
    if [[ ${TIMING_ONLY:-0} == 1 ]]; then
      configs+=";forward_kernel=${form#*:}"
      continue
    fi
    step "gluon-tests-${form%%:*}" 240 python3 -m pytest -v -p no:cacheprovider -m gpu \
      tests/test_megakernel_fwd_gluon.py -k "${form%%:*}"
    grep -q " passed" "$OUT/gluon-tests-${form%%:*}.log" && ! grep -q " failed\|(stopped by" \
      "$OUT/gluon-tests-${form%%:*}.log" && configs+=";forward_kernel=${form#*:}"
  done
  step gluon-fwd 300 python3 benchmarks/fwd_round.py --shapes "${arg:-kimi-k2.7,qwen3.5-397b-a17b,32768x4096x512x128x8}" \
    --config "$configs" --skip-check --reps 20 --out "$RESULTS"
  keep_rows "$stamp"
  grep -h "^  \[" "$OUT/gluon-fwd.log"
  ;;
host)
  if [[ ${GPU_TESTS:-0} == 1 ]]; then  # the public path's ops, their fake impls and full opcheck, first
    step host-tests 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_api.py tests/test_layer.py
  fi
  IFS=';' read -ra shapes <<< "${arg:-8192,2048,768,128,8;32768,4096,512,128,8}"
  for sh in "${shapes[@]}"; do
    step "host-${sh//,/x}" 200 python3 benchmarks/probes/public_host_probe.py --shape "$sh"
    grep -h "^====" "$OUT/host-${sh//,/x}.log"
  done
  ;;
kernels)
  if [[ ${GPU_TESTS:-0} == 1 ]]; then
    step kernels-tests 420 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_api.py \
      tests/test_megakernel_fwd_gluon.py tests/test_megakernel_bwd_gluon.py
  fi
  IFS=';' read -ra shapes <<< "${arg:-8192,2048,768,128,8;32768,4096,512,128,8}"
  for sh in "${shapes[@]}"; do
    step "kernels-${sh//,/x}" 240 python3 benchmarks/probes/kernel_times.py --shape "$sh" \
      --config "$(tr '|' ';' <<< "${CONFIGS:-|forward_kernel=triton}")"
    grep -h "^\[\|^ " "$OUT/kernels-${sh//,/x}.log" | head -40
  done
  ;;
gluon-bwd)
  stamp="$OUT/.gluon-bwd-start"
  touch "$stamp"
  if [[ ${TIMING_ONLY:-0} != 1 ]]; then
    step gluon-bwd-tests 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_bwd_gluon.py
  fi
  base=${BWD_BASE:-num_comm_programs_fwd=0,num_comm_programs_bwd=0,combine_gather=True,tile_group_m=-1}
  IFS=';' read -ra shapes <<< "${arg:-32768,4096,512,128,8;8192,2048,768,128,8}"
  for sh in "${shapes[@]}"; do
    for bk in triton gluon; do
      step "bwd-$bk-${sh//,/x}" 150 python3 -m kittenmoe.cli bench --shape "$sh" --no-shared --mode backward \
        --config "$base,backward_kernel=$bk" --out "$RESULTS"
    done
  done
  keep_rows "$stamp"
  ;;
train)
  stamp="$OUT/.train-start"
  touch "$stamp"
  if [[ -f .sonic/sonic.tar.xz ]]; then
    step train-sonic-setup 60 bash -c "bash scripts/sonicmoe_wheels.sh unpack > '$OUT/sonic-env.sh'"
    # shellcheck disable=SC1091
    [[ -s $OUT/sonic-env.sh ]] && . "$OUT/sonic-env.sh"  # (with QuACK's caches: packed again at the end)
  fi
  m=${arg:-qwen3-30b-a3b}
  step "train-${STACK:-hf}-$m-${SEQ:-8192}" 570 python3 benchmarks/train_step.py --model "$m" --seq "${SEQ:-8192}" \
    --batch "${BATCH:-1}" --stack "${STACK:-hf}" --titan-attention "${TITAN_ATTN:-flex}" \
    --compile "${COMPILE:-off}" ${PROVIDERS:+--providers "$PROVIDERS"} ${LAYERS:+--layers "$LAYERS"} \
    ${KNOBS:+--knobs "$KNOBS"} --profile \
    --out "$RESULTS"
  keep_rows "$stamp"
  [[ -n ${QUACK_CACHE_DIR:-} ]] && bash scripts/sonicmoe_wheels.sh pack-cache "$OUT"
  ;;
ab)
  if [[ ${GPU_TESTS:-0} == 1 ]]; then
    step ab-tests 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_api.py tests/test_megakernel_bwd.py \
      tests/test_megakernel_fp8.py
  fi
  stamp="$OUT/.ab-start"
  touch "$stamp"
  log="ab-run${TAG:+-$TAG}"
  step "$log" "${AB_LIMIT:-280}" env PYTHONPATH=src:.ab python3 benchmarks/ab_revisions.py run \
    --rounds "${ROUNDS:-5}" ${arg:+--slices "$arg"} ${CONFIG:+--config "$CONFIG"} \
    ${CONFIG_BEFORE:+--config-before "$CONFIG_BEFORE"} ${ROUTING:+--routing "$ROUTING"} ${MODES:+--modes "$MODES"}
  keep_rows "$stamp"
  grep -h "^|" "$OUT/$log.log" | tail -n 20
  ;;
ncu)
  m=${arg:-kimi-k2.7}
  tag=${m//,/x}
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  if [[ -z $ncu_bin ]]; then
    echo "ncu (Nsight Compute) not found on PATH, under /opt/nvidia/nsight-compute or /usr/local/cuda/bin" >&2
    exit 2
  fi
  rep="$OUT/ncu-$tag"
  # clocks as the GPU runs them (--clock-control none); each kernel replayed per pass with its memory restored;
  # ncu_probe.py opens the profiler range around one forward+backward of ours and one of grouped_mm's
  step "ncu-$tag" 480 "$ncu_bin" --profile-from-start off --clock-control none -f -o "$rep" \
    --kernel-name "regex:dispatch_mlp|combine_mlp|forward_kernel|backward_kernel|weight_grad|wgrad|cutlass|gemm|grouped|device_kernel" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section LaunchStats --section Occupancy \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum \
    python3 benchmarks/probes/ncu_probe.py --shape "$m" --config "${NCU_CONFIG:-}"
  step ncu-csv 60 bash -c "'$ncu_bin' --import '$rep.ncu-rep' --csv --print-units base --page raw > '$rep-raw.csv'"
  step ncu-summary 30 python3 benchmarks/probes/ncu_summary.py "$rep-raw.csv"
  ;;
esac

[[ $target == ncu ]] && cat "$OUT/ncu-summary.log"
[[ $target == train ]] && sed -n '/^provider /,$p' "$OUT"/train-*-*.log
if [[ $target =~ ^(bench|tune|ep|gluon-bwd)$ ]] && compgen -G "$OUT/results/*.json" > /dev/null; then
  echo
  rows_table "$OUT"/results/*.json
fi
echo
printf '%-24s %-6s %6s  %s\n' step rc time "last line of the log"
printf '%s\n' "${summary[@]}"
