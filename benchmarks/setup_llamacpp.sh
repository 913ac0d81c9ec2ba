#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-batched-bench` (CPU only) for
# benchmarks/vs_llamacpp.py, from the llama.cpp source that the llama-cpp-python 0.3.36 sdist on
# the package index vendors, into a folder outside this repository (nothing of llama.cpp is
# committed here).
#
#   bash benchmarks/setup_llamacpp.sh [--dir DIR]     # default: $LLAMACPP_DIR or ~/llamacpp
#
# Needs: python3 with pip (to download the sdist), cmake >= 3.14, a C and C++ compiler. Takes
# about 10-15 minutes on 2 cores (one compile job, so a shared machine stays usable). Running
# it again reuses what is there. The binaries land in DIR/build/bin, where vs_llamacpp.py
# looks by default.
set -euo pipefail

VERSION=0.3.36
DIR="${LLAMACPP_DIR:-$HOME/llamacpp}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
case "$DIR/" in
    "$REPO"/*) echo "refusing to build inside the repository ($DIR); pick a folder outside" >&2
               exit 2 ;;
esac
for tool in cmake cc c++; do
    command -v "$tool" >/dev/null || { echo "setup_llamacpp.sh needs $tool" >&2; exit 2; }
done
PYTHON="${PYTHON:-python3}"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$DIR/build"

if [ ! -f "$SDIST" ]; then
    echo "downloading the llama-cpp-python $VERSION sdist into $DIR"
    "$PYTHON" -m pip download --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$DIR"
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST" -C "$DIR"
fi

# CPU build tuned for this machine (GGML_NATIVE: AVX-512 / VNNI where present), no OpenMP:
# the benchmark pins llama.cpp to the same thread count as slotserve.
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=OFF > "$DIR/cmake.log"
fi
echo "building llama-server and llama-batched-bench (log: $DIR/build.log)"
cmake --build "$BUILD" -j1 --target llama-server llama-batched-bench > "$DIR/build.log"

"$BUILD/bin/llama-server" --version 2>&1 | tail -n 2
echo "llama-server: $BUILD/bin/llama-server"
echo "llama-batched-bench: $BUILD/bin/llama-batched-bench"
