#!/usr/bin/env bash
# ladechat and llama.cpp side by side in one run, on the same GGUF (the embedded model): starts
# llama-server twice, plain and with its n-gram speculation, waits until both are healthy, runs
#     ladechat bench --methods plain,lookahead --weights auto --peer llama.cpp=URL --peer llama.cpp-ngram=URL "$@"
# and stops both servers on exit. A measuring tool, never a dependency: build llama.cpp first
# (scripts/llama_cpp.sh). Idle between requests llama-server sleeps (~0% CPU, measured with top),
# so the servers do not slow ladechat's methods.
#     scripts/peer_bench.sh -d mtbench --limit 3 --single-turn
# Settings by environment: THREADS (2), CTX (4096), PLAIN_PORT (8089), NGRAM_PORT (8090),
# NGRAM_ARGS ("--spec-type ngram-simple"), SERVER_ARGS (both servers, e.g. "--no-repack" where
# llama.cpp's repacked AMX path crashes: Xeon, 2026-12-05), METHODS (plain,lookahead), GGUF (the
# embedded model), LLAMA_CPP_BIN (.llama.cpp/bin), BENCH (schema: scripts/schema_bench.py's answers under
# JSON schemas instead of ladechat bench; its flags then).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LLAMA_CPP_BIN:-$PWD/.llama.cpp/bin}
PY=${PYTHON:-$PWD/.venv/bin/python}
THREADS=${THREADS:-2}
CTX=${CTX:-4096}
PLAIN_PORT=${PLAIN_PORT:-8089}
NGRAM_PORT=${NGRAM_PORT:-8090}
read -r -a NGRAM_ARGS <<<"${NGRAM_ARGS:---spec-type ngram-simple}"
read -r -a SERVER_ARGS <<<"${SERVER_ARGS:-}"
if [[ ! -x $BIN/llama-server ]]; then
    echo "peer_bench.sh: no $BIN/llama-server: build it with scripts/llama_cpp.sh" >&2
    exit 1
fi
GGUF=${GGUF:-$("$PY" -c 'from ladechat.engine.load.gguf.files import embedded_gguf; print(embedded_gguf())')}
LOGS=$(mktemp -d)
PIDS=()

stop() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$LOGS"
}
trap stop EXIT

start() {  # NAME PORT [llama-server args...]
    local name=$1 port=$2
    shift 2
    if "$PY" -c "import socket, sys; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null; then
        echo "peer_bench.sh: port $port is in use (set ${name^^}_PORT to another)" >&2
        exit 1
    fi
    "$BIN/llama-server" -m "$GGUF" -t "$THREADS" -c "$CTX" -np 1 --host 127.0.0.1 --port "$port" ${SERVER_ARGS[@]+"${SERVER_ARGS[@]}"} "$@" \
        >"$LOGS/$name.log" 2>&1 &
    PIDS+=($!)
}

healthy() {  # NAME PORT PID: wait until /health answers 200 (503 while the model loads)
    for _ in $(seq 600); do
        if "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$2/health', timeout=2)" 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$3" 2>/dev/null; then
            echo "peer_bench.sh: llama-server ($1) exited; its log:" >&2
            tail -20 "$LOGS/$1.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "peer_bench.sh: llama-server ($1) not healthy after 300 s" >&2
    exit 1
}

start plain "$PLAIN_PORT"
start ngram "$NGRAM_PORT" "${NGRAM_ARGS[@]}"
healthy plain "$PLAIN_PORT" "${PIDS[0]}"
healthy ngram "$NGRAM_PORT" "${PIDS[1]}"
echo "peer_bench.sh: llama-server on $GGUF (-t $THREADS): plain at :$PLAIN_PORT, ${NGRAM_ARGS[*]} at :$NGRAM_PORT" >&2
# --weights auto: ladechat as a user runs it (a GGUF's blocks on ladechat's kernels), also the
# bench's default; said here so the command line shows it (a later flag wins)
PEERS=(--peer "llama.cpp=http://127.0.0.1:$PLAIN_PORT/v1" --peer "llama.cpp-ngram=http://127.0.0.1:$NGRAM_PORT/v1")
if [[ ${BENCH:-} == schema ]]; then
    "$PY" scripts/schema_bench.py "${PEERS[@]}" "$@"
else
    "$PY" -m ladechat bench --methods "${METHODS:-plain,lookahead}" --weights auto "${PEERS[@]}" "$@"
fi
