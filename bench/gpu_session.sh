#!/usr/bin/env bash
# Issue 5 / 6 GPU benchmarks, one step per device command (each well under 10 minutes).
#
#   bash bench/gpu_session.sh setup          # a fresh machine, first: fla-core from the carried wheels (WHEELS, default
#                                            # .whl) into /tmp/site, FlashMLA built from the carried .flashmla_src into
#                                            # /tmp/fbuild and the Kimi mid checkpoint written, the two in parallel
#                                            # (~2 min); every later step takes that build (TANDEM_FLASHMLA_SO unset)
#   bash bench/gpu_session.sh mid-tandem     # 1 x H200: ceilings, Tandem prefill/decode, breakdown, overhead, graphs
#   bash bench/gpu_session.sh mid-hf         # 1 x H200: the same workloads through HF KimiLinearForCausalLM
#   bash bench/gpu_session.sh par-kimi-a     # 2 x H200: Kimi mid, one GPU (all workloads) + pcp=2
#   bash bench/gpu_session.sh par-kimi-b     # 2 x H200: Kimi mid, pp=2 + tp=2
#   bash bench/gpu_session.sh par-qwen       # 2 x H200: Qwen3-8B-layer shape, all layouts
#   bash bench/gpu_session.sh pcp-check      # 2 x H200: tiny Kimi-Linear in fp32 (IEEE dots), pcp2 vs one GPU
#   bash bench/gpu_session.sh pcp-trace      # 2 x H200: Kimi mid 16k / 64k, one GPU and pcp2, with host+device
#                                            # traces of every rank and where each GPU waited (bench/mid/gaps.py)
#   bash bench/gpu_session.sh mla-sweep      # 1 x H200: launch parameters of the MLA latent decode kernel
#   bash bench/gpu_session.sh flashmla       # 1 x H200: build FlashMLA's decode (~85 s; carry .flashmla_src from
#                                            # kernels/flashmla/fetch_sources.sh), check it, then decode b64 4k / 32k
#                                            # in pages of 64 through it and through the Triton kernel (two processes)
#   bash bench/gpu_session.sh mla-prefill    # 1 x H200: MLA prefill with no prefix, Triton vs torch SDPA backends
#   bash bench/gpu_session.sh moe-decode     # 1 x H200: kernels/moe/decode.py vs the grouped path (check + tiles),
#                                            # then decode steps with them (the default since the sixth session)
#   bash bench/gpu_session.sh moe-prefill    # 1 x H200: kernels/moe/prefill.py vs the grouped path (tile sweep at 8k,
#                                            # the best tiles at 32k) and the MoE kernel tests on the GPU
#   bash bench/gpu_session.sh moe-prefill-ab # 1 x H200: Kimi mid prefill 8k / 32k, the MoE experts through the
#                                            # grouped path and the prefill kernels interleaved on one engine
#   bash bench/gpu_session.sh moe-glue       # 1 x H200: the MoE align / combine tests, then each against what it replaced
#   bash bench/gpu_session.sh layout-graphs  # 1 x H200: the layout / piecewise graph tests on the GPU, then prefill 2k / 8k
#                                            # with the KDA cores eager between the pieces and inside them
#   bash bench/gpu_session.sh prefill-cuts   # 1 x H200: MLA SDPA keys out of one GEMM, the tile map, the q|k|v conv
#                                            # with q / k normed (sub-tile sweep), each against what it replaced
#   bash bench/gpu_session.sh moe-tma        # 1 x H200: the MoE gate-up GEMM with the weights through TMA (3 / 4 stages)
#                                            # vs the pointer kernel; its tests
#   bash bench/gpu_session.sh moe-down-tma   # 1 x H200: the MoE down GEMM with both operands through TMA vs grouped_mm
#                                            # and the pointer kernel (4 tiles); its tests; then prefill 8k / 32k
#                                            # with TANDEM_MOE_DOWN_IMPL=grouped_mm and =auto (two processes)
#   bash bench/gpu_session.sh kda-gate-ab    # 1 x H200: the KDA gate inside fla's chunk cumsum (TANDEM_KDA_GATE_IN_CHUNK)
#                                            # tests on the GPU, then prefill 8k / 32k without and with it
#   bash bench/gpu_session.sh residual-ab    # 1 x H200: the residual sum carried into the next layer's norm
#                                            # (TANDEM_FUSED_RESIDUAL=0|1, two processes: prefill 8k, decode
#                                            # b1 / b16 / b64 at 4k / 32k), its tests, then the mla512 agreement
#   bash bench/gpu_session.sh launch-cuts    # 1 x H200: the decode launch cuts' tests (FlashMLA plan, latent write,
#                                            # shared-expert fold, KDA gate in the recurrent kernel), the FlashMLA
#                                            # split sweep (bench/flashmla_parts.py), bench/kda_decode_gate.py
#   bash bench/gpu_session.sh launch-cuts-ab # 1 x H200: decode b1 / b16 / b64 at 4k / 32k + prefill 8k, the tree of
#                                            # the last commit (carry BASELINE=.baseline: `git archive HEAD`) against
#                                            # this one, in two processes on one machine
#   bash bench/gpu_session.sh decode-timeline-ab # 1 x H200: overlapped decode b1 / b16 / b64 at 4k / 32k, graph kernels vs
#                                            # the ops and gaps between replays (bench/decode_timeline.py), the
#                                            # last commit's tree (BASELINE=.baseline) against this one; a tree
#                                            # older than a768806 needs this bench/decode_timeline.py and
#                                            # bench/mid/tandem_bench.py copied into it
#   bash bench/gpu_session.sh env-ab VAR A B # 1 x H200: bench/decode_timeline.py once per value of an env switch
#                                            # (e.g. TANDEM_MOE_ROUTER_GEMV 0 1, TANDEM_MLA_DECODE_IMPL auto triton)
#   bash bench/gpu_session.sh overlap-check  # 1 x H200: overlapped decode vs graph steps across captures, the argmax
#                                            # kernel, then the mla512 agreement (~5 min: give it the call's rest)
#   bash bench/gpu_session.sh gemv           # 1 x H200: the skinny GEMM's tests, its tile sweep against cuBLAS at the
#                                            # mid shapes (bench/gemv_sweep.py), then decode b1 with TANDEM_GEMV=1 / 0
#   bash bench/gpu_session.sh one-row        # 1 x H200: the MoE pair-row and add-norm tests, the 2,048-token agreement
#                                            # with every decode step one row (the skinny GEMM, the norms inside the
#                                            # projections, the MoE without its align): ~3 min
#   bash bench/gpu_session.sh one-row-ab     # 1 x H200: decode b1 at 4k / 32k with the one-row path, then with
#                                            # TANDEM_GEMV=0, TANDEM_MOE_PAIR_ROWS=0, TANDEM_GEMV_ADD_NORM=0 (a process
#                                            # each; the first writes the mid checkpoint: > 150 s on a fresh machine)
#   bash bench/gpu_session.sh moe-one-row    # 1 x H200: the MoE experts' tiles at one token, each kernel its own
#                                            # (bench/moe_decode_sweep.py --pair-rows), then decode b1 at 4k / 32k
#                                            # with the default tiles and with the sweep's best (two processes)
#   bash bench/gpu_session.sh fused-route    # 1 x H200: the router + top-k launch's tests, b1 at 4k / 32k fused
#                                            # (TANDEM_MOE_FUSED_ROUTE_ROWS=1) and not (0), the one-row agreement
#   bash bench/gpu_session.sh combine-norm   # 1 x H200: the FlashMLA Triton combine's and the MoE combine + norm's
#                                            # tests, the one-row agreement, b1 / b16 at 4k / 32k new vs old
#                                            # (TANDEM_FLASHMLA_COMBINE=flashmla TANDEM_MOE_COMBINE_NORM=0), twice
#   bash bench/gpu_session.sh l2-prefetch    # 1 x H200: the prefetch's tests, bench/l2_prefetch.py (forked and serial),
#                                            # then b1 at 4k / 32k with TANDEM_L2_PREFETCH_ROWS=0 / 1, twice
#   bash bench/gpu_session.sh b1-cuts        # 1 x H200: the thirty-second session's one-row cuts (the norm after o_proj,
#                                            # KDA's up-projections in the conv's launch): their tests, b1 / b16 at
#                                            # 4k / 32k with the defaults and each switched off, twice; the one-row
#                                            # agreement (~6 min on a fresh machine with Triton's cache carried)
#   bash bench/gpu_session.sh b1-cuts-33     # 1 x H200: the thirty-third session's launch cuts (the first input norm in
#                                            # the embedding gather's launch, MLA's per-head GEMVs at one query): their
#                                            # tests, b1 / b16 at 4k / 32k with the defaults and each switched off,
#                                            # twice; the one-row agreement (the dense MLP's next norm and the staged
#                                            # int32 rows have no switch: decode-timeline-ab against the tree before)
#   bash bench/gpu_session.sh pdl-prefetch   # 1 x H200: PDL with the one-row GEMVs' weights asked into L2 before their
#                                            # wait: its tests, b1 at 4k / 32k with PDL off, on without the prefetch
#                                            # (the default) and on with it (TANDEM_PDL_PREFETCH_MB=16 / 4), twice; then
#                                            # the 2,048-token one-row agreement with TANDEM_PDL=1 (the run that hit
#                                            # the twenty-fifth session's illegal address)
#   bash bench/gpu_session.sh moe-block      # 1 x H200: the one-token MoE block's launches (the combine + norm in the down
#                                            # launch, the routing in the gate-up launch): their tests, the engine
#                                            # with the launch watched (bench/moe_block_hang.py: give a fresh
#                                            # machine's cold Triton cache minutes), then b1 at 4k / 32k with
#                                            # TANDEM_MOE_DOWN_NORM=0 / 1 and TANDEM_MOE_ROUTE_GATE_UP=0
#   bash bench/gpu_session.sh route-words    # 1 x H200: the fused route + gate-up launch's tests (the flag and the slot
#                                            # words), bench/moe_route_gate_up.py (both forms and the two launches
#                                            # alone, ~1 min, no checkpoint; router and shared expert in L2 and not:
#                                            # --copies 1 / 8), then b1 at 4k / 32k with
#                                            # TANDEM_MOE_ROUTE_SLOT_WORDS=0 / 1, twice (the first writes the mid
#                                            # checkpoint and fills a cold Triton cache: minutes)
#   bash bench/gpu_session.sh block-one-launch # 1 x H200: the one-token MoE block in one launch (the down programs in
#                                            # the route + gate-up launch, TANDEM_MOE_BLOCK_ONE_LAUNCH): its tests,
#                                            # bench/moe_route_gate_up.py (--copies 8; rows for the wait's knobs,
#                                            # kernels/moe/block_down.py), b1 at 4k / 32k with it 0 / 1, twice, then
#                                            # the one-row agreement with it on (slower on an H100: off, 38th session)
#   bash bench/gpu_session.sh ticket-tiles   # 1 x H200: b1 at 4k / 32k with the defaults and the three same-bits knobs
#                                            # of the launches that take tickets, each alone and together: the MoE
#                                            # down's two-level tail (TANDEM_MOE_DOWN_TILE_TICKETS=1), the routed
#                                            # programs polling with acquire loads (TANDEM_MOE_ROUTE_ACQUIRE_POLL=1),
#                                            # the argmax in one launch (TANDEM_ARGMAX_ONE_LAUNCH=1); a process each,
#                                            # RUNS times (2: ~6 min warm). The GEMV tiles (TANDEM_GEMV_ONE_ROW_TILES)
#                                            # and router splits (TANDEM_MOE_ROUTE_SPLIT) left it: 8-70 us slower on
#                                            # an H100 (40th session)
#   bash bench/gpu_session.sh in-proj-conv   # 1 x H200: a KDA layer's in_proj GEMV and short conv in one launch at one
#                                            # token (TANDEM_KDA_IN_PROJ_CONV, 40th session): its tests (graph
#                                            # replays bit for bit the two launches), b1 at 4k / 32k with it 0 / 1,
#                                            # RUNS times (2), then the one-row agreement with it on (~6 min warm)
#   bash bench/gpu_session.sh pdl-check [ARGS] # 1 x H200: every TANDEM_PDL family against PDL off, logits bit for bit
#                                            # in every decode mode, one process a setting (bench/pdl_check.py)
#   bash bench/gpu_session.sh pdl FAMILY...  # 1 x H200: the one-row agreement with TANDEM_PDL=FAMILY for each family
#                                            # given (kernels/pdl.FAMILIES; ~130 s each: two or three a call), to find
#                                            # the launch pair that races with PDL on
#   bash bench/gpu_session.sh op-sites       # 1 x H200: the aten ops of a decode step at b1 / b16 by call site
#                                            # (bench/op_sites.py: each is a graph node beside the Triton launches)
#   bash bench/gpu_session.sh conv-sweep     # 1 x H200: short conv launch parameters vs fla's causal_conv1d
#   bash bench/gpu_session.sh producer       # 1 x H200: prefill with no / inline / encoder-thread handoff producer
#   bash bench/gpu_session.sh prefill-host   # 1 x H200: an 8k / 32k prefill's host enqueue time and its cProfile
#   bash bench/gpu_session.sh prefill-graphs # 1 x H200: prefill 512 .. 8k eager vs piecewise graphs (same engine),
#                                            # then the host time of a graph step by backend group
#   bash bench/gpu_session.sh handoff        # the GPU host's 16 cores: KV handoff gRPC vs raw TCP (issue 3; ~1 min;
#                                            # needs grpcio 1.78.0 + protobuf 6.33.6 + zlib-ng 1.1.0 cp312 wheels too)
#
# Joined tables afterwards (any machine, no GPU):
#   python -m bench.gpu_mid --merge mid_tandem.json mid_hf.json
#   python -m bench.parallel_gpu --report par_kimi_a.json par_kimi_b.json par_qwen.json
#
# Assumes fla-core is installed in /tmp/site (as for bench.gpu_kernels_check). Checkpoints go to /tmp and are
# reused while the machine stays warm (the first command of a machine writes them: ~1-2 min for Kimi mid).
set -euo pipefail
export PYTHONPATH="/tmp/site:${PWD}${PYTHONPATH:+:$PYTHONPATH}"
export TANDEM_KERNEL_FALLBACK=0  # a failed fast path raises: never time a fallback as the fast path (engine/backends/fallback.py)
export TRITON_CACHE_AUTOTUNING=1  # keep fla's autotune results on disk across processes (Triton >= 3.2)
OUT="${OUT:-/tmp/tandem-bench-out}"
mkdir -p "$OUT"
# the setup step's FlashMLA build, unless another is named: a step without it silently times the Triton MLA decode
if [ -z "${TANDEM_FLASHMLA_SO:-}" ] && [ -f /tmp/fbuild/tandem_flashmla.so ]; then
  export TANDEM_FLASHMLA_SO=/tmp/fbuild/tandem_flashmla.so
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
step="${1:?usage: bash bench/gpu_session.sh setup|mid-tandem|mid-hf|par-kimi-a|par-kimi-b|par-qwen|pcp-check|pcp-trace|mla-sweep|flashmla|mla-prefill|moe-decode|moe-prefill|moe-prefill-ab|moe-glue|prefill-cuts|moe-tma|moe-down-tma|kda-gate-ab|residual-ab|launch-cuts|launch-cuts-ab|decode-timeline-ab|env-ab|overlap-check|gemv|one-row|one-row-ab|moe-one-row|fused-route|combine-norm|l2-prefetch|b1-cuts|b1-cuts-33|pdl-prefetch|route-words|block-one-launch|ticket-tiles|in-proj-conv|pdl-check|pdl|op-sites|layout-graphs|conv-sweep|prefill-host|prefill-graphs|producer|handoff}"
shift
case "$step" in
  setup) if [ ! -d /tmp/site/fla ]; then pip install -q --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl; fi
    python -m kernels.flashmla.build --build-dir /tmp/fbuild > "$OUT/flashmla_build.txt" 2>&1 &
    build=$!
    python -c "from pathlib import Path; from bench.mid.checkpoint import MidSpec, write_mid_model
write_mid_model(Path('/tmp/tandem-mid-kimi-8l'), MidSpec('kimi_linear', 8, False))"
    wait "$build" || { tail -5 "$OUT/flashmla_build.txt" >&2; exit 1; }
    tail -1 "$OUT/flashmla_build.txt" ;;
  mid-tandem) python -m bench.gpu_mid --parts tandem --out "$OUT/mid_tandem.json" "$@" ;;
  mid-hf) python -m bench.gpu_mid --parts hf --out "$OUT/mid_hf.json" "$@" ;;
  par-kimi-a) python -m bench.parallel_gpu --arch kimi_linear --layouts single pcp2 --out "$OUT/par_kimi_a.json" "$@" ;;
  par-kimi-b) python -m bench.parallel_gpu --arch kimi_linear --layouts pp2 pp2m4 tp2 --out "$OUT/par_kimi_b.json" "$@" ;;
  par-qwen) python -m bench.parallel_gpu --arch qwen3 --out "$OUT/par_qwen.json" "$@" ;;
  pcp-check) TRITON_F32_DEFAULT=ieee python -m bench.parallel_gpu --tiny --dtype float32 --arch kimi_linear \
      --layouts single pcp2 --pcp-lens 1000 3000 --out "$OUT/pcp_check.json" "$@" ;;
  pcp-trace) TANDEM_PROFILE_DIR="$OUT/rank_traces" TANDEM_PROFILE_TRACE=1 TANDEM_PROFILE_MIN_TOKENS=65536 \
      TANDEM_PROFILE_SKIP=2 TANDEM_PROFILE_STEPS=1 python -m bench.parallel_gpu --arch kimi_linear --layouts single pcp2 \
      --workloads pcp --pcp-lens 16384 65536 --repeat 1 --trace-dir "$OUT/traces" --out "$OUT/pcp_trace.json" "$@"
    python -m bench.mid.gaps "$OUT"/rank_traces/*-trace.json.gz | tee "$OUT/rank_gaps.txt" ;;
  prefill-cuts) python -m bench.mla_sdpa_keys --out "$OUT/mla_sdpa_keys.json" "$@" | tee "$OUT/mla_sdpa_keys.txt"
    python -m bench.conv_planes | tee "$OUT/conv_planes.txt" ;;
  moe-tma) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_prefill_tma.py | tee "$OUT/gpu_tests_moe_tma.txt"
    python -m bench.moe_gate_up_tma --out "$OUT/moe_gate_up_tma.json" "$@" | tee "$OUT/moe_gate_up_tma.txt" ;;
  moe-down-tma) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_prefill_tma.py | tee "$OUT/gpu_tests_moe_down_tma.txt"
    python -m bench.moe_down_tma --out "$OUT/moe_down_tma.json" | tee "$OUT/moe_down_tma.txt"
    for v in grouped_mm auto; do TANDEM_MOE_DOWN_IMPL=$v python -m bench.gpu_mid --parts tandem --prefill 8192 32768 \
      --ctx 1024 --batches 1 --decode-steps 2 --repeat 3 --out "$OUT/mid_moe_down_$v.json" "$@"; done ;;
  kda-gate-ab) python -m pytest -q -p no:cacheprovider tests/kernels/test_short_conv_planes.py -k "gated or engine_tokens" \
      | tee "$OUT/gpu_tests_kda_gate.txt"
    for v in 0 1; do TANDEM_KDA_GATE_IN_CHUNK=$v python -m bench.gpu_mid --parts tandem --prefill 8192 32768 --ctx 1024 \
      --batches 1 --decode-steps 2 --repeat 3 --out "$OUT/mid_kda_gate_$v.json" "$@"; done ;;
  residual-ab) python -m pytest -q -p no:cacheprovider tests/kernels/test_norm_fla.py tests/test_residual_fusion.py \
      | tee "$OUT/gpu_tests_residual.txt"
    for v in 0 1; do TANDEM_FUSED_RESIDUAL=$v python -m bench.gpu_mid --parts tandem --prefill 8192 --ctx 4096 32768 \
      --batches 1 16 64 --profile-batches 1 16 --decode-steps 20 --repeat 2 --out "$OUT/mid_fused_residual_$v.json" "$@"
    done
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 | tee "$OUT/agreement_fused_residual.txt" ;;
  launch-cuts) python -m pytest -q -p no:cacheprovider tests/kernels/test_flashmla_plan.py tests/kernels/test_flashmla.py \
      tests/kernels/test_latent_write.py tests/kernels/test_moe_shared_fold.py tests/kernels/test_norm_fla.py 2>&1 \
      | tee "$OUT/gpu_tests_launch_cuts.txt" || true  # the benches below run whatever the tests say
    python -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py tests/kernels/test_kda_fla.py \
      tests/kernels/test_short_conv_planes.py -k "decode_experts or gate or decode_1d or decode_step" 2>&1 \
      | tee -a "$OUT/gpu_tests_launch_cuts.txt" || true
    python -m bench.flashmla_parts --out "$OUT/flashmla_parts.json" 2>&1 | tee "$OUT/flashmla_parts.txt"
    python -m bench.kda_decode_gate --out "$OUT/kda_decode_gate.json" 2>&1 | tee "$OUT/kda_decode_gate.txt" ;;
  launch-cuts-ab) base="${BASELINE:-.baseline}"
    test -d "$base" || { echo "no baseline tree at $base (git archive HEAD into it, carry it)" >&2; exit 2; }
    args=(--parts tandem --prefill 8192 --ctx 4096 32768 --batches 1 16 64 --profile-batches 1 16 --decode-steps 20
      --repeat 2)
    (cd "$base" && PYTHONPATH="/tmp/site:$PWD" python -m bench.gpu_mid "${args[@]}" --out "$OUT/mid_before.json" "$@")
    python -m bench.gpu_mid "${args[@]}" --out "$OUT/mid_after.json" "$@" ;;
  decode-timeline-ab) base="${BASELINE:-.baseline}"
    test -d "$base" || { echo "no baseline tree at $base (git archive HEAD into it, carry it)" >&2; exit 2; }
    args=(--ctx 4096 32768 --batches 1 16 64 --steps 20)
    (cd "$base" && PYTHONPATH="/tmp/site:$PWD" python -m bench.decode_timeline "${args[@]}" \
      --out "$OUT/decode_timeline_before.json" "$@")
    python -m bench.decode_timeline "${args[@]}" --out "$OUT/decode_timeline_after.json" "$@" ;;
  env-ab) var="${1:?env-ab VAR VALUE...}"; shift
    for v in "$@"; do env "$var=$v" python -m bench.decode_timeline --ctx 4096 32768 --batches 1 16 64 --steps 20 \
      --out "$OUT/decode_timeline_${var}_$v.json" 2>&1 | grep -v -i warn; done ;;
  overlap-check) python -m pytest -q -p no:cacheprovider tests/kernels/test_overlap_gpu.py tests/kernels/test_argmax.py \
      tests/kernels/test_gpu_static_decode.py tests/kernels/test_moe_router.py 2>&1 | tee "$OUT/gpu_tests_overlap.txt" || true
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 2>&1 | grep -v -i warn \
      | tee "$OUT/agreement_overlap.txt" ;;
  gemv) python -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py 2>&1 | tee "$OUT/gpu_tests_gemv.txt" || true
    python -m bench.gemv_sweep --out "$OUT/gemv_sweep.json" | tee "$OUT/gemv_sweep.txt"
    for v in 1 0; do TANDEM_GEMV=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 30 \
      --out "$OUT/decode_timeline_b1_gemv$v.json" 2>&1 | grep "a step"; done ;;
  one-row) python -m pytest -q tests/kernels/test_gemv_add_norm.py tests/kernels/test_moe.py \
      -k "add_norm or mid_shapes or pair_rows or decode_experts or combine" 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_one_row.txt"
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time \
      2>&1 | grep -v -i warn | tee "$OUT/agreement_one_row.txt" ;;
  one-row-ab) for v in TANDEM_GEMV=1 TANDEM_GEMV=0 TANDEM_MOE_PAIR_ROWS=0 TANDEM_GEMV_ADD_NORM=0; do
      echo "== $v"; env "$v" python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 30 \
        --out "$OUT/decode_timeline_b1_${v/=/_}.json" 2>&1 | grep "a step"; done ;;
  moe-one-row) python -m bench.moe_decode_sweep --pair-rows --out "$OUT/moe_one_row_sweep.json" \
      --env-out "$OUT/one_row_tiles.env" 2>&1 | grep -v -i warn | tee "$OUT/moe_one_row_sweep.txt"
    for v in "" "$(cat "$OUT/one_row_tiles.env")"; do echo "== TANDEM_MOE_ONE_ROW_TILES=$v"
      TANDEM_MOE_ONE_ROW_TILES=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 30 \
        --out "$OUT/decode_timeline_b1_tiles${v:+_best}.json" 2>&1 | grep "a step"; done ;;
  moe-block) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route_gate_up.py \
      tests/kernels/test_moe_down_norm.py tests/kernels/test_moe_combine_norm.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_moe_block.txt"
    python -m bench.moe_block_hang --timeout 300 2>&1 | grep -v -i warn | tail -60 | tee "$OUT/moe_block_hang.txt" || true
    for v in TANDEM_MOE_DOWN_NORM=0 TANDEM_MOE_DOWN_NORM=1 TANDEM_MOE_ROUTE_GATE_UP=0; do echo "== $v"
      env "$v" timeout 150 python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 \
        --out "$OUT/decode_timeline_b1_${v/=/_}.json" 2>&1 | grep "a step"; done ;;
  fused-route) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route_fused.py tests/kernels/test_moe_router.py \
      2>&1 | tail -3 | tee "$OUT/gpu_tests_fused_route.txt"
    for v in 1 0; do echo "== TANDEM_MOE_FUSED_ROUTE_ROWS=$v"
      TANDEM_MOE_FUSED_ROUTE_ROWS=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 30 \
        --out "$OUT/decode_timeline_b1_fused_route$v.json" 2>&1 | grep "a step"; done
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time \
      2>&1 | grep -v -i warn | tee "$OUT/agreement_fused_route.txt" ;;
  combine-norm) python -m pytest -q -p no:cacheprovider tests/kernels/test_flashmla_combine.py \
      tests/kernels/test_moe_combine_norm.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_combine_norm.txt"
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time \
      2>&1 | grep -v -i warn | tee "$OUT/agreement_combine_norm.txt"
    for i in 1 2; do for v in new old; do echo "== $v, run $i"
      if [ "$v" = old ]; then export TANDEM_FLASHMLA_COMBINE=flashmla TANDEM_MOE_COMBINE_NORM=0; fi
      python -m bench.decode_timeline --ctx 4096 32768 --batches 1 16 --steps 30 \
        --out "$OUT/decode_timeline_combine_norm_${v}_$i.json" 2>&1 | grep "a step"
      unset TANDEM_FLASHMLA_COMBINE TANDEM_MOE_COMBINE_NORM; done; done ;;
  l2-prefetch) python -m pytest -q -p no:cacheprovider tests/kernels/test_l2_prefetch.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_l2_prefetch.txt"
    python -m bench.l2_prefetch --out "$OUT/l2_prefetch.json" 2>&1 | grep -v -i warn | tee "$OUT/l2_prefetch.txt"
    for i in 1 2; do for v in 0 1; do echo "== TANDEM_L2_PREFETCH_ROWS=$v, run $i"
      TANDEM_L2_PREFETCH_ROWS=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 30 \
        --out "$OUT/decode_timeline_b1_l2_prefetch${v}_$i.json" 2>&1 | grep "a step"; done; done ;;
  b1-cuts) python -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_norm_after.py \
      tests/kernels/test_short_conv_low_rank.py tests/kernels/test_short_conv.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_b1_cuts.txt"
    for i in 1 2; do for sw in "" TANDEM_GEMV_NORM_AFTER=0 TANDEM_KDA_LOW_RANK_IN_CONV=0; do echo "== ${sw:-defaults}, run $i"
      name="${sw:-defaults}"; env $sw python -m bench.decode_timeline --ctx 4096 32768 --batches 1 16 --steps 20 \
        --out "$OUT/decode_timeline_b1_cuts_${name//=/_}_$i.json" 2>&1 | grep "a step"; done; done | tee "$OUT/b1_cuts_ab.txt"
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time 2>&1 \
      | grep -v -i warn | grep "one at a time" | tee "$OUT/agreement_b1_cuts.txt" ;;
  b1-cuts-33) python -m pytest -q -p no:cacheprovider tests/kernels/test_embed_norm.py tests/kernels/test_gemv_heads.py \
      tests/kernels/test_gemv_norm_after.py tests/kernels/test_flashmla.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_b1_cuts_33.txt"
    for i in 1 2; do for sw in "" TANDEM_EMBED_NORM=0 TANDEM_MLA_HEAD_GEMV=0; do echo "== ${sw:-defaults}, run $i"
      name="${sw:-defaults}"; env $sw python -m bench.decode_timeline --ctx 4096 32768 --batches 1 16 --steps 20 \
        --out "$OUT/decode_timeline_b1_cuts_33_${name//=/_}_$i.json" 2>&1 | grep "a step"; done; done \
      | tee "$OUT/b1_cuts_33_ab.txt"
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time 2>&1 \
      | grep -v -i warn | grep "one at a time" | tee "$OUT/agreement_b1_cuts_33.txt" ;;
  route-words) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route_gate_up.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_route_words.txt"
    for c in 1 8; do python -m bench.moe_route_gate_up --copies $c --out "$OUT/moe_route_gate_up_c$c.json" 2>&1 \
      | grep -v -i warn | tee -a "$OUT/moe_route_gate_up.txt"; done
    for i in 1 2; do for v in 0 1; do echo "== TANDEM_MOE_ROUTE_SLOT_WORDS=$v, run $i"
      TANDEM_MOE_ROUTE_SLOT_WORDS=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 \
        --out "$OUT/decode_timeline_route_words_${v}_$i.json" 2>&1 | grep "a step"; done; done \
      | tee "$OUT/route_words_ab.txt" ;;
  pdl-prefetch) python -m pytest -q -p no:cacheprovider tests/kernels/test_pdl_prefetch.py tests/kernels/test_pdl.py \
      2>&1 | tail -3 | tee "$OUT/gpu_tests_pdl_prefetch.txt"
    for i in 1 2; do for sw in TANDEM_PDL=0 TANDEM_PDL=1 "TANDEM_PDL=1 TANDEM_PDL_PREFETCH_MB=16" \
        "TANDEM_PDL=1 TANDEM_PDL_PREFETCH_MB=4"; do echo "== $sw, run $i"; name="${sw// /_}"
      env $sw python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 \
        --out "$OUT/decode_timeline_pdl_prefetch_${name//=/_}_$i.json" 2>&1 | grep "a step"; done; done \
      | tee "$OUT/pdl_prefetch_ab.txt"
    TANDEM_PDL=1 python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 \
      --one-at-a-time 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/agreement_pdl_prefetch.txt" ;;
  block-one-launch) python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_block_one_launch.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_block_one_launch.txt"
    python -m bench.moe_route_gate_up --out "$OUT/moe_block.json" 2>&1 | grep -v -i warn | tee "$OUT/moe_block.txt"
    for i in 1 2; do for v in 0 1; do echo "== TANDEM_MOE_BLOCK_ONE_LAUNCH=$v, run $i"
      TANDEM_MOE_BLOCK_ONE_LAUNCH=$v python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 \
        --out "$OUT/decode_timeline_block_one_launch_${v}_$i.json" 2>&1 | grep "a step"; done; done \
      | tee "$OUT/block_one_launch_ab.txt"
    TANDEM_MOE_BLOCK_ONE_LAUNCH=1 python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 \
      --tokens 128 --one-at-a-time 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/agreement_block_one_launch.txt" ;;
  ticket-tiles) three="TANDEM_MOE_DOWN_TILE_TICKETS=1 TANDEM_MOE_ROUTE_ACQUIRE_POLL=1 TANDEM_ARGMAX_ONE_LAUNCH=1"
    for i in $(seq "${RUNS:-2}"); do for v in "" TANDEM_MOE_DOWN_TILE_TICKETS=1 TANDEM_MOE_ROUTE_ACQUIRE_POLL=1 \
        TANDEM_ARGMAX_ONE_LAUNCH=1 "$three"; do
      echo "== ${v:-defaults}, run $i"
      env $v timeout 180 python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 2>&1 \
        | grep "a step" || echo "failed or timed out: ${v:-defaults}"; done; done \
      | tee "$OUT/ticket_tiles_ab.txt" ;;
  in-proj-conv) python -m pytest -q -p no:cacheprovider tests/kernels/test_in_proj_conv.py \
      tests/kernels/test_short_conv_low_rank.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_in_proj_conv.txt"
    for i in $(seq "${RUNS:-2}"); do for v in 0 1; do
      echo "== TANDEM_KDA_IN_PROJ_CONV=$v, run $i"
      TANDEM_KDA_IN_PROJ_CONV=$v timeout 180 python -m bench.decode_timeline --ctx 4096 32768 --batches 1 --steps 20 \
        2>&1 | grep "a step" || echo "failed or timed out: TANDEM_KDA_IN_PROJ_CONV=$v"; done; done \
      | tee "$OUT/in_proj_conv_ab.txt"
    TANDEM_KDA_IN_PROJ_CONV=1 python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 \
      --tokens 128 --one-at-a-time 2>&1 | grep -v -i warn | tail -3 | tee "$OUT/agreement_in_proj_conv.txt" ;;
  pdl-check) python -m bench.pdl_check --drill "$@" 2>&1 | grep -v -i warn | tee "$OUT/pdl_check.txt" ;;
  pdl) for fam in "$@"; do echo "== TANDEM_PDL=$fam"; TANDEM_PDL=$fam python -m bench.gpu_agreement --arch kimi_linear \
      --preset mla512 --prompts 16 --tokens 128 --one-at-a-time 2>&1 | grep -v -i warn | grep "one at a time\|Error" \
      | head -3 | tee -a "$OUT/agreement_pdl.txt"; done ;;
  op-sites) for b in 1 16; do python -m bench.op_sites --ctx 4096 --batch $b "$@" | tee "$OUT/op_sites_b$b.txt"; done ;;
  mla-sweep) python -m bench.mla_decode_sweep --out "$OUT/mla_sweep.json" "$@" ;;
  flashmla) python -m bench.flashmla_check --out "$OUT/flashmla_check.json" | tee "$OUT/flashmla_check.txt"
    for impl in flashmla triton; do
      TANDEM_MLA_DECODE_IMPL=$impl python -m bench.gpu_mid --parts tandem --page-size 64 --prefill 8192 \
        --ctx 4096 32768 --batches 64 --decode-steps 10 --repeat 2 --out "$OUT/mid_p64_$impl.json" "$@"
    done ;;
  mla-prefill) python -m bench.mla_prefill_sdpa --out "$OUT/mla_prefill_sdpa.json" "$@" ;;
  moe-decode) python -m bench.gpu_kernels_check --only moe | tee "$OUT/moe_check.txt"
    TANDEM_MOE_DECODE_KERNELS=1 python -m bench.gpu_mid --parts tandem --prefill 8192 --ctx 4096 32768 \
      --batches 1 16 64 --decode-steps 20 --repeat 2 --out "$OUT/mid_tandem_moe_decode.json" "$@" ;;
  moe-prefill) python -m pytest -q tests/kernels/test_moe_prefill.py tests/kernels/test_moe.py \
      tests/kernels/test_gpu_backend.py -k "moe or prefill" 2>&1 | tee "$OUT/gpu_tests_moe_prefill.txt"
    python -m bench.moe_prefill_sweep --out "$OUT/moe_prefill_sweep.json" "$@" | tee "$OUT/moe_prefill_sweep.txt" ;;
  moe-prefill-ab) python -m bench.gpu_mid --parts tandem --prefill 8192 32768 --ctx 4096 32768 --batches 64 \
      --decode-steps 10 --repeat 3 --moe-prefill-ab --out "$OUT/mid_tandem_moe_ab.json" "$@" ;;
  moe-glue) python -m pytest -q tests/kernels/test_moe.py -k "align or combine" 2>&1 | tee "$OUT/gpu_tests_moe_glue.txt"
    python -m bench.moe_prefill_glue --out "$OUT/moe_prefill_glue.json" "$@" | tee "$OUT/moe_prefill_glue.txt" ;;
  layout-graphs) python -m pytest -q tests/kernels/test_prefill_layouts.py tests/kernels/test_prefill_graphs_gpu.py \
      2>&1 | tee "$OUT/gpu_tests_layouts.txt"
    python -m bench.gpu_mid --parts tandem --prefill 2048 8192 --ctx 4096 --batches 64 --decode-steps 10 --repeat 3 \
      --out "$OUT/mid_tandem_layouts.json" "$@" ;;
  conv-sweep) python -m bench.short_conv_sweep --out "$OUT/short_conv_sweep.json" "$@" ;;
  prefill-host) python -m bench.prefill_host --lengths 8192 32768 --out "$OUT/prefill_host.json" "$@" \
      | tee "$OUT/prefill_host.txt" ;;
  prefill-graphs) python -m bench.gpu_mid --parts tandem --prefill 512 1024 2048 4096 8192 --ctx 4096 --batches 64 \
      --decode-steps 10 --repeat 3 --out "$OUT/mid_tandem_prefill_graphs.json" "$@"
    python -m bench.prefill_host --lengths 2048 8192 --cuda-graphs --out "$OUT/prefill_host_graphs.json" \
      | tee "$OUT/prefill_host_graphs.txt" ;;
  producer) python -m bench.producer_overhead --prefill 8192 32768 "$@" | tee "$OUT/producer_overhead.txt" ;;
  handoff) python -m bench.handoff --total-mib 128 --repeats 3 "$@" | tee "$OUT/handoff.txt" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
