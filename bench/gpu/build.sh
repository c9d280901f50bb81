#!/usr/bin/env bash
# The build half of the GPU run, on the development machine (no GPU needed): the lent GPU
# machine has no Boost and no nlohmann-json, installs nothing, and its minutes are for
# running. This builds every GPU program for sm_90 (H100, H200) with the C++ and CUDA
# runtimes linked statically, checks (readelf, ldd) that each needs nothing but the C
# library, the CUDA driver and NCCL (there: PyTorch's nvidia-nccl package), puts the programs,
# the run half (bench/gpu/run.sh) and the PyTorch script into one folder to carry:
#   bench/gpu/build.sh                      # here: builds build-gpu/bundle
#   device run, carry ["build-gpu/bundle"]:  bash build-gpu/bundle/run.sh
# CUDA_ARCH (default 90) and BUILD_DIR (default build-gpu) override the defaults.
# COMPILE_ONLY=1 (CI's CUDA stage) leaves out the host halves that run.sh compares the GPU
# with and that CI's release stage compiles already: distopt-replay's single mode and the
# trainers' CPU optimizers. Such a folder is for the checks here, not for carrying.
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${CUDA_ARCH:-90}
build=${BUILD_DIR:-build-gpu}
bundle=$build/bundle
programs=(tests/cuda/test_cuda_update tests/cuda/test_cuda_optimizer tests/cuda/test_cuda_layerwise
          tests/cuda/test_cuda_galore tests/cuda/test_cuda_nccl tests/nccl/test_nccl_comm tests/nccl/test_nccl_multi_rank bench/gpu/distopt-bench-gpu-update bench/gpu/distopt-bench-gpu-step
          bench/gpu/distopt-bench-gpu-layerwise examples/replay/distopt-replay
          examples/fashion_mnist/distopt-fashion-mnist examples/gpt/distopt-gpt)

# distopt-replay without LAPACK (the GPU machine has no OpenBLAS): it then refuses
# galore_adamw and muon, which run on host memory only anyway. It is built with the two modes
# that run.sh compares, single (--backend cpu) and cuda: the threads and emulated modes ran
# in the release stage's ctest, and cost about half of each policy's host compile.
# distopt-fashion-mnist with the CPU optimizer run.sh trains beside the GPU (adamw; about 90 s
# of compile each: --backend cuda takes adamw and adafactor from train_cuda.cu either way).
# It, distopt-gpt (the CPU trainers beside --backend cuda) and test_cuda_galore (GaLore's CPU
# reference) link OpenBLAS statically.
replay_modes="single;cuda" fmnist_optimizers=adamw gpt_cpu_trainers=ON
build_type=(-DCMAKE_BUILD_TYPE=Release)
# COMPILE_ONLY also compiles without optimisation, host and device (ptxas and cicc at -O0):
# the programs are not run, and the same sources compile or fail alike at any level. The host
# loops skip their -O3 options too (DISTOPT_NO_HOT_LOOP_OPTIONS, config.hpp). run_adamw_cuda.cu:
# 84 s of CPU against 127 s with the release flags (2026-12-02, the 2-core VM).
if [ "${COMPILE_ONLY:-0}" = 1 ]; then
  replay_modes=cuda fmnist_optimizers= gpt_cpu_trainers=OFF
  unoptimized="-O0 -DNDEBUG -DDISTOPT_NO_HOT_LOOP_OPTIONS"
  build_type=(-DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=$unoptimized"
              "-DCMAKE_CUDA_FLAGS_DEBUG=$unoptimized -Xptxas=-O0 -Xcicc=-O0")
fi
cmake -S . -B "$build" "${build_type[@]}" -DDISTOPT_ENABLE_CUDA=ON -DDISTOPT_ENABLE_NCCL=ON \
  -DDISTOPT_BUILD_EXAMPLES=ON -DCMAKE_DISABLE_FIND_PACKAGE_LAPACK=ON -DDISTOPT_STATIC_RUNTIMES=ON \
  "-DDISTOPT_REPLAY_MODES=$replay_modes" "-DDISTOPT_FASHION_MNIST_OPTIMIZERS=$fmnist_optimizers" \
  "-DDISTOPT_GPT_CPU_TRAINERS=$gpt_cpu_trainers" \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" > /dev/null
cmake --build "$build" -j2 --target "${programs[@]##*/}"

rm -rf "$bundle"
mkdir -p "$bundle"
for p in "${programs[@]}"; do cp "$build/$p" "$bundle/"; done
cp bench/gpu/run.sh bench/gpu/torch_gpu.py bench/peers/torch_step.py "$bundle/"
# The replay cases that ctest runs as replay_backend.cuda.* (tests/CMakeLists.txt), with their traces.
mkdir -p "$bundle/traces"
sed -n '/^set(replay_ranks_cases/,/)$/p' tests/CMakeLists.txt | grep -o '"[^"]*"' | tr -d '"' > "$bundle/replay_cases.txt"
while read -r case _; do cp "tests/reference/traces/$case.trace.safetensors" "$bundle/traces/"; done < "$bundle/replay_cases.txt"

# What each program may load itself there (its NEEDED entries): the C library's parts, the
# driver, NCCL, cuBLAS and cuSOLVER (PyTorch's nvidia wheels there; their own needs come
# with them).
allowed='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libcuda|libnccl|libcublas|libcublasLt|libcusolver)\.so'
status=0
{
  dirty=$(git diff --quiet HEAD -- include tests bench 2> /dev/null || echo " with uncommitted changes")
  echo "built $(date -u +%FT%TZ) at $(git rev-parse --short HEAD)$dirty for CUDA architectures $arch"
  [ "${COMPILE_ONLY:-0}" = 1 ] && echo "COMPILE_ONLY: without the host halves run.sh compares with (not for carrying)"
  for p in "${programs[@]}"; do
    f=$bundle/${p##*/}
    needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
    echo "$(basename "$f") needs: $(echo "$needed" | tr '\n' ' ')"
    while read -r lib; do
      if ! [[ $lib =~ $allowed ]]; then
        echo "bench/gpu/build.sh: $(basename "$f") needs $lib, which the GPU machine may not have" >&2
        status=1
      fi
    done <<< "$needed"
    ldd "$f" > /dev/null || { echo "bench/gpu/build.sh: ldd cannot resolve $(basename "$f")" >&2; status=1; }
    echo "  newest glibc symbol: $(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)"
  done
} > "$bundle/MANIFEST"
cat "$bundle/MANIFEST"
[ $status -eq 0 ] || { echo "bench/gpu/build.sh: ldd check failed" >&2; exit 1; }
# A COMPILE_ONLY folder is not for carrying: no data set, no compression.
if [ "${COMPILE_ONLY:-0}" = 1 ]; then
  echo "bundle: $bundle (COMPILE_ONLY: compiled and checked, not for carrying)"
  exit 0
fi
# distopt-fashion-mnist --backend cuda trains on a part of the data set there (the whole
# is 31 MB): the first FMNIST_TRAIN training samples (default 20,000) and the whole test set,
# as the same gzipped idx files.
mkdir -p "$bundle/fashion-mnist"
python3 - "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}" "$bundle/fashion-mnist" "${FMNIST_TRAIN:-20000}" <<'PY'
import gzip, struct, sys
src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
    data = gzip.open(f"{src}/{name}.gz").read()
    dims = data[3]
    shape = list(struct.unpack(f">{dims}I", data[4:4 + 4 * dims]))
    if name.startswith("train"):
        shape[0] = min(shape[0], keep)
    row = 1
    for d in shape[1:]:
        row *= d
    head = data[:4] + struct.pack(f">{dims}I", *shape)
    body = data[4 + 4 * dims:4 + 4 * dims + shape[0] * row]
    with gzip.open(f"{dst}/{name}.gz", "wb", compresslevel=9) as f:
        f.write(head + body)
PY
# distopt-gpt trains on Debian's fortunes there (the plain files, 2.6 MB: not the .dat indices
# nor the .u8 links), and checks --backend cuda against PyTorch's losses (tests/reference/gpt,
# as ctest's example.gpt.reference_* does on the CPU).
fortunes=${FORTUNES_DIR:-/usr/share/games/fortunes}
mkdir -p "$bundle/fortunes" "$bundle/gpt-reference"
for f in "$fortunes"/*; do
  if [ -f "$f" ] && [ ! -L "$f" ] && [[ $f != *.dat ]]; then cp "$f" "$bundle/fortunes/"; fi
done
compgen -G "$bundle/fortunes/*" > /dev/null ||
  { echo "bench/gpu/build.sh: no fortunes in $fortunes (apt-get install fortunes, or set FORTUNES_DIR)" >&2; exit 1; }
cp tests/reference/gpt/init.safetensors tests/reference/gpt/batches.safetensors tests/reference/gpt/golden.json \
  "$bundle/gpt-reference/"
# The device tool carries at most 64 MiB with the working tree: the programs without their
# host symbols (kernel names stay, in the device code), each as name.xz, which run.sh
# unpacks there (the replay tool: 29 MB, 4.4 MB compressed).
for p in "${programs[@]}"; do
  f=$bundle/${p##*/}
  strip "$f"
  xz -T2 -6 "$f"
done
echo "bundle: $bundle ($(du -sh "$bundle" | cut -f1)); on the GPU machine: bash $bundle/run.sh"
