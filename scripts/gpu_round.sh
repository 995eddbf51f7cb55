#!/usr/bin/env bash
# One device call that re-checks and re-measures everything GPU-side, logs under $OUT, a summary last.
#
#   bash scripts/gpu_round.sh [tests|tests1|tests2|bench|phases|tune|train|ep|eptests|hf|fp8|fp8next|quant|fp8gemm|wquant|next|next2|dwsum|halftail|bm64|profile|widea|wgrad|wgradfloor|bwdstages|ab|next7|next8|next9|next10|next11|swaptail|swapbwd|swaptrace|commsweep|s11a|s11b|s11c|ncu[:SHAPE[:fwd]]|fold|foldbwd|order|orderbwd|selfpull|gather|gather2|gather3|bwdpull|bwdpull2|gluongrp|s14|s15|s15a|s15b|s15c|s15d|s15e|s16a|s16b|s17a|s17b|all]
#   (default all; on the nvidia-h200 device; the GPU tests need three calls: tests, tests1, tests2)
#   bash scripts/gpu_round.sh [multi|epbench|epbench2048|epbench4096|epbenchfp8|epbenchknobs]   (issue 8, on nvidia-h200-x2/x4/x8:
#   one process per GPU)
#
# Each step writes $OUT/<step>.log; a step's failure does not stop the others. Keep the call under the
# device's 10-minute limit: "all" takes about 6-8 minutes (compiles included); split it when it does not fit.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast stays off (KINDS.md: a program using it can take the host's shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/kittenmoe-out}
mkdir -p "$OUT"
what=${1:-all}
summary=()

step() {  # step NAME COMMAND...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-100)")")
}

# The GPU tests take over 11 minutes: three calls (2026-12-01 (5): tests and tests1 together ran past 540 s).
# tests: the multi-process ones (test_distributed); tests1: the backward's, the layer's and FP8's; tests2: the
# forward megakernel, schedule, training and transformers tests (~2 min). -v names each test in the log, so a
# call cut short still says how far it got; each step has its own time limit so the summary always prints.
first=(tests/test_distributed.py)
second=(tests/test_bench_tune.py tests/test_layer.py tests/test_megakernel_bwd.py tests/test_megakernel_fp8.py
        tests/test_fp8.py)
if [[ $what == tests || $what == all ]]; then
  step tests timeout 500 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider "${first[@]}"
fi
if [[ $what == tests1 || $what == all ]]; then
  step tests1 timeout 500 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider "${second[@]}"
fi
if [[ $what == tests2 || $what == all ]]; then
  step tests2 timeout 500 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider tests "${first[@]/#/--ignore=}" \
    "${second[@]/#/--ignore=}"
  step sched python3 -m pytest -q -p no:cacheprovider tests/test_schedule.py -k triton
fi
if [[ $what == bench || $what == all ]]; then
  step fwd python3 benchmarks/fwd_round.py --reps 10 --out "$OUT"
  step bwd python3 benchmarks/bwd_round.py --reps 5 --out "$OUT"
fi
if [[ $what == phases ]]; then  # where the time goes, kimi slice only
  step fwdphase python3 benchmarks/fwd_round.py --shapes kimi-k2.7 --skip-check --breakdown --trace --reps 5 \
    --out "$OUT"
  step bwdphase python3 benchmarks/bwd_round.py --shapes kimi-k2.7 --breakdown --trace --reps 3 --out "$OUT"
fi
if [[ $what == tune || $what == all ]]; then
  export KITTENMOE_CACHE_DIR=$OUT/cache
  step tune python3 -m kittenmoe.cli tune --model kimi-k2.7 --ep 8 --tokens 2048 --out "$OUT"
fi
if [[ $what == ep ]]; then  # expert parallelism: 2 processes sharing the GPU through symmetric memory
  step ep env KITTENMOE_EP_SHARE_GPU=1 python3 -m torch.distributed.run --nproc-per-node 2 examples/ep_layer.py
fi
if [[ $what == hf ]]; then  # whole HF DeepSeek-V3 training steps, kittenmoe vs grouped_mm
  step hf python3 benchmarks/hf_round.py --out "$OUT"
fi
if [[ $what == eptests ]]; then  # every multi-process GPU test (symmetric memory, EP megakernels, EP layer, faults)
  step eptests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_distributed.py
fi
if [[ $what == fp8 ]]; then  # issue 7: the FP8 forward's tests (all of them on the GPU), then its round
  step fp8test python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_megakernel_fp8.py
  step fp8 python3 benchmarks/fp8_round.py --reps 10 --out "$OUT"
fi
if [[ $what == quant ]]; then  # why the quantising pull is slow (benchmarks/quant_probe.py)
  step quant python3 benchmarks/quant_probe.py
fi
if [[ $what == fp8next ]]; then  # what the 2026-12-01 session left unrun on a GPU (then `fp8gemm` on its own)
  step fp8test python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_megakernel_fp8.py
  step fp8kimi python3 benchmarks/fp8_round.py --comm 16 --breakdown --shapes kimi-k2.7 --reps 5 --out "$OUT"
  step mx32 python3 benchmarks/fp8_round.py --comm 16 --scale-block 32 --shapes kimi-k2.7 --reps 5 --out "$OUT"
fi
if [[ $what == wquant ]]; then  # the FP8 weight quantiser (q, scales, q^T) on the Kimi slice, and its bitwise tests
  step wqtest python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k "transpose or chunk"
  step wquant python3 benchmarks/wquant_time.py
fi
if [[ $what == next ]]; then  # what the 2026-12-01 (4) session built after its device time ran out (~6 min)
  step wgtest python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_megakernel_bwd.py -k "wgrad_launch"
  step wgrad python3 benchmarks/wgrad_time.py --shapes kimi-k2.7,deepseek-v4-pro
  step fp8test python3 -m pytest -q -p no:cacheprovider tests/test_megakernel_fp8.py -k "backward or train"
  step fp8kimi python3 benchmarks/fp8_round.py --comm 16 --shapes kimi-k2.7 --reps 5 --out "$OUT"
  step hf python3 benchmarks/hf_round.py --out "$OUT"
  # how much of phase A's 182 program-ms is its epilogue ("A epilogue" in the table): what to shorten next
  step bwdtrace python3 benchmarks/bwd_round.py --shapes kimi-k2.7 --trace --reps 3 --out "$OUT"
fi
if [[ $what == dwsum ]]; then  # the d_w partial summed in order: the probe, the FP8 kept == replayed tests, Kimi's time
  step probe python3 benchmarks/split_sum_probe.py
  step fp8test python3 -m pytest -q -p no:cacheprovider tests/test_megakernel_fp8.py -k "backward or train"
  step dwbwd python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --reps 5 --out "$OUT"
fi
if [[ $what == next2 ]]; then  # KernelConfig.tile_group_m (the order of a minibatch's tiles), ~7 min
  # where GLM's and DeepSeek's forward time goes at the heuristic config (1.43x / 1.39x of the 1.5x goal)
  step fwdtrace python3 benchmarks/fwd_round.py --shapes glm-5.2,deepseek-v4-pro --skip-check --trace --reps 5 \
    --out "$OUT"
  step tgfwd python3 benchmarks/fwd_round.py --reps 10 --out "$OUT" \
    --config ";tile_group_m=2;tile_group_m=4;tile_group_m=8"
  step tgbwd python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --reps 3 --out "$OUT" \
    --config "tile_group_m=4"
fi
if [[ $what == halftail ]]; then  # KernelConfig.half_tail_tiles (gate|up only): GPU bit tests, the four slices (~5 min)
  # the seed slices' bit tests (forward, kept gate|up, backward; gate|up alone and with half_tail_wide) and the
  # refusals outside the built form
  step httest python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py -k "half_tail"
  # with 6 comm programs too: DeepSeek's 8 were busy about half the kernel (trace 2026-12-01: pull 26%, push 29%)
  step htfwd python3 benchmarks/fwd_round.py --reps 10 --out "$OUT" \
    --config ";half_tail_tiles=True;num_comm_programs_fwd=6;num_comm_programs_fwd=6,half_tail_tiles=True"
  step htbwd python3 benchmarks/bwd_round.py --shapes deepseek-v4-pro,kimi-k2.7 --reps 3 --out "$OUT" \
    --config "half_tail_tiles=True"
fi
if [[ $what == bm64 ]]; then  # block_m 64 for BF16: less padding of each expert's rows (DeepSeek: 33% at 128)
  step bm64fwd python3 benchmarks/fwd_round.py --reps 10 --out "$OUT" \
    --config ";block_m=64;block_m=64,num_warps=4;block_m=64,block_n=256,num_stages=3"
  step bm64bwd python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --reps 5 --out "$OUT" \
    --config "block_m=64"
fi
if [[ $what == profile ]]; then  # per-kernel GPU time of the Kimi forward and forward+backward (torch.profiler)
  step fwdprof python3 benchmarks/fwd_round.py --shapes kimi-k2.7 --skip-check --profile --reps 5 --out "$OUT"
  step bwdprof python3 benchmarks/bwd_round.py --shapes kimi-k2.7 --profile --reps 3 --out "$OUT"
fi
if [[ $what == widea ]]; then  # the kept backward's 2x-wide phase A: its GPU tests, then times and a trace
  step bwdtests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_megakernel_bwd.py
  step widea python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --trace --reps 3 --out "$OUT"
fi
if [[ $what == wgrad ]]; then  # the weight-gradient launch's knobs (persistent, two per SM): GPU tests, times (~4 min)
  step wgtest python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_megakernel_bwd.py -k "wgrad_launch"
  step wgrad python3 benchmarks/wgrad_time.py --shapes kimi-k2.7,deepseek-v4-pro --reps 5
fi
if [[ $what == wgradfloor ]]; then  # the weight-gradient launch's floors (MMA only, no store, store only), ~3 min
  step wgfloor python3 benchmarks/wgrad_floor.py --shapes kimi-k2.7,deepseek-v4-pro
  # SM clock and power every 100 ms beside the timing probe: does sustained load lower the clock?
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
    > "$OUT/clocks.csv" 2>&1 &
  smi=$!
  trap 'kill "$smi" 2>/dev/null' EXIT  # also when the call is cut short
  step timing python3 benchmarks/timing_probe.py --out "$OUT"
  kill "$smi"
fi
if [[ $what == bwdstages ]]; then  # KernelConfig.bwd_num_stages=4: its bit test, then Kimi and DeepSeek (~4 min)
  step bstest python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_megakernel_bwd.py \
    -k "wgrad_launch and bwd-num-stages"
  step bstime python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --reps 5 --out "$OUT" \
    --config "bwd_num_stages=4"
fi
if [[ $what == fp8gemm ]]; then  # can the block-scaled e4m3 GEMM overlap MMA and promotion (variants, occupancy)
  step fp8gemm python3 benchmarks/fp8_gemm_probe.py
fi
if [[ $what == multi ]]; then  # issue 8: the link, the EP example over NCCL, every multi-process GPU test
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  step topo nvidia-smi topo -m
  step p2p python3 -m torch.distributed.run --nproc-per-node "$ngpu" benchmarks/p2p_probe.py --out "$OUT"
  step epnccl python3 -m torch.distributed.run --nproc-per-node "$ngpu" examples/ep_layer.py
  step eptests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_distributed.py
  step eptrace python3 -m torch.distributed.run --nproc-per-node "$ngpu" benchmarks/ep_trace.py --out "$OUT"
fi
if [[ $what == epbench* ]]; then  # issue 8: kittenmoe bench, one process per GPU, vs NCCL + PyTorch (all-to-all)
  # epbench: all four rows; epbench2048 / epbench4096 / epbenchfp8: one of them (each fits one 10-minute call)
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  run="python3 -m torch.distributed.run --nproc-per-node $ngpu -m kittenmoe.cli bench --ep 8 --mode both --reps 20 --out $OUT"
  all=kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2
  if [[ $what == epbench || $what == epbench2048 ]]; then
    step ep-2048 $run --model $all --tokens 2048
    step ep-zipf $run --model kimi-k2.7 --tokens 2048 --routing zipf:1.2
  fi
  # the 2026-12-01 knob at EP: two chunks in flight a comm program
  [[ $what == epbenchknobs ]] && step ep-knobs $run --model kimi-k2.7,deepseek-v4-pro --tokens 2048 \
    --config copy_prefetch=True
  # more programs on the remote pull (109 GB/s from 16 CTAs, 336 from 132: p2p_probe), with and without prefetch
  [[ $what == epbenchknobs ]] && step ep-comm24 $run --model kimi-k2.7 --tokens 2048 \
    --config num_comm_programs_fwd=24,num_comm_programs_bwd=24
  [[ $what == epbenchknobs ]] && step ep-comm24pf $run --model kimi-k2.7 --tokens 2048 \
    --config num_comm_programs_fwd=24,num_comm_programs_bwd=24,copy_prefetch=True
  [[ $what == epbench || $what == epbench4096 ]] && step ep-4096 $run --model $all --tokens 4096
  [[ $what == epbench || $what == epbenchfp8 ]] && step ep-fp8 $run --model $all --tokens 2048 --fp8 128
fi
if [[ $what == ab ]]; then  # 2026-12-01 (7): the backward knobs that gained 1-3%, timed interleaved (~7 min)
  # SM clock, power and the reasons the driver gives for a lowered clock, every 200 ms beside the runs (the
  # timing probe saw the clock fall 1,980 -> ~1,650 MHz under load); the older field names if the driver wants them
  q=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu
  if nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv > /dev/null 2>&1; then
    q=$q,clocks_event_reasons.active,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown
  else
    q=$q,clocks_throttle_reasons.active,clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown
  fi
  nvidia-smi --query-gpu=$q --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
  smi=$!
  trap 'kill "$smi" 2>/dev/null' EXIT  # also when the call is cut short
  step abbwd timeout 420 python3 benchmarks/bwd_round.py --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 \
    --reps 5 --out "$OUT" --config "wgrad_persistent=True;wgrad_persistent=True,bwd_num_stages=4"
  step abfwd timeout 150 python3 benchmarks/fwd_round.py --reps 10 --out "$OUT"
  kill "$smi"
fi
if [[ $what == next7 ]]; then  # what session (7) built after its device time ran out (~8 min)
  # half_tail_tiles with 64 x 128 wgmmas: its bit tests (full tiles' bits), then the four slices interleaved
  step httest timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py -k "half_tail"
  step htfwd timeout 200 python3 benchmarks/fwd_round.py --reps 10 --out "$OUT" --config ";half_tail_tiles=True"
  # kittenmoe bench timed in interleaved rounds: the two-process GPU test (measure_ranks_rounds) and one real row
  step benchgpu timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_bench_tune.py
  step bench timeout 150 python3 -m kittenmoe.cli bench --model kimi-k2.7 --ep 8 --tokens 2048 --mode both \
    --out "$OUT"
fi
if [[ $what == next8 ]]; then  # the kept shared gate|up (session 8/9, ~6 min)
  # its bit promises on the GPU: FP8 kept == replayed (now the shared part too), the kept shared gate|up tests,
  # the backward's and the layer's GPU tests
  step keptgpu timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fp8.py \
    tests/test_megakernel_bwd.py -k "replay_equals_kept or shared_gate_up or (gpu and saved)"
  step layergpu timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_layer.py
  # the A/B: the same forward, the backward with the shared gate|up kept vs replayed, interleaved
  step sharedab timeout 250 python3 benchmarks/bwd_round.py --reps 5 --shared-replay --out "$OUT"
fi
if [[ $what == next9 ]]; then  # phase A's kept down dgrad, two K steps an iteration (session 9, ~8 min)
  step unrollgpu timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_bwd.py \
    -k "gpu_phase_a_k_unroll"
  # the kept shared gate|up's phase A in the trace (its tiles now 2 x wide, the down dgrad alone)
  step bwdtrace timeout 150 python3 benchmarks/bwd_round.py --shapes kimi-k2.7 --trace --reps 2 --out "$OUT"
  # chained (the same bits) against two accumulators (even / odd K steps), interleaved with the heuristic
  step unrollab timeout 320 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 --config "bwd_a_k_unroll=2;bwd_a_k_unroll=3"
fi
if [[ $what == next10 ]]; then  # what holds phase A and the half tiles back (session 9, ~4 min)
  step phaseaprobe timeout 200 python3 benchmarks/phase_a_probe.py --out "$OUT"
  # full tiles at the half tiles' 2 stages (and 3): is the half tiles' loss their pipeline depth?
  step fwdstages timeout 240 python3 benchmarks/fwd_round.py --shapes kimi-k2.7,deepseek-v4-pro --reps 5 \
    --out "$OUT" --config "num_stages=2;num_stages=3"
fi
if [[ $what == next11 ]]; then  # the kept phase-A loop deeper (session 9, ~7 min)
  step aknobsgpu timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_bwd.py \
    -k "gpu_phase_a_loop_knobs"
  step phaseaprobe timeout 150 python3 benchmarks/phase_a_probe.py --out "$OUT"
  step astages timeout 330 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 --config "bwd_a_num_stages=6;bwd_a_num_stages=5"
fi
if [[ $what == swaptail ]]; then  # KernelConfig.swap_tail_rows, first GPU run: tests and forward (~5 min)
  step swapgpu timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py -k "swap_tail"
  step swapfwd timeout 200 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" \
    --config ";swap_tail_rows=32;swap_tail_rows=64"
fi
if [[ $what == swapbwd ]]; then  # the backward half of swaptail (the two do not fit one 600 s call)
  step swapbwd timeout 300 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 --config "swap_tail_rows=32;swap_tail_rows=64"
fi
if [[ $what == swaptrace ]]; then  # why swapped tail tiles lose: DeepSeek traces without and with them (~2 min)
  step trace0 python3 benchmarks/fwd_round.py --shapes deepseek-v4-pro --skip-check --trace --reps 2 \
    --out "$OUT/plain" --config ""
  step trace64 python3 benchmarks/fwd_round.py --shapes deepseek-v4-pro --skip-check --trace --reps 2 \
    --out "$OUT/swap64" --config "swap_tail_rows=64"
fi
if [[ $what == commsweep ]]; then  # comm programs again, on today's kernels (last swept 2026-11-29, bwd v5) (~8 min)
  step commfwd timeout 150 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" --shapes deepseek-v4-pro,kimi-k2.7 \
    --config ";num_comm_programs_fwd=6;num_comm_programs_fwd=10"
  step commbwd timeout 380 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 --config "num_comm_programs_bwd=8;num_comm_programs_bwd=12"
fi
if [[ $what == s11a ]]; then  # session 11: block_m 64 x block_n 256 forward again (last timed 2026-12-01 (4)), half-build trace (~5 min)
  step bm64fwd timeout 240 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" \
    --config ";block_m=64,block_n=256,num_stages=3"
  step trace0 timeout 100 python3 benchmarks/fwd_round.py --shapes deepseek-v4-pro --skip-check --trace --reps 2 \
    --out "$OUT/plain" --config ""
  step tracehalf timeout 100 python3 benchmarks/fwd_round.py --shapes deepseek-v4-pro --skip-check --trace --reps 2 \
    --out "$OUT/half" --config "half_tail_tiles=True"
fi
if [[ $what == s11b ]]; then  # session 11: backward comm programs 12 (the heuristic since session 10) against 16 (~5 min)
  step comm16 timeout 320 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b,glm-5.2 --config "num_comm_programs_bwd=16"
fi
if [[ $what == s11c ]]; then  # session 11: FP8 against BF16 on today's kernels, interleaved (last timed 2026-12-01 (5))
  step fp8kimi timeout 560 python3 benchmarks/fp8_round.py --reps 5 --out "$OUT" --shapes kimi-k2.7
fi
if [[ $what == ncu* ]]; then  # hardware counters (Nsight Compute) of one forward+backward, ours and grouped_mm's (~4 min)
  # ncu:SHAPE[:fwd] (default kimi-k2.7); ncu reads counters on this runtime (firecracker, KINDS.md); clocks left alone
  IFS=: read -r _ shape mode <<< "$what"
  shape=${shape:-kimi-k2.7}
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  extra=(); [[ ${mode:-} == fwd ]] && extra=(--forward-only)
  step ncuquery timeout 60 bash -c "'$ncu_bin' --version; '$ncu_bin' --query-metrics --chip gh100 > '$OUT/ncu-metrics.txt' 2>&1; grep -c . '$OUT/ncu-metrics.txt'"
  rep="$OUT/ncu-$shape${mode:+-$mode}${NCU_TAG:+-$NCU_TAG}"
  step ncu timeout 420 "$ncu_bin" --profile-from-start off --clock-control none -f -o "$rep" \
    --kernel-name "regex:dispatch_mlp|combine_mlp|weight_grad|wgrad|cutlass|gemm|grouped|device_kernel" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section LaunchStats --section Occupancy \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum \
    python3 benchmarks/ncu_probe.py --shape "$shape" --config "${NCU_CONFIG:-}" "${extra[@]}"
  step ncucsv timeout 60 bash -c "'$ncu_bin' --import '$rep.ncu-rep' --csv --print-units base --page raw > '$rep-raw.csv' && \
    '$ncu_bin' --import '$rep.ncu-rep' --csv --print-units base --page details > '$rep-details.csv' && wc -l '$rep-raw.csv' '$rep-details.csv'"
fi
if [[ $what == fold ]]; then  # session 11: KernelConfig.fold_tail_rows, first GPU run: tests and forward (~6 min)
  step foldgpu timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py -k "gpu_fold_tail"
  step foldfwd timeout 330 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" \
    --config ";fold_tail_rows=32;fold_tail_rows=64"
fi
if [[ $what == foldbwd ]]; then  # the forward+backward half of fold (~6 min)
  step foldbwd timeout 400 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b,kimi-k2.7 --config "fold_tail_rows=32;fold_tail_rows=64"
fi
if [[ $what == order ]]; then  # session 11: tile_group_m = -1 (expert runs), bits, forward, counters (~5 min)
  step ordergpu timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py \
    -k "test_gpu_bitwise_across_configs"
  step orderfwd timeout 240 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" --config ";tile_group_m=-1"
  NCU_CONFIG="tile_group_m=-1" NCU_TAG=order bash "$0" ncu:deepseek-v4-pro:fwd > "$OUT/ncu-order.log" 2>&1
  step ncuorder tail -n 3 "$OUT/ncu-order.log"
fi
if [[ $what == orderbwd ]]; then  # the forward+backward half of order (~5 min)
  step orderbwd timeout 400 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes deepseek-v4-pro,kimi-k2.7,glm-5.2,qwen3.5-397b-a17b --config "tile_group_m=-1"
fi
if [[ $what == selfpull ]]; then  # session 13: num_comm_programs_fwd = 0 (every SM pulls, then computes), ~6 min
  step selfgpu timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py tests/test_trace.py \
    -k "test_gpu_bitwise_across_configs or gpu_trace"
  step selffwd timeout 360 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" --trace \
    --config "combine_gather=False,num_comm_programs_fwd=12;combine_gather=False,num_comm_programs_fwd=0,push_in_epilogue=True;combine_gather=False,push_in_epilogue=True,num_comm_programs_fwd=12"
fi
if [[ $what == gather ]]; then  # session 13: KernelConfig.combine_gather (no push; the epilogues read rows), ~8 min
  step gathergpu timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_megakernel_fwd.py -k "gpu_combine_gather"
  step gatherfwd timeout 300 python3 benchmarks/fwd_round.py --reps 5 --out "$OUT" --config \
    ";combine_gather=True;combine_gather=True,num_comm_programs_fwd=0;combine_gather=True,num_comm_programs_fwd=6"
  step gatherbwd timeout 250 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro --config "combine_gather=True;combine_gather=True,num_comm_programs_fwd=0"
fi
if [[ $what == gather2 ]]; then  # session 13: forward+backward with combine_gather on the other slices, ~5 min
  step gatherbwd2 timeout 420 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes qwen3.5-397b-a17b,glm-5.2,kimi-k2.7 --config "combine_gather=True;combine_gather=True,num_comm_programs_fwd=0"
fi
if [[ $what == gather3 ]]; then  # session 13: the new one-rank default (combine_gather, no forward comm programs), ~6 min
  step gathertests timeout 230 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_fwd.py \
    tests/test_layer.py -k "seed_slice or cuda_graph or combine_gather or layer"
  step gatherbwd3 timeout 150 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" --shapes kimi-k2.7 \
    --config "combine_gather=False,num_comm_programs_fwd=12"
fi
if [[ $what == bwdpull ]]; then  # next: the backward's pull by every program (num_comm_programs_bwd=0), ~5 min
  step bwdpullgpu timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_fwd.py \
    tests/test_trace.py -k "gpu_combine_gather or gpu_trace"
  step hfgpu timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_transformers.py
  step bwdpull timeout 400 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b --config "num_comm_programs_bwd=0"
fi
if [[ $what == bwdpull2 ]]; then  # meant to repeat bwdpull; run once after the default changed, so an A/A, ~5 min
  step layergpu timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_layer.py tests/test_transformers.py
  step bwdpull2 timeout 400 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b --config "num_comm_programs_bwd=0"
fi
if [[ $what == gluongrp || $what == bwdpull2 ]]; then  # #7: Gluon e4m3 tiles as a grouped GEMM, Kimi slice, ~2 min
  step gluongu timeout 200 python3 benchmarks/gluon_fp8_probe.py --experts 48 --m 384 --n 4096 --k 7168 \
    --stages 4 --modes nolag,chunk4,chunk8,bf16
  step gluondown timeout 150 python3 benchmarks/gluon_fp8_probe.py --experts 48 --m 384 --n 7168 --k 2048 \
    --stages 4 --modes nolag,chunk4,chunk8,bf16
fi
if [[ $what == s14 ]]; then  # the EP drivers after the epilogue refactor, then forward+backward with today's default
  step wsdense timeout 90 python3 benchmarks/gluon_fp8_probe.py --stages 4 --modes ws4,ws8,chunk4,chunk8
  step wsgrp timeout 90 python3 benchmarks/gluon_fp8_probe.py --experts 48 --m 384 --n 4096 --k 7168 \
    --stages 4 --modes ws4,ws8,chunk4
  step eptests14 timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_distributed.py \
    -k "gpu_ep_megakernels_equal_local_peers or gpu_ep_matches_reference or gpu_ep_layer_matches"
  step bwd timeout 300 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT"
fi
if [[ $what == s15 ]]; then  # next: the table's DeepSeek / GLM rows with an A/A pair, then the HF step, ~8 min
  step bwd15 timeout 300 python3 benchmarks/bwd_round.py --reps 5 --aa --out "$OUT" \
    --shapes deepseek-v4-pro,glm-5.2
  step hf15 timeout 240 python3 benchmarks/hf_round.py --out "$OUT"
fi
if [[ $what == s15a ]]; then  # session 15: where each slice's forward+backward GPU time goes now, then s15's A/A rows, ~9 min
  step prof16 timeout 240 python3 benchmarks/bwd_round.py --reps 1 --rounds 1 --profile --out "$OUT/prof" \
    --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b
  step bwd15 timeout 300 python3 benchmarks/bwd_round.py --reps 5 --aa --out "$OUT" \
    --shapes deepseek-v4-pro,glm-5.2
fi
if [[ $what == s15b ]]; then  # session 15: a warp-specialized Gluon weight-gradient kernel against the library's and cutlass's (~3 min)
  step gwgrad timeout 240 python3 benchmarks/gluon_wgrad_probe.py --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b
fi
if [[ $what == s15c ]]; then  # session 15: KernelConfig.wgrad_gluon's GPU tests, then forward+backward with it (~6 min)
  step gluontests timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_bwd.py \
    -k "gluon or wgrad_launch_same_bits"
  step gluonbwd timeout 330 python3 benchmarks/bwd_round.py --reps 5 --aa --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b --config "wgrad_gluon=True"
fi
if [[ $what == s15d ]]; then  # session 15: wgrad_gluon as the default: the layer's, HF's and FP8's GPU tests, the table's
  # rows, the probe's two-stream variant, the HF step (~9 min)
  step layergpu16 timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_layer.py tests/test_transformers.py
  step fp8gpu16 timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_fp8.py -k heuristic
  step bwd16 timeout 300 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b
  step gwgrad2 timeout 100 python3 benchmarks/gluon_wgrad_probe.py --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b
  step hf16 timeout 200 python3 benchmarks/hf_round.py --out "$OUT"  # last: the call may run out of device time
fi
if [[ $what == s15e ]]; then  # session 15, with ~5 minutes of device time left: s15d's checks that matter most (~3 min)
  step layergpu15 timeout 100 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_layer.py
  step fp8gpu15 timeout 60 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_fp8.py -k heuristic
  step bwdkimi15 timeout 80 python3 benchmarks/bwd_round.py --reps 3 --out "$OUT" --shapes kimi-k2.7
fi
if [[ $what == s16a ]]; then  # session 16: where forward+backward's wall time goes beyond its kernels (~3 min)
  step gaps16 timeout 400 python3 benchmarks/bwd_round.py --reps 3 --gaps --out "$OUT" \
    --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b
  step gluontest16 timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_bwd.py -k gluon
fi
if [[ $what == s16b ]]; then  # session 16: the Gluon weight gradients' probe, their GPU tests, the four rows (~4 min)
  step gtail16 timeout 120 python3 benchmarks/gluon_wgrad_probe.py --shapes kimi-k2.7,deepseek-v4-pro,qwen3.5-397b-a17b
  step gtailtest16 timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_megakernel_bwd.py -k "gluon"
  if grep -q " passed" "$OUT/gtailtest16.log" && ! grep -q -i "failed\|error" "$OUT/gtailtest16.log"; then
    step bwdtail16 timeout 260 python3 benchmarks/bwd_round.py --reps 5 --out "$OUT" \
      --shapes kimi-k2.7,deepseek-v4-pro,glm-5.2,qwen3.5-397b-a17b
  fi
fi
if [[ $what == s17a ]]; then  # session 17: the single-process GPU suite (tests1 + tests2 + the schedule's) in one call
  step tests1 timeout 330 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider "${second[@]}"
  step tests2 timeout 200 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider tests "${first[@]/#/--ignore=}" \
    "${second[@]/#/--ignore=}"
  step sched timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_schedule.py -k triton
fi
if [[ $what == s17b ]]; then  # session 17: what s17a's tests2 did not reach, the bench test it failed, then the
  # multi-process GPU tests (processes sharing the one H200), ~9 min
  step tests2b timeout 60 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_megakernel_fwd.py \
    -k "bitwise_across_configs or combine_gather_same_bits or spin_wait_timeout"
  step tests2c timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_schedule.py tests/test_trace.py \
    tests/test_train.py tests/test_transformers.py tests/test_bench_tune.py
  step tests timeout 420 python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider "${first[@]}"
fi
if [[ $what == train || $what == all ]]; then
  step train python3 -m kittenmoe.cli train --device cuda --steps 300
fi

echo
echo "step       rc   time  last line"
printf '%s\n' "${summary[@]}"
