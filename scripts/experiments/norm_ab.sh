#!/usr/bin/env bash
# The row-norm tiles against the tree before them (.old_tree, carried): the norm GPU tests, QK-norm's kernels
# timed apart, and the 32k LoRA step of Qwen3-8B and Llama-3 8B on each tree, in one lease; logs in $OUT.
set -uo pipefail
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl && touch /tmp/site/.installed; }
export PYTHONUNBUFFERED=1 LONGCTX_TUNING_CACHE=/tmp/longctx-tuning
new=$PWD old=$PWD/.old_tree
PYTHONPATH=/tmp/site:$new TRITON_INTERPRET=0 python3 -m pytest -q tests/test_kernels_gpu.py -k norm 2>&1 | tail -3
for tree in new old; do dir=${!tree}
  echo "== qk-norm $tree"; (cd $dir && PYTHONPATH=/tmp/site:$dir python3 $new/scripts/experiments/qknorm_bench.py 2>&1 | tail -1)
done
for model in qwen3_8b llama3_8b; do for tree in new old; do dir=${!tree}
  (cd $dir && PYTHONPATH=/tmp/site:$dir python3 scripts/bench_train.py --seq-len 32768 --steps 3 model=$model \
     2>>$OUT/norm_ab.err | tee -a $OUT/norm_ab.jsonl |
   python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('$model $tree', [round(s, 3) for s in r['step_s']], round(r['tokens_per_s']))")
done; done
