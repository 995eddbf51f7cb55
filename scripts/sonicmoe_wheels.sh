#!/usr/bin/env bash
# SonicMoE and its dependencies for a GPU machine without a network (Python 3.12, x86_64 Linux; its own torch and
# triton are used), as one compressed folder that travels with the repository. Run from anywhere:
#
#   bash scripts/sonicmoe_wheels.sh pack     on a machine with a network: download the pinned wheels, install
#                                            them (--no-deps --target) into .sonic/site-pack, compress that into
#                                            .sonic/sonic.tar.xz and print its size (it must stay under 60 MB)
#   eval "$(bash scripts/sonicmoe_wheels.sh unpack)"
#                                            on the GPU machine: extract .sonic/sonic.tar.xz into .sonic/site and
#                                            export PYTHONPATH (the folder, then its nvidia_cutlass_dsl/
#                                            python_packages, which the wheel's .pth file would add in a
#                                            site-packages but not on PYTHONPATH) and QuACK's caches (below);
#                                            messages go to stderr
#   bash scripts/sonicmoe_wheels.sh pack-cache DIR
#                                            on the GPU machine, after SonicMoE ran: QuACK's cache into
#                                            DIR/quack-cache.tar.gz (carry it back as .sonic/quack-cache.tar.gz)
#   PY312=python3.12 bash scripts/sonicmoe_wheels.sh precompile [--single-cta]
#                                            on a machine without a GPU, with a Python 3.12 that has torch (any
#                                            build): compile every GEMM candidate SonicMoE's autotuner will try on
#                                            sm_90 (scripts/sonic_precompile.py, about 3 minutes on 2 cores) into
#                                            .sonic/quack-cache.tar.gz, over what that archive already holds
#                                            (--single-cta: also benchmarks/probes/cluster_probe.py's candidates)
#
# QuACK keeps each GEMM's autotuning result and compiled objects in QUACK_CACHE_DIR (QUACK_CACHE_AUTOTUNING=1).
# On a fresh machine every GEMM of each SonicMoE pass compiles its candidates and times them on its first call,
# which is where the first calls' minutes go; unpack fills the cache from a carried .sonic/quack-cache.tar.gz
# (the same GPU model and versions: QuACK's cache keys hold its version and each config). The compiled objects
# hold no shape and build without a GPU (precompile), so only the autotuner's timing, per shape, is left to the
# GPU machine; its results (JSON, keyed by shape) come back in pack-cache's archive.
#
# Pinned: sonic-moe 0.1.2.post1 (kittenmoe.baselines_sonic is written against it), quack-kernels 0.3.11,
# nvidia-cutlass-dsl and nvidia-cutlass-dsl-libs-base 4.4.2, cuda-python and cuda-bindings 13.0.3, cuda-pathfinder,
# apache-tvm-ffi, torch-c-dlpack-ext, einops. Installed with --no-deps: torch, triton, numpy and typing-extensions
# are the machine's (sonic-moe's metadata asks for torch <= 2.9.1; its code is what counts).
#
# Size: a device call carries at most 64 MiB with the working tree. The libs-base wheel alone is 74 MB; installed,
# everything is about 300 MB, of which cuda-bindings' Cython sources (*.pyx, *.pxd, *.pxi, *.cpp: 90 MB) are not
# needed to run and are left out. The rest (210 MB, most of it two stripped shared libraries of CuTe DSL's MLIR
# compiler, 144 and 36 MB) compresses with xz's x86 branch filter and a 256 MiB dictionary (larger than the
# 144 MB library, so matches across all of it count) to about 46 MB, against 57 MB with plain `xz -9e`.
# Compressing takes about 3 minutes on one core; unpacking about 3 seconds and 220 MB of memory.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.sonic
ARCHIVE=$DIR/sonic.tar.xz
LIMIT_BYTES=60000000
PINS=(
  sonic-moe==0.1.2.post1
  quack-kernels==0.3.11
  nvidia-cutlass-dsl==4.4.2
  nvidia-cutlass-dsl-libs-base==4.4.2
  cuda-python==13.0.3
  cuda-bindings==13.0.3
  cuda-pathfinder==1.9.1
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
  einops==0.8.2
)
# the GPU machine's interpreter and platform (pip matches manylinux tags exactly, so name each one that occurs)
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
        --platform any)

pack() {
  local pip=(python3 -m pip)
  mkdir -p "$DIR/wheels"
  # one version of each pin in the folder: an older download would be installed beside it
  rm -f "$DIR"/wheels/*.whl
  "${pip[@]}" download -q --no-deps "${TARGET[@]}" -d "$DIR/wheels" "${PINS[@]}"
  rm -rf "$DIR/site-pack"
  # --ignore-requires-python: sonic-moe asks for Python >= 3.12, which the GPU machine has, not necessarily this
  "${pip[@]}" install -q --no-deps --no-index --no-compile --ignore-requires-python --target "$DIR/site-pack" \
    "${TARGET[@]}" "$DIR"/wheels/*.whl
  find "$DIR/site-pack" \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.cpp' -o -name __pycache__ \) \
    -prune -exec rm -rf {} +
  echo "installed: $(du -sh "$DIR/site-pack" | cut -f1); compressing (about 3 minutes) ..." >&2
  tar -C "$DIR/site-pack" -cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > "$ARCHIVE.tmp"
  mv "$ARCHIVE.tmp" "$ARCHIVE"
  local size
  size=$(stat -c %s "$ARCHIVE")
  echo "$ARCHIVE: $size bytes ($((size / 1048576)) MiB)"
  if (( size > LIMIT_BYTES )); then
    echo "error: $ARCHIVE is over $LIMIT_BYTES bytes: with the working tree it would not fit a 64 MiB device call" >&2
    exit 1
  fi
}

unpack() {
  if [[ ! -f $ARCHIVE ]]; then
    echo "error: $ARCHIVE not found: run 'bash scripts/sonicmoe_wheels.sh pack' where there is a network, then" \
      "carry .sonic/sonic.tar.xz" >&2
    exit 1
  fi
  local site=$PWD/$DIR/site
  if [[ ! -f $site/.unpacked || $ARCHIVE -nt $site/.unpacked ]]; then
    rm -rf "$site"
    mkdir -p "$site"
    xz -dc "$ARCHIVE" | tar -C "$site" -xf -
    touch "$site/.unpacked"
    echo "unpacked $ARCHIVE into $site" >&2
  fi
  echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages\${PYTHONPATH:+:\$PYTHONPATH}"
  local cache=${QUACK_CACHE_DIR:-/tmp/quack-cache}
  mkdir -p "$cache"
  if [[ -f $DIR/quack-cache.tar.gz ]]; then
    tar xzf "$DIR/quack-cache.tar.gz" -C "$cache"
    echo "QuACK's cache from $DIR/quack-cache.tar.gz into $cache" >&2
  fi
  echo "export QUACK_CACHE_DIR=$cache TVM_FFI_CACHE_DIR=\${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi-cache} QUACK_CACHE_AUTOTUNING=1"
}

pack_cache() {
  local out=${1:?usage: sonicmoe_wheels.sh pack-cache DIR}
  local cache=${QUACK_CACHE_DIR:-/tmp/quack-cache}
  [[ -d $cache ]] || return 0
  tar czf "$out/quack-cache.tar.gz" -C "$cache" .
  echo "QuACK cache: $(du -sh "$cache" | cut -f1) -> $out/quack-cache.tar.gz ($(du -h "$out/quack-cache.tar.gz" | cut -f1))"
}

precompile() {
  local py=${PY312:-python3.12}
  "$py" -c 'import sys, torch; assert sys.version_info[:2] == (3, 12), sys.version' || {
    echo "error: precompile needs a Python 3.12 with torch (PY312=...): QuACK's cache keys hold the minor version" >&2
    exit 1
  }
  local site=$PWD/$DIR/site cache=$PWD/$DIR/precompile-cache
  rm -rf "$cache"
  # the same folder the GPU machine uses, with the carried archive's cache in $cache: PYTHONPATH, QUACK_CACHE_DIR
  eval "$(QUACK_CACHE_DIR=$cache unpack)"
  "$py" scripts/sonic_precompile.py "$@"
  tar czf "$DIR/quack-cache.tar.gz.tmp" -C "$cache" .
  mv "$DIR/quack-cache.tar.gz.tmp" "$DIR/quack-cache.tar.gz"
  rm -rf "$cache" "$site"  # the unpacked tree (220 MB) must not travel with a device call's carry
  echo "$DIR/quack-cache.tar.gz: $(du -h "$DIR/quack-cache.tar.gz" | cut -f1)"
}

case ${1:-} in
  pack) pack ;;
  precompile) shift; precompile "$@" ;;
  unpack) unpack ;;
  pack-cache) pack_cache "${2:-}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; [[ -z ${1:-} ]] || exit 2 ;;
esac
