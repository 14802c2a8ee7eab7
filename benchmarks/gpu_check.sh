#!/usr/bin/env bash
# The GPU checks, in parts, for a machine with one CUDA GPU (a lent device machine; CI never runs this):
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh env internals in_graph_cuda bench_default bench_cudagraphs
#
# A part named with a trailing '+' (`families_diag+`) starts in the background and the next part starts at
# once; the script waits for every part before it packs the logs.
#
#   env               GPU, driver, torch/triton versions; our packages import
#   internals         the canary tests of the private torch names we use (this torch may not be 2.13)
#   in_graph_cuda     the in-graph / in-backward / train_step / DDP-options 2-rank tests, both gloo ranks on
#                     CUDA tensors (DDP_COMPILE_TEST_DEVICE=cuda), Inductor's kernels in Triton
#   transformers_cpu  the Hugging Face in-graph tests with CPU ranks (this torch, no GPU involved)
#   families_diag     BERT, ViT and ResNet per parameter: compile(ddp="in_graph") and ddp="none" against eager
#                     DDP, 2 gloo ranks on CUDA tensors (tests/multi_gpu/families_diag.py), one launch each
#   sync_bn           nn.SyncBatchNorm through split, in_graph, train_step and in-backward against eager DDP, 2 gloo
#                     ranks on CUDA tensors (tests/multi_gpu/test_sync_batchnorm_multirank.py; CPU CI skips it)
#   regions_probe     plain torch.compile of a GPT whose blocks are nested compile regions, on the GPU, with
#                     Inductor's buffer reuse on and off, against eager's gradients (tests/single/regions_probe.py)
#   cudagraphs_probe  each train-step mode under mode="reduce-overhead" against eager DDP, one child process per
#                     mode (a crash names its mode): split, in_graph, and in-backward updates with the train step's
#                     refusal of them under CUDA graphs lifted for the probe (tests/multi_gpu/cudagraph_probe.py)
#   issue34           issue 34 in one device call (BUDGET_S=560, the call's timeout about 590 s): beside the
#                     benchmark's cold compiles, the CUDA-graphs probe of the accumulating modes (PROBE34_MODES)
#                     and the update kernels (benchmarks/update_kernels.py, $OUT/update_kernels.json); the GPU
#                     benchmark (benchmarks/gpu_bench.sh: fp32 and bf16, torch_savvy and our train-step modes;
#                     in fp32 only, after them, the in-backward step with fused=False (Inductor's update instead
#                     of torch's fused kernel) and with Inductor's C++ wrapper, torch_ddpopt and ours_compile
#                     (torch_fused: session 61, and update_kernels; ours_step_in_graph_unfused compiles the
#                     whole foreach step, as long as savvy's, and would crowd phase A's 12 jobs); warm
#                     start-up of torch_savvy and the in-backward step; memory at the peak) under
#                     $OUT/gpu34; then, with the last BENCH34_CG_S seconds (180), the fp32 train-step modes under
#                     CUDA graphs (--compile-mode reduce-overhead) under $OUT/gpu34_cg. PROBE_ARGS,
#                     UPDATE_KERNELS_ARGS, BENCH34_ARGS and BENCH34_CG_ARGS replace the arguments (a CPU dry run)
#   bench_default     the benchmark's single-process part: world size 1 (nccl), comm workload, every compiled
#                     mode, Inductor default mode
#   bench_cudagraphs  the same with --compile-mode reduce-overhead (CUDA graphs) for every mode
#
# Each part has its own time limit and log (under $OUT/logs, tarred to $OUT/logs.tgz at the end); the whole
# script stops starting parts when BUDGET_S seconds are spent. One line per part goes to $OUT/summary.txt.
set -u
export OUT=${OUT:-$PWD/gpu_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-$(($(date +%s) + ${BUDGET_S:-560}))}
BENCH_MODES=${BENCH_MODES:-eager,torch_ddpopt,torch_savvy,ours_compile,ours_in_graph,ours_step,ours_step_in_graph,ours_step_in_backward}
TESTS=(
    tests/multi_gpu/test_in_graph_multirank.py
    tests/multi_gpu/test_in_backward_multirank.py
    tests/multi_gpu/test_in_graph_field_multirank.py
    tests/multi_gpu/test_in_backward_field_multirank.py
    tests/multi_gpu/test_in_backward_inductor_field_multirank.py
    tests/multi_gpu/test_train_step_fused_multirank.py
    tests/multi_gpu/test_transformers_in_graph_multirank.py
    tests/multi_gpu/test_train_step_multirank.py
    tests/multi_gpu/test_ddp_options_multirank.py
)

part() { # part NAME LIMIT_S COMMAND...: run with a limit (cut to what is left), log, one summary line
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - $(date +%s) - 10))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "$name: not run (no time left)" | tee -a "$OUT/summary.txt"
        return
    fi
    local t0
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - t0)) s (limit $limit): $(tail -n 1 "$LOGS/$name.log" | cut -c1-300)" |
        tee -a "$OUT/summary.txt"
}

bench() { # bench NAME MODES EXTRA_ARGS...: the world-size-1 benchmark of the comm workload
    local name=$1 modes=$2
    shift 2
    part "$name" "${BENCH_LIMIT_S:-300}" "$PY" -m benchmarks --workloads comm --world-size 1 --modes "$modes" \
        --rounds 1 --no-cold-warm --no-scaling --no-overlap --no-plot --warmup 3 --steps 20 --timeout "${JOB_TIMEOUT_S:-150}" \
        --out-dir "$OUT/$name" --markdown "$OUT/$name/BENCHMARKS.md" "$@"
}

for arg in "$@"; do
    name=${arg%+}
    if [[ $arg == *+ ]]; then
        GPU_CHECK_CHILD=1 DEADLINE=$DEADLINE bash "$0" "$name" &
        continue
    fi
    case $name in
    env)
        part env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, torch.version.cuda, \
triton.__version__, torch.cuda.get_device_name(0)); import compile_core, ddp, aot, inductor, benchmarks; \
print(\"our packages import\")'"
        ;;
    internals)
        part internals 120 "$PY" -m pytest -q -p no:cacheprovider --timeout 100 -n 4 tests/single/test_torch_internals_*.py
        ;;
    in_graph_cuda)
        part in_graph_cuda "${TESTS_LIMIT_S:-240}" env DDP_COMPILE_TEST_DEVICE=cuda "$PY" -m pytest -q -rfE \
            -p no:cacheprovider --timeout 200 -n "${TEST_WORKERS:-8}" "${TESTS[@]}"
        ;;
    transformers_cpu) # the same model families on CPU ranks of this torch: tells a CUDA failure from a torch one
        part transformers_cpu "${TESTS_LIMIT_S:-240}" "$PY" -m pytest -q -rfE -p no:cacheprovider --timeout 200 \
            -n "${TEST_WORKERS:-8}" -k reduced_inside tests/multi_gpu/test_transformers_in_graph_multirank.py
        ;;
    families_diag)
        part families_diag "${DIAG_LIMIT_S:-300}" bash -c "for m in bert vit resnet; do \
DDP_COMPILE_TEST_DEVICE=cuda $PY -m tests.multi_gpu.families_diag \$m >$LOGS/diag_\$m.txt 2>&1 & done; wait; \
grep -h -E '^(==|   )' $LOGS/diag_*.txt"
        ;;
    sync_bn) # SyncBatchNorm (CUDA only) through split, in_graph, train_step and in-backward, against eager DDP
        part sync_bn "${TESTS_LIMIT_S:-240}" env DDP_COMPILE_TEST_DEVICE=cuda "$PY" -m pytest -q -rfE \
            -p no:cacheprovider --timeout 400 tests/multi_gpu/test_sync_batchnorm_multirank.py
        ;;
    regions_probe) part regions_probe 240 "$PY" -m tests.single.regions_probe cuda ;;
    cudagraphs_probe) part cudagraphs_probe "${PROBE_LIMIT_S:-420}" "$PY" -m tests.multi_gpu.cudagraph_probe --parallel 4 --timeout 300 ;;
    issue34)
        # Beside the benchmark's cold compiles (its phase A: 130 s for 10 jobs in session 61), one after the
        # other so that their kernels never share the GPU: the CUDA-graphs probe (its step times are not read),
        # then the update kernels (their GPU ms are not touched by the compiles beside them; their host ms and
        # compile seconds are). The benchmark's first timed step waits for both while $OUT/hold34 exists (at
        # most 90 s: GPU_BENCH_HOLD, benchmarks/gpu_phases.py).
        touch "$OUT/hold34"
        # shellcheck disable=SC2086 # PROBE_ARGS is a list of arguments
        {
            part probe_in_backward "${PROBE_LIMIT_S:-70}" "$PY" -m tests.multi_gpu.cudagraph_probe --parallel 2 \
                --timeout "${PROBE_CHILD_S:-65}" ${PROBE_ARGS:-${PROBE34_MODES:-in_backward_accum in_graph_accum}}
            part update_kernels "${UPDATE_KERNELS_LIMIT_S:-90}" "$PY" -m benchmarks.update_kernels \
                --out "$OUT/update_kernels.json" ${UPDATE_KERNELS_ARGS:-}
            rm -f "$OUT/hold34"
        } &
        left=$((DEADLINE - $(date +%s) - 30))
        cg=${BENCH34_CG_S:-180} # the fp32 run under CUDA graphs (item 4) gets this much at the end; 0: none
        ((cg > 0 && left - cg < 240)) && cg=0
        # shellcheck disable=SC2086 # BENCH34_ARGS is a list of arguments
        part bench34 "$((left - cg))" env OUT="$OUT/gpu34" BUDGET_S=$((left - cg - 30)) PYTHON="$PY" GPU_BENCH_HOLD="$OUT/hold34" \
            bash benchmarks/gpu_bench.sh "${BENCH34_PRECISION:-fp32,bf16}" ${BENCH34_ARGS:---modes \
            torch_savvy,ours_step,ours_step_in_graph,ours_step_in_backward,ours_step_in_backward_unfused@fp32,\
ours_step_in_backward_cpp@fp32,torch_ddpopt@fp32,ours_compile@fp32 \
            --warm-modes torch_savvy,ours_step_in_backward}
        if ((cg > 0)); then
            left=$((DEADLINE - $(date +%s) - 20))
            # shellcheck disable=SC2086 # BENCH34_CG_ARGS is a list of arguments
            part bench34_cg "$left" env OUT="$OUT/gpu34_cg" BUDGET_S=$((left - 20)) PYTHON="$PY" \
                bash benchmarks/gpu_bench.sh fp32 --compile-mode reduce-overhead --warm-modes '' --tag cudagraphs \
                ${BENCH34_CG_ARGS:---modes torch_savvy,ours_step,ours_step_in_graph,ours_step_in_backward}
        fi
        ;;
    bench_default) bench bench_default "$BENCH_MODES" ;;
    bench_cudagraphs) bench bench_cudagraphs "${CUDAGRAPH_MODES:-$BENCH_MODES}" --compile-mode reduce-overhead ;;
    *) echo "unknown part $name" | tee -a "$OUT/summary.txt" ;;
    esac
done
[[ -n ${GPU_CHECK_CHILD:-} ]] && exit 0 # a background part: the parent packs the logs
wait
tar -czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude summary.txt . 2>/dev/null
for log in "$LOGS"/bench34.log "$LOGS"/bench34_cg.log; do
    [[ -f $log ]] && { echo "--- ${log##*/}"; grep -v -i -E "warn|^- |^<!--" "$log" | tail -n 70 | cut -c1-300; }
done
[[ -f $LOGS/update_kernels.log ]] && { echo "--- update_kernels.log"; grep -E "^(\||AdamW|\{)" "$LOGS/update_kernels.log" | cut -c1-300; }
for log in "$LOGS"/probe_in_backward.log "$LOGS"/cudagraphs_probe.log "$LOGS"/families_diag.log "$LOGS"/regions_probe.log "$LOGS"/sync_bn.log "$LOGS"/in_graph_cuda.log; do # details, up front
    [[ -f $log ]] && { echo "--- ${log##*/}"; grep -v -i warn "$log" | tail -n 40 | cut -c1-400; }
done
rm -rf "$LOGS" "$OUT"/bench_*
cat "$OUT/summary.txt"
