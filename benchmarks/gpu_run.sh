#!/usr/bin/env bash
# The [gpu] checks in one call on a machine with one GPU (docs/results.md,
# "GPU"): correctness tests there, then `benchmarks.gpu`'s parts, each in its
# own process under its own time limit, so one failure or overrun keeps the
# others' results. Writes env+tests.log, <part>.log and <part>.json to DIR.
#
#   bash benchmarks/gpu_run.sh DIR [extra benchmarks.gpu flags, e.g. --quick]
#
# Packages the machine lacks travel as wheels in .whl/ (see the device
# README); the repo root is put on PYTHONPATH (no install).
set -u
dir=${1:?usage: gpu_run.sh DIR [flags]}; shift
mkdir -p "$dir"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=$dir/tests.log
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv 2>&1
  python3 -c "import jax, flax, optax, sys; print(sys.version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', \
optax.__version__, jax.devices())"
} >"$log" 2>&1
# Nothing else is worth the device time if the package does not import.
python3 -c "import benchmarks.gpu, rlhf_jax.engine.engine, rlhf_jax.rl.learner" \
  >>"$log" 2>&1 || { echo "import failed" >>"$log"; cat "$log"; exit 1; }
t0=$SECONDS
# Correctness on the device: kernels (compiled Triton kernel vs fp64
# oracle), HF parity (logits and greedy tokens of both engines against
# transformers), model and trainer-scale paths; 8-device tests skip.
# TESTS (paths or node ids, split on spaces) and PARTS (part:seconds;
# empty: none) override what runs.
# TESTS=none skips them (a call that spends its minutes on the parts).
if [[ ${TESTS:-} != none ]]; then
  JAX_PLATFORMS=${TEST_PLATFORM:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "${TESTS_S:-110}" python3 -m pytest -q -p no:cacheprovider \
    -n "${TEST_WORKERS:-4}" -W ignore ${TESTS:-tests/kernels/test_kernels_paged.py \
    tests/models/test_hf.py tests/models/test_model.py tests/models/test_train_scale.py \
    tests/kernels/test_kernels_prefix.py} >>"$log" 2>&1
  echo "tests rc=$? in $((SECONDS - t0)) s" >>"$log"
fi
# A part may carry its own flags after '+': train+--remat=dots:65 runs the
# train part with --remat=dots for at most 65 s, logged as train_remat-dots.
# A name that is not a part of benchmarks.gpu is a benchmark module run with
# its own flags only, its JSON the log's last line:
# grpo_step+--config=configs/synthetic_grpo.py+--steps=3:300 (a whole step).
for part in ${PARTS-decode:230 train:130 repartition:50}; do
  spec=${part%:*}; limit=${part##*:}; name=${spec%%+*}; t0=$SECONDS
  own=(); [[ $spec == *+* ]] && IFS=+ read -ra own <<<"${spec#*+}"
  label=$(printf %s "$spec" | sed 's/+--/_/g; s/=/-/g; s/[^A-Za-z0-9_.-]/_/g')
  case $name in
    decode|train|repartition) cmd=(benchmarks.gpu --parts="$name"
      --out="$dir/$label.json" "${own[@]}" "$@") ;;
    *) cmd=("benchmarks.$name" "${own[@]}") ;;
  esac
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout "$limit" python3 -m \
    "${cmd[@]}" >"$dir/$label.log" 2>&1
  echo "$label rc=$? in $((SECONDS - t0)) s" >>"$log"
done
cat "$log"
