#!/usr/bin/env bash
# torchtitan's MoE modules for a GPU machine without a network (pure-Python wheels, about 1.7 MB), from
# scripts/torchtitan-pins.txt. Run from anywhere:
#
#   bash scripts/titan_wheels.sh pack        on a machine with a network: download the pinned wheels into
#                                            .titan/wheels (carry that folder to the GPU machine)
#   eval "$(bash scripts/titan_wheels.sh unpack)"
#                                            on the GPU machine: install them (--no-deps --no-index) into
#                                            .titan/site and export PYTHONPATH; messages go to stderr
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.titan
PINS=scripts/torchtitan-pins.txt

case ${1:-} in
  pack)
    mkdir -p "$DIR/wheels"
    rm -f "$DIR"/wheels/*.whl
    python3 -m pip download -q --no-deps -d "$DIR/wheels" -r "$PINS"
    ls "$DIR/wheels"
    ;;
  unpack)
    if ! compgen -G "$DIR/wheels/*.whl" > /dev/null; then
      echo "error: no wheels in $DIR/wheels: run 'bash scripts/titan_wheels.sh pack' where there is a network," \
        "then carry $DIR/wheels" >&2
      exit 1
    fi
    site=$PWD/$DIR/site
    rm -rf "$site"
    python3 -m pip install -q --no-deps --no-index --no-compile --ignore-requires-python --target "$site" \
      "$DIR"/wheels/*.whl >&2
    echo "installed $(ls "$DIR/wheels" | tr '\n' ' ')into $site" >&2
    echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; [[ -z ${1:-} ]] || exit 2 ;;
esac
