#!/usr/bin/env bash
# The run half of the GPU run, on the lent GPU machine, in one call: needs nothing but the
# folder bench/gpu/build.sh made (it builds nothing). Runs the GPU tests (the update
# kernels and optimizer<..., cuda> bit for bit against the CPU executor, the NCCL
# communicator), the kernel test under compute-sanitizer (memcheck, racecheck), then the
# benchmarks (the update kernels alone, and the optimizer's whole step) with PyTorch's
# optimizers beside them in the same run. Logs and JSON lines go to
# $OUT (default ./gpu-results), to copy into bench/RESULTS.md.
#   device run, carry ["build-gpu/bundle"]:  bash build-gpu/bundle/run.sh
# Run from the repository instead, it uses build-gpu/bundle (or $BUNDLE).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=$here
[ -x "$bundle/test_cuda_update" ] || bundle=$(cd "${BUNDLE:-$here/../../build-gpu/bundle}" && pwd) ||
  { echo "run.sh: no bundle: run bench/gpu/build.sh first" >&2; exit 2; }
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
params=${PARAMS:-321000000}
cat "$bundle/MANIFEST" 2> /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"

# NCCL comes with PyTorch there (the nvidia-nccl wheel); the programs load it from its folder.
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2> /dev/null)
[ -n "$nccl" ] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

status=0
# One test: exit 0 passes, 77 is a skip (too few devices), anything else fails.
run_test() {
  local name=$1
  shift
  echo "== $name" | tee -a "$out/tests.txt"
  "$@" 2>&1 | tee -a "$out/tests.txt"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) echo "== $name passed" | tee -a "$out/tests.txt" ;;
    77) echo "== $name skipped" | tee -a "$out/tests.txt" ;;
    *) echo "== $name FAILED (exit $rc)" | tee -a "$out/tests.txt"; status=1 ;;
  esac
}
: > "$out/tests.txt"
run_test cuda.update "$bundle/test_cuda_update"
run_test cuda.optimizer "$bundle/test_cuda_optimizer"
run_test nccl.one_rank_plumbing "$bundle/test_nccl_comm"
run_test nccl.multi_rank "$bundle/test_nccl_multi_rank"
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    run_test "compute-sanitizer $tool" compute-sanitizer --tool "$tool" --error-exitcode 1 "$bundle/test_cuda_update"
  done
  run_test "compute-sanitizer memcheck (optimizer)" compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$bundle/test_cuda_optimizer"
else
  echo "run.sh: no compute-sanitizer here" | tee -a "$out/tests.txt"
fi
passed=$(grep -c '^== .* passed$' "$out/tests.txt")
failed=$(grep -c '^== .* FAILED (exit [0-9]*)$' "$out/tests.txt")
skipped=$(grep -c '^== .* skipped$' "$out/tests.txt")

rm -f "$out/distopt.jsonl" "$out/torch.jsonl"
"$bundle/distopt-bench-gpu-update" --params "$params" --json "$out/distopt.jsonl" 2>&1 | tee "$out/distopt.txt" ||
  status=1
# The optimizer's step (the path users run), default options and the check off.
"$bundle/distopt-bench-gpu-step" --params "$params" --json "$out/distopt.jsonl" 2>&1 | tee -a "$out/distopt.txt" ||
  status=1
if python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null; then
  python3 "$bundle/torch_gpu.py" --params "$params" --json "$out/torch.jsonl" --distopt "$out/distopt.jsonl" 2>&1 |
    tee "$out/torch.txt" || status=1
else
  echo "run.sh: no PyTorch with CUDA here: the side by side is skipped" | tee "$out/torch.txt"
fi
echo "gpu: $passed passed, $failed failed, $skipped skipped"
exit $status
