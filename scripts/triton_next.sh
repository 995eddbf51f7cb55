#!/usr/bin/env bash
# A newer Triton than the GPU machine's (3.6, torch 2.11's) for probes that need it, as one compressed folder that
# travels with the repository (Python 3.12, x86_64 Linux). Run from the repository root:
#
#   bash scripts/triton_next.sh pack     on a machine with a network: download triton==$TRITON_NEXT_VERSION
#                                        (default 3.9.0) for CPython 3.12, keep what compiles and runs CUDA
#                                        kernels, compress it into .triton-next/triton.tar.xz and print its size
#   eval "$(bash scripts/triton_next.sh unpack)"
#                                        on the GPU machine: extract it into .triton-next/site and export
#                                        TRITON_NEXT (that folder: put it first on PYTHONPATH); messages on stderr
#
# Why: the Gluon kernels are written for both Triton 3.6 (the machine's, torch 2.11's) and 3.9 (torch 2.13's;
# kernels/gluon_api.py binds the names 3.9 renamed); their GPU tests run with 3.9 this way:
#   PYTHONPATH=$TRITON_NEXT:src python3 -m pytest -m gpu tests/test_megakernel_fwd_gluon.py ...
# and so do probes that need 3.9's Gluon (its TMA multicast measured in docs/experiments/tma-multicast-weight-tile.md).
# Only processes that ask for it see it: everything else keeps the machine's Triton.
#
# Size: the wheel is 286 MB, installed 1 GB; a device call carries at most 64 MiB with the working tree. Left out:
# the AMD backend's libraries (its Python files stay: Triton imports every backend), Blackwell's ptxas (a link to
# the Hopper one: Triton 3.9 looks for the file even when it compiles for sm_90), CUPTI and proton (profiling
# only), FileCheck; libtriton.so stripped of its debug sections (477 to 192 MB). What is left compresses with
# `xz -9e` to about 53 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.triton-next
VERSION=${TRITON_NEXT_VERSION:-3.9.0}
case "${1:-}" in
pack)
  tmp=$(mktemp -d)
  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    "triton==$VERSION" -d "$tmp" >&2
  mkdir -p "$tmp/site"
  python3 -m zipfile -e "$tmp"/triton-"$VERSION"-*.whl "$tmp/site"
  t="$tmp/site/triton"
  rm -rf "$t/backends/amd/lib" "$t/backends/amd/include" "$t/backends/nvidia/lib/cupti" \
    "$t/backends/nvidia/lib/cupti-blackwell" "$t/_C/libproton.so" "$t/FileCheck" "$t/instrumentation"
  mkdir -p "$t/backends/amd/lib" "$t/backends/amd/include"
  chmod +x "$t/backends/nvidia/bin/"*  # (zipfile drops the mode bits)
  ln -sf ptxas "$t/backends/nvidia/bin/ptxas-blackwell"
  strip --strip-unneeded "$t/_C/libtriton.so"
  mkdir -p "$DIR"
  tar -C "$tmp/site" -cf - . | xz -9e -T0 > "$DIR/triton.tar.xz"
  rm -rf "$tmp"
  ls -l "$DIR/triton.tar.xz" >&2
  ;;
unpack)
  [[ -f $DIR/triton.tar.xz ]] || { echo "no $DIR/triton.tar.xz: bash scripts/triton_next.sh pack" >&2; exit 1; }
  rm -rf "$DIR/site" && mkdir -p "$DIR/site"
  xz -dc "$DIR/triton.tar.xz" | tar -C "$DIR/site" -xf -
  echo "export TRITON_NEXT=$PWD/$DIR/site"
  v=$(PYTHONPATH=$DIR/site python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo "(not importable by $(python3 -V))")
  echo "Triton $v in $DIR/site" >&2
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d'
  exit 1
  ;;
esac
