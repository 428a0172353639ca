#!/usr/bin/env bash
# A GGUF at a real size on the lent GPU, as a user runs it (issue #41: the tensors dequantized one by
# one into the GPU's dtype; issue #42: the GPU sentences of the documents measured), one device call
# per part, each complete in itself (nothing is left for a later call):
#   A. an 8B-shape Q4_K_M file (random weights, written here with gguf-py, quantized by llama.cpp's
#      llama-quantize), then `ladechat ask --json` on it with its GPU defaults (compiled steps),
#      lookahead on and off: wall time from start to answer, peak RSS, peak GPU memory, tok/s, and
#      whether the two answers are the same tokens
#   B. a 1B-shape Hugging Face folder (random weights, its config and tokenizer read from a GGUF by
#      ladechat), asked with --load-in-4bit (bitsandbytes) and with --device-map auto, lookahead on and
#      off each: the same figures
#   C. the GGUF's dense tensors dequantized on the GPU (engine/load/gguf/dequantize.py): tests/test_dequantize.py
#      there (every type's bits on CUDA, a dense load on CUDA equal to transformers'), a 1B-shape Q4_K_M
#      read onto the GPU by gguf-py then by torch in one process (scripts/gpu/load_time.py: seconds,
#      the same weights), then the 8B-shape Q4_K_M asked as in A, lookahead then plain. The steps
#      run in the order of what matters most, so a call stopped at its limit keeps the first ones.
# Prepare here first: bash scripts/gpu/prepare_gguf.sh (fills .gpu/gguf: the wheels, a trimmed
# bitsandbytes, llama-quantize and its libraries, the tokenizer as vocab.gguf). Then
#   run  carry=[".gpu/gguf"]  timeout_s=600  command="bash scripts/gpu/gguf_sizes.sh A"
#   run  carry=[".gpu/gguf"]  timeout_s=360  command="bash scripts/gpu/gguf_sizes.sh B"
#   run  carry=[".gpu/gguf"]  timeout_s=600  command="bash scripts/gpu/gguf_sizes.sh C"
# What comes back: $OUT/results.jsonl (scripts/gpu/measure.py's lines) and $OUT/log.txt.
# LADECHAT_GPU_DRY_RUN=1: the same on this CPU, the tiny shape, --device cpu, the venv's packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?usage: gguf_sizes.sh A|B|C}
CARRIED=$PWD/.gpu/gguf
OUT=${OUT:-/tmp/gguf-sizes-out}
WORK=${GGUF_SIZES_WORK:-/tmp/gguf-sizes}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
RESULTS=$OUT/results.jsonl
PROMPT="Write a short story about a lighthouse keeper who finds a message in a bottle."
if [ "${LADECHAT_GPU_DRY_RUN:-}" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}; DEVICE=cpu; BIG=tiny; SMALL=tiny; NEW=16; SLOWER=4
else
    PY=python3; DEVICE=cuda; BIG=llama-3.1-8b; SMALL=llama-3.2-1b; NEW=128; SLOWER=1
fi
export PYTHONPATH=$PWD:$WORK/site:$CARRIED/py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XDG_CACHE_HOME=$WORK/cache LD_LIBRARY_PATH=$CARRIED/bin:${LD_LIBRARY_PATH:-}
export LADECHAT_KEEP_ALIVE=0

# step NAME LIMIT CMD...: CMD under `timeout -k 5 LIMIT` (times SLOWER in the dry run), its output
# and how it ended in the log
step() {
    local name=$1 limit=$(($2 * SLOWER)) start rc
    shift 2
    echo "== $name (limit ${limit} s): $*" >>"$LOG"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "== $name: rc $rc in $(($(date +%s) - start)) s" >>"$LOG"
    return $rc
}

ask() {  # ask NAME LIMIT ARGS...: one measured `ladechat ask --json`
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$PY" scripts/gpu/measure.py "$RESULTS" "$name" -- \
        "$PY" -m ladechat ask --json --keep-alive 0 --max-new-tokens "$NEW" --device "$DEVICE" "$@" "$PROMPT"
}

q4km() {  # q4km SHAPE LIMIT: $WORK/SHAPE-q4km.gguf made here (F16 by gguf-py, then llama-quantize)
    step make-"$1" "$2" "$PY" scripts/gguf_shapes.py "$1" "$WORK/$1-f16.gguf" --tokenizer-from "$CARRIED/vocab.gguf" \
        --quantize Q4_K_M "$WORK/$1-q4km.gguf" --llama-quantize "$CARRIED/bin/llama-quantize" || return 1
    rm -f "$WORK/$1-f16.gguf"
}

ask_both() {  # ask_both FILE LIMIT LIMIT: the big shape asked with lookahead, then plain, and whether they agree
    ask "$BIG-lookahead" "$2" --model "$1"
    ask "$BIG-plain" "$3" --model "$1" --no-lookahead
    same "$BIG-lookahead" "$BIG-plain"
}

same() {  # same A B: whether two results' answers are the same tokens, in the log
    "$PY" - "$RESULTS" "$1" "$2" >>"$LOG" 2>&1 <<'EOF'
import json, sys
runs = {}
for line in open(sys.argv[1], encoding="utf-8"):
    record = json.loads(line)
    runs[record["name"]] = (record.get("answer") or {}).get("token_ids")
a, b = (runs.get(name) for name in sys.argv[2:4])
verdict = "missing" if a is None or b is None else "identical" if a == b else "DIFFERENT"
print(f"== {sys.argv[2]} vs {sys.argv[3]}: {verdict} ({len(a or [])} and {len(b or [])} tokens)")
EOF
}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"; } >>"$LOG" 2>&1
if [ "${LADECHAT_GPU_DRY_RUN:-}" != 1 ] && [ ! -d "$WORK/site" ]; then
    step install 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$WORK/site" "$CARRIED"/wheels/*.whl || exit 1
fi

case $PART in
A)
    gguf=$WORK/$BIG-q4km.gguf
    if ! q4km "$BIG" 180; then
        [ -f "$WORK/$BIG-f16.gguf" ] || exit 1
        echo "== llama-quantize failed: asking the F16 file instead" >>"$LOG"  # a GGUF too
        gguf=$WORK/$BIG-f16.gguf
    fi
    ask_both "$gguf" 200 170
    ;;
C)
    step dequantize-tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_dequantize.py
    if q4km "$SMALL" 60; then
        step load-$SMALL 100 "$PY" scripts/gpu/load_time.py "$RESULTS" "$SMALL-load" "$WORK/$SMALL-q4km.gguf" \
            --device "$DEVICE" --dtype "$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)"
    fi
    q4km "$BIG" 170 || exit 1
    ask_both "$WORK/$BIG-q4km.gguf" 150 150
    ;;
B)
    folder=$WORK/$SMALL-hf
    step make-$SMALL-hf 60 "$PY" - "$SMALL" "$folder" "$CARRIED/vocab.gguf" "$DEVICE" <<'EOF' || exit 1
# a Hugging Face folder of the shape's size: random weights, the tokenizer of vocab.gguf
import shutil, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "scripts")
import gguf_shapes
from transformers import AutoConfig, AutoModelForCausalLM
from ladechat.engine.load.gguf.files import ensure_prepared
shape, folder, vocab, device = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
with tempfile.TemporaryDirectory() as tmp:
    gguf_shapes.write_f16("tiny", Path(tmp) / "tiny.gguf", tokenizer=vocab)  # its config and tokenizer
    prepared = ensure_prepared(Path(tmp) / "tiny.gguf")
    hidden, inter, layers, heads, kv_heads, context, tied, rope = gguf_shapes.SHAPES[shape]
    config = AutoConfig.from_pretrained(prepared)
    config.update(dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       tie_word_embeddings=tied, rope_theta=rope, max_position_embeddings=min(context, 8192)))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for f in prepared.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copyfile(f, folder / f.name)
print(f"{folder}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF
    ask "$SMALL-4bit-lookahead" 60 --model "$folder" --load-in-4bit
    ask "$SMALL-4bit-plain" 60 --model "$folder" --load-in-4bit --no-lookahead
    same "$SMALL-4bit-lookahead" "$SMALL-4bit-plain"
    ask "$SMALL-devmap-lookahead" 60 --model "$folder" --device-map auto
    ask "$SMALL-devmap-plain" 60 --model "$folder" --device-map auto --no-lookahead
    same "$SMALL-devmap-lookahead" "$SMALL-devmap-plain"
    ;;
*)
    echo "usage: gguf_sizes.sh A|B|C" >&2
    exit 2
    ;;
esac
grep -E "^== .*(rc|identical|DIFFERENT|missing)" "$LOG"
