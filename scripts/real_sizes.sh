#!/usr/bin/env bash
# First use, warm load and decoding speed beside llama.cpp, for GGUF files of real shapes (issue #41):
#
#   bash scripts/real_sizes.sh /tmp/shapes/1b-q4km.gguf /tmp/shapes/8b-q4km.gguf
#
# Make the files with scripts/gguf_shapes.py (random weights, llama-quantize's block layouts) and
# llama-bench with scripts/llama_cpp.sh. For each file: a first use with a cache folder of its own
# (only the compiled kernels linked from yours), the default `ask` with lookahead and 32 tokens, its
# wall time, peak RSS and the times its cache files were written (the phases); two warm one-token
# `ask`s; the bytes kept against the file's. Then rounds of `llama-bench -t 2 -n N -p 0 -r 1`, plain
# and lookahead `ask` on the same file, alternated (N: 128 below 1 GB, else 64). The GGUF is read
# once first, as a file just downloaded sits in the page cache.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${LLAMA_BENCH:-.llama.cpp/bin/llama-bench}
LADECHAT=${LADECHAT:-.venv/bin/ladechat}
ROUNDS=${ROUNDS:-3}
KERNELS=${XDG_CACHE_HOME:-$HOME/.cache}/ladechat/kernels
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PROMPT="Tell me a story about a lighthouse."

for file in "$@"; do
  name=$(basename "$file" .gguf)
  cache=$WORK/$name
  mkdir -p "$cache/ladechat"
  [ -d "$KERNELS" ] && ln -s "$KERNELS" "$cache/ladechat/kernels"
  cat "$file" > /dev/null
  echo "== $name: first use ($(date +%T))"
  XDG_CACHE_HOME=$cache /usr/bin/time -f "wall %e s, peak RSS %M KB" "$LADECHAT" ask --keep-alive 0 --no-store \
    --max-new-tokens 32 --model "$file" "Tell me a story." 2>&1 >/dev/null | grep -E "^wall|tok/s" || true
  echo "phases (cache files written):"
  find "$cache/ladechat" -type f -newer "$file" -printf "  %TT %s %P\n" | sort
  for round in 1 2; do
    echo "== $name: warm, one token"
    XDG_CACHE_HOME=$cache /usr/bin/time -f "wall %e s, peak RSS %M KB" "$LADECHAT" ask --keep-alive 0 --no-store \
      --no-lookahead --model "$file" --max-new-tokens 1 "Hi" 2>&1 >/dev/null | grep "^wall"
  done
  kept=$(find "$cache/ladechat/models" -name "*.safetensors" -printf "%s\n" | awk '{s += $1} END {print s}')
  echo "kept $kept bytes, the file $(stat -c %s "$file") bytes"
done

for file in "$@"; do
  name=$(basename "$file" .gguf)
  n=64
  [ "$(stat -c %s "$file")" -lt 1000000000 ] && n=128
  for round in $(seq "$ROUNDS"); do
    llama=$("$BENCH" -m "$file" -t 2 -n $n -p 0 -r 1 2>/dev/null | grep "tg$n" | awk -F'|' '{print $(NF-1)}' | awk '{print $1}')
    speeds=()
    for flag in --no-lookahead --lookahead; do
      speeds+=("$(XDG_CACHE_HOME=$WORK/$name "$LADECHAT" ask --keep-alive 0 --no-store $flag --model "$file" \
        --max-new-tokens $n "$PROMPT" 2>&1 >/dev/null | grep -o "[0-9.]* tok/s" | awk '{print $1}')")
    done
    echo "$name round $round ($n tokens): llama.cpp ${llama} plain ${speeds[0]} lookahead ${speeds[1]} tok/s"
  done
done
