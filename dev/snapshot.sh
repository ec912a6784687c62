#!/usr/bin/env bash
# Make .old/base: the library at git revision REV (default HEAD), importable as the package cupy_rope_base beside
# the working tree, for same_bits.py, layer_loop.py and attn_ab.py (--path .old/base --module cupy_rope_base).
#   bash dev/snapshot.sh [REV]     (then carry .old to the GPU machine; .old/ is git-ignored locally)
set -euo pipefail
rev=${1:-HEAD}
cd "$(git rev-parse --show-toplevel)"
grep -qxF '/.old/' .git/info/exclude 2>/dev/null || echo '/.old/' >> .git/info/exclude
rm -rf .old/base && mkdir -p .old/base
git archive "$rev" cupy_rope kernels_cu | tar -x -C .old/base
mv .old/base/cupy_rope .old/base/cupy_rope_base
# The snapshot finds its CUDA sources beside it (.old/base/kernels_cu), never the working tree's.
sed -i 's/"cupy_rope\.kernels_cu"/"cupy_rope_base.kernels_cu"/' .old/base/cupy_rope_base/_kernels.py
echo "made .old/base/cupy_rope_base from $(git rev-parse --short "$rev")"
