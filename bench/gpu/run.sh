#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call (from the repository root):
# builds the CUDA tests and benchmarks for the machine's GPU, runs the GPU test suite
# (ctest -L gpu: the update kernels bit for bit against the CPU executor, the NCCL
# communicator), the update kernels again under compute-sanitizer, then the benchmark
# and PyTorch's optimizers beside it in the same run. Results go to $OUT (default
# bench/results/gpu): the logs and JSON lines to copy into bench/RESULTS.md.
# Needs the CUDA toolkit, cmake, g++, Boost.Test and nlohmann-json (the test suite's
# configure step); PyTorch with CUDA for the side by side (skipped without it).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
params=${PARAMS:-321000000}
arch=${CUDA_ARCH:-90}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"

cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDISTOPT_ENABLE_CUDA=ON -DDISTOPT_ENABLE_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DDISTOPT_BUILD_EXAMPLES=OFF | tail -3
cmake --build build-gpu -j"$(nproc)" --target test_cuda_update test_nccl_comm test_nccl_multi_rank distopt-bench-gpu-update

status=0
ctest --test-dir build-gpu -L gpu --output-on-failure 2>&1 | tee "$out/ctest-gpu.txt" || status=1
compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/tests/cuda/test_cuda_update 2>&1 |
  tee "$out/memcheck.txt" || status=1

rm -f "$out/distopt.jsonl" "$out/torch.jsonl"
build-gpu/bench/gpu/distopt-bench-gpu-update --params "$params" --json "$out/distopt.jsonl" | tee "$out/distopt.txt"
if python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null; then
  python3 bench/gpu/torch_gpu.py --params "$params" --json "$out/torch.jsonl" --distopt "$out/distopt.jsonl" |
    tee "$out/torch.txt"
else
  echo "run.sh: no PyTorch with CUDA here: the side by side is skipped" | tee "$out/torch.txt"
fi
exit $status
