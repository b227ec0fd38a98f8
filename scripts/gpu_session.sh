#!/usr/bin/env bash
# The GPU checks of a session in one call: installs the wheels the GPU image lacks (carried in .whl/, made
# by ../shared/device/wheels.sh [liger-kernel==0.8.5]), then runs the named steps, logs under $OUT:
#   bash scripts/gpu_session.sh kernel_tests bench_attn train_32k peer_32k train_131k peer_131k
set -uo pipefail
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LONGCTX_TUNING_CACHE=${LONGCTX_TUNING_CACHE:-$OUT/tuning}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
# The GPU tests in two halves (together they outlast one 10-minute call); -v names each result as it comes.
KERNEL_TESTS="tests/test_flash_attention.py tests/test_cudnn_attention.py tests/test_kernels_gpu.py tests/test_rope_swiglu_gpu.py"
TRAINING_TESTS="tests/test_offload.py tests/test_full_finetune.py tests/test_resume.py tests/test_dispatch.py
  tests/test_step.py tests/test_lora_fusion.py tests/test_byte_model.py"
bench() { python3 scripts/bench_train.py "$@" 2>>$OUT/bench_train.err | tee -a $OUT/bench_train.jsonl |
          python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('stack','seq_len','step_s','tokens_per_s','mfu','loss','peak_gpu_allocated_gib','overrides')}, r.get('plan'))"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    kernel_tests) TRITON_INTERPRET=0 python3 -m pytest -v --tb=short $KERNEL_TESTS 2>&1 | tee $OUT/kernel_tests.log | grep -E "FAILED|ERROR|passed|failed" ;;
    training_tests) TRITON_INTERPRET=0 python3 -m pytest -v --tb=short $TRAINING_TESTS 2>&1 | tee $OUT/training_tests.log | grep -E "FAILED|ERROR|passed|failed" ;;
    bench_attn) python3 scripts/bench_attention.py --seqlens ${SEQLENS:-8192 32768 65536 131072} --peers cudnn 2>&1 | tee $OUT/bench_attn.log | tail -24 ;;
    train_32k) bench --seq-len 32768 --steps 3 ;;
    train_64k) bench --seq-len 65536 --steps 3 ;;
    train_131k) bench --seq-len 131072 --steps 2 ;;
    full_32k) bench --seq-len 32768 --steps 3 --train full ;;
    peer_32k) bench --seq-len 32768 --steps 3 --peer ;;
    peer_64k) bench --seq-len 65536 --steps 3 --peer ;;
    peer_131k) bench --seq-len 131072 --steps 2 --peer ;;
    # Several GPUs (nvidia-h200-x2): SIGTERM to one rank, resume on 2 and on 1 (deterministic kernels, so
    # the resume on 2 is exact); then 131k LoRA on one GPU and sequence parallel on two, in one run.
    parallel_tests) LONGCTX_TORCHRUN_JOB="device=cuda deterministic=true model=llama3_8b model.num_hidden_layers=2 train=lora seq_len=16384" \
        LONGCTX_TORCHRUN_RTOL=2e-2 python3 -m pytest -v --tb=short tests/test_torchrun.py -k sigterm 2>&1 | tee $OUT/parallel_tests.log | grep -E "FAILED|ERROR|passed|failed" ;;
    parallel_131k) python3 scripts/bench_parallel.py --seq-len 131072 --gpus 1 2 --steps 3 --work-dir /tmp/bench_parallel 2>&1 | tee $OUT/parallel_131k.log | tail -6
        cp /tmp/bench_parallel/*.log $OUT/ ;;
    *) echo "unknown step $step" ;;
  esac
done
