#!/usr/bin/env bash
# The GPU checks of a session in one call: installs the wheels the GPU image lacks (carried in .whl/, made
# by ../shared/device/wheels.sh [liger-kernel==0.8.5]), then runs the named steps, logs under $OUT:
#   bash scripts/gpu_session.sh kernel_tests bench_attn train_32k peer_32k train_131k peer_131k
#   bash scripts/gpu_session.sh recall_curve_bg poll; bash scripts/gpu_session.sh poll   # the recall curve
#   bash scripts/gpu_session.sh fp8_quality_bg poll; bash scripts/gpu_session.sh poll    # issue 41's FP8 gate
#   bash scripts/gpu_session.sh bench_fp8 train_32k; BENCH_OVERRIDES="... train.fp8=true" bash ... train_32k
#                                                      # FP8's products, then its step (docs/PERFORMANCE.md)
#                                                      # (.whl/ made by wheels.sh liger-kernel==0.8.5 torchao==0.18.0)
#   bash scripts/gpu_session.sh long_steps poll; bash scripts/gpu_session.sh poll   # jobs longer than a call
#   bash scripts/gpu_session.sh full_32k train_32k full_64k train_64k train_131k   # issue 14's table, then
#   bash scripts/gpu_session.sh full_131k peer_32k peer_131k                       # (over 10 minutes in one)
#   SEQLENS="8192 32768 65536 131072" BENCH_ATTN_ARGS="--rounds 3 --clocks --rep-ms 1000" bash scripts/gpu_session.sh bench_attn
#                                                                    # issue 13's attention table, one run
#   git apply docs/experiments/dq_warp_backward.patch; bash scripts/gpu_session.sh bwd_ab attn_tests
#                                                                    # an attention experiment against HEAD
#   bash scripts/gpu_session.sh cudnn_fp8            # issue 48: cuDNN's FP8 attention against ours, speed and error
#                                                    # (.whl/ made by wheels.sh liger-kernel==0.8.5 nvidia-cudnn-frontend==1.32.0)
set -uo pipefail
# Installed once per machine: a job started in the background by an earlier call still imports from it.
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl && touch /tmp/site/.installed; } || exit 1
# The image's python3 has neither `make setup`'s venv nor its install of this checkout: the wheels and the
# checkout's packages come from PYTHONPATH. The tuning cache stays out of $OUT: at most 8 files come back, and a
# background job outlives its call's $OUT.
export PYTHONPATH=/tmp/site:$PWD${GPU_CAP_DIR:+:$GPU_CAP_DIR} PYTHONUNBUFFERED=1 LONGCTX_TUNING_CACHE=${LONGCTX_TUNING_CACHE:-/tmp/longctx-tuning}
# An 80 GB GPU on a bigger one (docs/PERFORMANCE.md, "How to measure"): GPU_CAP_GIB=79.2 and GPU_CAP_DIR, the folder
# of a sitecustomize.py that caps the CUDA allocator at start-up, before train.py or bench_train.py could set the
# allocator's options; BENCH_OVERRIDES="memory.gpu=h100_80gb memory.host_memory_gib=125" plans the bench steps so.
[ -n "${GPU_CAP_GIB:-}" ] && export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
# The GPU tests in two halves (on the H100 kernel_tests took 5 minutes, training_tests 1.5: both fit one call);
# -v names each result as it comes.
KERNEL_TESTS="tests/test_flash_attention.py tests/test_cudnn_attention.py tests/test_kernels_gpu.py tests/test_rope_swiglu_gpu.py
  tests/test_adamw_kernel.py tests/test_fp8_gpu.py"
# A test still running after 2 minutes has every thread's stack written to the log (a hang shows where it is).
STACKS="-o faulthandler_timeout=120"
TRAINING_TESTS="tests/test_offload.py tests/test_full_finetune.py tests/test_resume.py tests/test_dispatch.py
  tests/test_step.py tests/test_lora_fusion.py tests/test_byte_model.py"
# The files that start processes (torchrun jobs, compiles), and every test file in none of the sets above.
PROCESS_TESTS="tests/test_torchrun.py tests/test_sm80_compile.py"
rest_test_files() { ls tests/test_*.py | grep -vxF -f <(printf '%s\n' $KERNEL_TESTS $TRAINING_TESTS $PROCESS_TESTS); }
# A step's GPU tests: compiled kernels, under a timeout that leaves the call room to return their log
# ($OUT/NAME.log); prints each failure and the summary.
gpu_tests() { local name=$1 limit=$2; shift 2
  TRITON_INTERPRET=0 timeout ${TESTS_TIMEOUT:-$limit} python3 -m pytest -v --tb=short "$@" 2>&1 | tee $OUT/$name.log |
    grep -E "FAILED|ERROR|passed|failed"; }
bench() { python3 scripts/bench_train.py "$@" ${BENCH_OVERRIDES:-} 2>>$OUT/bench_train.err | tee -a $OUT/bench_train.jsonl |
          python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('stack','seq_len','step_s','tokens_per_s','mfu','mfu_measured_ceiling','loss','peak_gpu_allocated_gib','overrides')}, r.get('plan'))"; }
# A job longer than a call: under setsid its process session outlives the call; /tmp/NAME.done marks its end
# and holds its exit status.
background() { local name=$1; shift; rm -f /tmp/$name.done; touch /tmp/$name.started
  setsid nohup bash -c "$*; echo \$? > /tmp/$name.done" > /tmp/$name.out 2>&1 & }
running_jobs() { for started in /tmp/*.started; do [ -e "$started" ] && [ ! -e "${started%.started}.done" ] &&
  basename "${started%.started}"; done; }
# Issue 14: recall_100m trained on the recall task at 32k on the fast path (Triton kernels, offloaded layer
# inputs, kept attention outputs) and on the reference path, both at once from one warm start of 150 steps at
# 4k (recall_curve.py's default at 32k). 1200 steps take about 13 minutes: recall_curve_bg, then poll. Both
# curves in $OUT/recall_curve.png (for docs/), the table and JSON in recall_curve.out, every run's log and
# metrics in $OUT/recall_runs.tar (one file: a call brings back at most 8). To redraw from them:
# `tar xf recall_runs.tar` and recall_curve.py --redraw recall_runs with the same options.
# Issue 41: the same LoRA job at 32k with the frozen base in bf16 and in FP8 (recall_curve.py --compare fp8:
# both from a warm start of 400 steps at 4k), 1000 steps at once; $OUT/fp8_quality.png, fp8_quality.out (its
# last line the JSON, bounds_hold), fp8_runs.tar.
# A recall_curve.py job NAME in the background: run root /tmp/NAME, PNG /tmp/NAME.png, then its options.
recall_job() { local name=$1; shift; rm -rf /tmp/$name
  python3 scripts/recall_curve.py --run-root /tmp/$name --out-png /tmp/$name.png --concurrent "$@"; }
recall_curve() { recall_job recall_curve --steps ${RECALL_STEPS:-1200} ${RECALL_ARGS:-}; }
fp8_quality() { recall_job fp8_quality --compare fp8 --steps ${FP8_STEPS:-1000} ${FP8_ARGS:-}; }
# NAME's PNG, output and runs' logs and metrics (in one tar named TAR) into $OUT.
collect_recall_job() { local name=$1 tar=$2; cp /tmp/$name.png /tmp/$name.out $OUT/
  (cd /tmp && tar cf $OUT/$tar.tar --transform "s,^$name,$tar," \
    $(ls -d $name/*.log $name/*/metrics.jsonl $name/*/train.log 2>/dev/null)); }
# Issue 45's figures in one background job, from a copy of the tree (a later call re-sends the working tree):
# Qwen3-8B LoRA at 32k (bf16 with the last step profiled, train.fp8, the peer), Llama-3 8B's 32k step on this
# tree and on the tree before the model seam (OLD_TREE: `git archive <commit> | tar x -C .old_tree`, carried),
# then Qwen3-8B at 131k (bf16, train.fp8, the peer). One JSON line a run in $OUT/families.jsonl after `poll`.
families() { rm -rf /tmp/families_tree /tmp/families.jsonl; cp -r "$PWD" /tmp/families_tree; cd /tmp/families_tree
  run() { python3 scripts/bench_train.py "$@" >> /tmp/families.jsonl 2>> /tmp/families.err; }
  run --seq-len 32768 --steps 4 --profile model=qwen3_8b
  run --seq-len 32768 --steps 3 model=qwen3_8b train.fp8=true
  run --seq-len 32768 --steps 3 --peer model=qwen3_8b
  run --seq-len 32768 --steps 3
  (cd ${OLD_TREE:-.old_tree} && python3 scripts/bench_train.py --seq-len 32768 --steps 3 >> /tmp/families.jsonl 2>> /tmp/families.err)
  run --seq-len 131072 --steps 2 model=qwen3_8b
  run --seq-len 131072 --steps 2 model=qwen3_8b train.fp8=true
  run --seq-len 131072 --steps 2 --peer model=qwen3_8b; }
# Issue 46's figures in one background job, from a copy of the tree: Mistral-7B at 32k (ours, the peer),
# Qwen2.5-7B at 32k profiled (its q/k/v biases' share of the step) and with train.fp8 (a bias on FP8 projections),
# then LoRA at 131k, ours and the peer, for Llama-3.2-3B and Qwen2.5-7B. One JSON line a run in $OUT/families.jsonl
# after `poll`.
families46() { rm -rf /tmp/families_tree /tmp/families.jsonl; cp -r "$PWD" /tmp/families_tree; cd /tmp/families_tree
  run() { python3 scripts/bench_train.py "$@" >> /tmp/families.jsonl 2>> /tmp/families.err; }
  run --seq-len 32768 --steps 3 model=mistral_7b
  run --seq-len 32768 --steps 3 --peer model=mistral_7b
  run --seq-len 32768 --steps 3 --profile model=qwen2_5_7b
  run --seq-len 32768 --steps 3 model=qwen2_5_7b train.fp8=true
  run --seq-len 131072 --steps 2 model=llama3_2_3b
  run --seq-len 131072 --steps 2 --peer model=llama3_2_3b
  run --seq-len 131072 --steps 2 model=qwen2_5_7b
  run --seq-len 131072 --steps 2 --peer model=qwen2_5_7b; }
export -f recall_job recall_curve fp8_quality families families46
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    kernel_tests) gpu_tests kernel_tests 480 $STACKS $KERNEL_TESTS ;;
    # Every other test file on the GPU machine (CUDA present, the compiler instead of the interpreter), in two
    # steps: together they took 508 s (2026-11-26), too close to a call's limit.
    rest_tests) gpu_tests rest_tests 480 $STACKS $(rest_test_files) ;;
    process_tests) gpu_tests process_tests 480 $STACKS $PROCESS_TESTS ;;
    # The memory engine's CUDA cases (layouts against plain autograd, copy order, a full top layer's peak).
    offload_cuda_tests) gpu_tests offload_cuda_tests 300 tests/test_offload.py -k cuda ;;
    training_tests) gpu_tests training_tests 300 $STACKS $TRAINING_TESTS ;;
    # BENCH_ATTN_ARGS adds options (--profile, --rounds N, --clocks).
    bench_attn) python3 scripts/bench_attention.py --seqlens ${SEQLENS:-8192 32768 65536 131072} --peers cudnn ${BENCH_ATTN_ARGS:-} 2>&1 | tee $OUT/bench_attn.log | tail -24 ;;
    # Work per joule at 32k (one-second cells: NVML's energy counter is too coarse for shorter ones), then the
    # one-pass backward's variants timed and metered in turn (BWD_VARIANTS: names; all of them if empty).
    attn_energy) python3 scripts/bench_attention.py --seqlens 32768 --peers cudnn --rounds 5 --clocks --rep-ms 1000 \
        --no-packed 2>&1 | tee $OUT/attn_energy.log | tail -5 ;;
    bwd_energy) python3 scripts/experiments/backward_variants.py ${BWD_VARIANTS:-} --cases 32k --meter 2>&1 | tee $OUT/bwd_energy.log ;;
    # The working tree's Gluon backward or forward against the file at AB_BASE (HEAD by default; one-second cells,
    # in turn), and the Gluon kernels' GPU tests: an experiment applied as a patch (docs/experiments/*.patch)
    # measured and tested in one call.
    bwd_ab) python3 scripts/experiments/backward_variants.py --base ${AB_BASE:-HEAD} --meter --cases 32k 8k packed-16x4k \
        2>&1 | tee $OUT/bwd_ab.log ;;
    fwd_ab) git show ${AB_BASE:-HEAD}:kernels/flash_attention_hopper.py > /tmp/forward_base.py
      AB_CELL_MS=1000 python3 scripts/experiments/forward_ab.py /tmp/forward_base.py 2>&1 | tee $OUT/fwd_ab.log |
        grep -v "max diff 0 lse max diff 0 nan False" ;;
    # Issue 48: cuDNN's FP8 attention (the cuDNN frontend's sdpa_fp8 graphs; .whl/ needs
    # `wheels.sh liger-kernel==0.8.5 nvidia-cudnn-frontend==1.32.0`) against our bf16 kernels at 8k, 32k and 131k:
    # times and errors against fp32, one JSON line a length in $OUT/cudnn_fp8.jsonl, the whole log in cudnn_fp8.log.
    # CUDNN_FP8_ARGS adds options (--seqlens, --time-limit-s: its default, 540 s, leaves a lone step's call room).
    cudnn_fp8) python3 scripts/experiments/cudnn_fp8_attention.py --json $OUT/cudnn_fp8.jsonl ${CUDNN_FP8_ARGS:-} 2>&1 |
        tee $OUT/cudnn_fp8.log | tail -60 ;;
    attn_tests) gpu_tests attn_tests 300 tests/test_flash_attention.py \
        -k "hopper or very_negative or gpu_deterministic or gpu_packed or compiled_code" ;;
    # FP8 (train.fp8): the products against bf16 and torchao (needs its wheel in .whl/), one layer's error
    bench_fp8) python3 scripts/bench_fp8.py ${BENCH_FP8_ARGS:---torchao} --json $OUT/bench_fp8.json 2>&1 | tee $OUT/bench_fp8.log |
      grep -v "^{" | tail -30 ;;
    train_32k) bench --seq-len 32768 --steps 3 ;;
    train_64k) bench --seq-len 65536 --steps 3 ;;
    train_131k) bench --seq-len 131072 --steps 2 ;;
    full_32k) bench --seq-len 32768 --steps 3 --train full ;;
    # The same job recomputing every layer with its attention: the losses must equal full_32k's.
    full_32k_recompute) bench --seq-len 32768 --steps 3 --train full memory.full_layers=0 memory.kept_attention_layers=0 ;;
    full_64k) bench --seq-len 65536 --steps 3 --train full ;;
    full_131k) bench --seq-len 131072 --steps 2 --train full ;;
    # One step each at 524k then 262k (minutes each, longer than a call), in the background; LONG_SEQLENS
    # picks others.
    long_steps) background long_steps "for s in ${LONG_SEQLENS:-524288 262144}; do python3 scripts/bench_train.py --seq-len \$s --steps 1 ${BENCH_OVERRIDES:-} \
        >> /tmp/long_steps.jsonl 2>> /tmp/long_steps.err; done" ;;
    # Waits for the background jobs (again within 30 s of each return, or the idle machine is given back and
    # they die), then brings back what the finished ones wrote.
    poll) for i in $(seq ${POLL_S:-550}); do [ -z "$(running_jobs)" ] && break; sleep 1; done
        echo "still running: $(running_jobs)"
        for done in /tmp/*.done; do [ -e "$done" ] && echo "$(basename ${done%.done}) exit $(cat $done)"; done
        if [ -f /tmp/long_steps.done ]; then cp /tmp/long_steps.jsonl /tmp/long_steps.err $OUT/
          tail -n 4 /tmp/long_steps.err; cut -c1-600 /tmp/long_steps.jsonl; fi
        if [ -f /tmp/recall_curve.done ]; then collect_recall_job recall_curve recall_runs
          grep -v '^{' /tmp/recall_curve.out | tail -8; fi
        if [ -f /tmp/families.started ] || [ -f /tmp/families46.started ]; then cp /tmp/families.jsonl /tmp/families.err $OUT/ 2>/dev/null
          python3 -c "import json; [print({k: r.get(k) for k in ('stack','seq_len','step_s','tokens_per_s','peak_gpu_allocated_gib','overrides')}) for r in map(json.loads, open('/tmp/families.jsonl'))]"; fi
        if [ -f /tmp/full_1m_x4.done ]; then cp /tmp/full_1m_x4.log $OUT/; cp /tmp/full_1m_x4/*.log $OUT/ 2>/dev/null
          tail -n 6 /tmp/full_1m_x4.log; fi
        if [ -f /tmp/fp8_quality.done ]; then collect_recall_job fp8_quality fp8_runs
          grep -v '^{' /tmp/fp8_quality.out | tail -8; fi ;;
    peer_32k) bench --seq-len 32768 --steps 3 --peer ;;
    peer_64k) bench --seq-len 65536 --steps 3 --peer ;;
    peer_131k) bench --seq-len 131072 --steps 2 --peer ;;
    # torch.profiler over the last step: GPU time by kind in bench_train.err (scripts/step_profile.py).
    profile_64k) bench --seq-len 65536 --steps 2 --profile ;;
    profile_131k) bench --seq-len 131072 --steps 2 --profile ;;
    # The training tests that need a GPU, without the offload ones. A call of their own: one CUDA case of
    # test_resume did not finish within 200 s (2026-11-25).
    step_tests) gpu_tests step_tests 420 tests/test_resume.py tests/test_step.py tests/test_lora_fusion.py \
        tests/test_byte_model.py ;;
    # cuDNN attention's GPU tests, the 524k one (its backward over head groups against flash attention) included.
    cudnn_tests) LONGCTX_LONG_GPU_TESTS=1 gpu_tests cudnn_tests 300 tests/test_cudnn_attention.py ;;
    # Two GPUs: LoRA with FSDP2 (a bf16 base and fp32 adapters gathered together) against the same job
    # unsharded, two steps each; the losses side by side.
    lora_shard) for shard in false true; do
        torchrun --standalone --nproc-per-node 2 train.py model=llama3_8b model.num_hidden_layers=4 seq_len=32768 \
          parallel.sequence=2 parallel.shard=$shard max_steps=3 logger.wandb.mode=disabled logger.progress_bar=false checkpoint.save_random_base=false \
          output_dir=/tmp/lora_shard_$shard > $OUT/lora_shard_$shard.log 2>&1; echo "shard=$shard exit $?"
        grep -E "step [0-9]/|FSDP2|peak" $OUT/lora_shard_$shard.log | tail -5; done ;;
    # Several GPUs (nvidia-h200-x2): SIGTERM to one rank, resume on 2 and on 1 (deterministic kernels, so
    # the resume on 2 is exact); then 131k LoRA on one GPU and sequence parallel on two, in one run.
    parallel_tests) LONGCTX_TORCHRUN_JOB="device=cuda deterministic=true model=llama3_8b model.num_hidden_layers=2 train=lora seq_len=16384" \
        LONGCTX_TORCHRUN_RTOL=2e-2 python3 -m pytest -v --tb=short tests/test_torchrun.py -k sigterm 2>&1 | tee $OUT/parallel_tests.log | grep -E "FAILED|ERROR|passed|failed" ;;
    # The same on 4 GPUs (nvidia-h100-x4, issue 49): SIGTERM to one of 4 ranks, resume on 4 and on 2.
    parallel_tests_x4) LONGCTX_TORCHRUN_PROCESSES=4 LONGCTX_TORCHRUN_JOB="device=cuda deterministic=true model=llama3_8b model.num_hidden_layers=2 train=lora seq_len=16384" \
        LONGCTX_TORCHRUN_RTOL=2e-2 python3 -m pytest -v --tb=short tests/test_torchrun.py -k sigterm 2>&1 | tee $OUT/parallel_tests_x4.log | grep -E "FAILED|ERROR|passed|failed" ;;
    parallel_131k) python3 scripts/bench_parallel.py --seq-len 131072 --gpus 1 2 --steps 3 --work-dir /tmp/bench_parallel 2>&1 | tee $OUT/parallel_131k.log | tail -6
        cp /tmp/bench_parallel/*.log $OUT/ ;;
    # Issue 49 on 4 GPUs (nvidia-h100-x4): 131k full fine-tuning on one GPU and on four (sequence parallel, the
    # bf16 state sharded by FSDP2), then one full fine-tuning step of 1,048,576 tokens on the four, longer than a
    # call (in the background: then `poll`); its plan first from `scripts/plan.py --longest --gpus 4 train=full`.
    full_131k_x4) python3 scripts/bench_parallel.py --seq-len 131072 --gpus 1 4 --steps 3 --work-dir /tmp/full_131k_x4 \
        train=full parallel.shard=true 2>&1 | tee $OUT/full_131k_x4.log | tail -6 ;;
    full_1m_x4_bg) background full_1m_x4 "python3 scripts/bench_parallel.py --seq-len 1048576 --gpus 4 --steps 1 \
        --work-dir /tmp/full_1m_x4 train=full parallel.shard=true > /tmp/full_1m_x4.log 2>&1" ;;
    # Issue 14's recall curve (recall_curve above), longer than a call: then `poll`.
    recall_curve_bg) background recall_curve recall_curve ;;
    # Issue 41's FP8 quality gate (fp8_quality above), longer than a call: then `poll`.
    fp8_quality_bg) background fp8_quality fp8_quality ;;
    families_bg) background families families ;;
    families46_bg) background families46 families46 ;;
    *) echo "unknown step $step" ;;
  esac
done
