#!/usr/bin/env bash
# Fetch the pinned FlashMLA and CUTLASS sources that kernels/flashmla/build.py compiles (needs network and git).
#   bash kernels/flashmla/fetch_sources.sh [DEST]     (default: .flashmla_src, or $TANDEM_FLASHMLA_SRC)
set -euo pipefail
FLASHMLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0  # deepseek-ai/FlashMLA, 2026-04-29
CUTLASS_COMMIT=147f5673d0c1c3dcf66f78d677fd647e4a020219   # NVIDIA/cutlass, FlashMLA's submodule at that commit
DEST=${1:-${TANDEM_FLASHMLA_SRC:-.flashmla_src}}
# where to fetch from (a mirror or a local clone also works)
FLASHMLA_URL=${FLASHMLA_URL:-https://github.com/deepseek-ai/FlashMLA.git}
CUTLASS_URL=${CUTLASS_URL:-https://github.com/NVIDIA/cutlass.git}
fetch() {  # url commit dir
    rm -rf "$3" && git init -q "$3" && git -C "$3" remote add origin "$1"
    git -C "$3" fetch -q --depth 1 origin "$2"
    git -C "$3" checkout -q FETCH_HEAD
    [ "$(git -C "$3" rev-parse HEAD)" = "$2" ] || { echo "$1: got $(git -C "$3" rev-parse HEAD), want $2" >&2; exit 1; }
}
fetch "$FLASHMLA_URL" "$FLASHMLA_COMMIT" "$DEST/FlashMLA"
fetch "$CUTLASS_URL" "$CUTLASS_COMMIT" "$DEST/cutlass"
echo "FlashMLA and CUTLASS sources in $DEST"
