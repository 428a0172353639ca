#!/usr/bin/env bash
# Prepare, on this machine, what scripts/gpu/gguf_sizes.sh carries to the lent GPU machine (which
# reaches no package index): .gpu/gguf/ (git-ignored) with
#   wheels/  the Python 3.12 wheels of scripts/gpu/prepare.sh (transformers, gguf, typer, ...)
#   py/      bitsandbytes unpacked with only its CUDA 13 and CPU libraries (the whole wheel is 43 MB,
#            over what a call carries beside the rest; the device's torch is built for CUDA 13)
#   bin/     llama.cpp's llama-quantize and its shared libraries (bash scripts/llama_cpp.sh builds them)
#   vocab.gguf  the embedded model's tokenizer alone, for scripts/gguf_shapes.py --tokenizer-from
# and prints what a call carries with the working tree (at most 64 MiB).
# Usage: bash scripts/gpu/prepare_gguf.sh   (needs `make .venv/.installed-dev` done)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
BUILD=${LLAMA_CPP_BIN:-.llama.cpp/build/bin}
BNB=${BITSANDBYTES:-bitsandbytes==0.50.2}
bash scripts/gpu/prepare.sh >/dev/null
rm -rf .gpu/gguf
mkdir -p .gpu/gguf/wheels .gpu/gguf/py .gpu/gguf/bin
cp .gpu/call1/wheels/*.whl .gpu/gguf/wheels/
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2046  # one argument per tag option
python3 -m pip download -q --no-deps $("$PY" scripts/gpu/stage.py pip-target | sed 's/--abi cp312//') \
    --platform manylinux_2_24_x86_64 -d "$tmp" "$BNB"
(cd .gpu/gguf/py && unzip -q "$tmp"/bitsandbytes-*.whl -x 'bitsandbytes/libbitsandbytes_cuda1[0-2]*' \
    'bitsandbytes/libbitsandbytes_cuda132*' 'bitsandbytes/libbitsandbytes_rocm*')
cp -L "$BUILD/llama-quantize" .gpu/gguf/bin/
for lib in $(ldd "$BUILD/llama-quantize" | awk -v b="$(cd "$BUILD" && pwd)" 'index($3, b) == 1 {print $1}'); do
    cp -L "$BUILD/$lib" .gpu/gguf/bin/
done
"$PY" scripts/gguf_shapes.py --vocab-only .gpu/gguf/vocab.gguf
tree=$("$PY" -c "import sys; sys.path.insert(0, 'scripts/gpu'); import stage; print(stage.tree_bytes())")
carried=$(du -sb .gpu/gguf | cut -f1)
echo "gguf_sizes: .gpu/gguf $((carried / 1048576)) MiB, with the working tree $(((carried + tree) / 1048576)) MiB (at most 64 MiB)"
[ $((carried + tree)) -le $((64 * 1048576)) ]
