#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-batched-bench` (CPU only) for
# benchmarks/vs_llamacpp.py, from the llama.cpp source that the llama-cpp-python 0.3.36 sdist on
# the package index vendors, into a folder outside this repository (nothing of llama.cpp is
# committed here).
#
#   bash benchmarks/setup_llamacpp.sh [--dir DIR]     # default: $LLAMACPP_DIR or ~/llamacpp
#   bash benchmarks/setup_llamacpp.sh --avx2          # AVX2-only code into DIR/build-avx2
#
# --avx2 builds what a user on an AVX2-only CPU runs (x86-64-v3: AVX2, FMA, F16C, BMI2; no
# AVX-512, no VNNI), the baseline of `vs_llamacpp.py --cpu-level v3`.
#
# Needs: python3 with pip (to download the sdist), cmake >= 3.14, a C and C++ compiler. Takes
# about 10-15 minutes on 2 cores (one compile job, so a shared machine stays usable). Running
# it again reuses what is there. The binaries land in DIR/build/bin, where vs_llamacpp.py
# looks by default.
set -euo pipefail

VERSION=0.3.36
AVX2=0
DIR="${LLAMACPP_DIR:-$HOME/llamacpp}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --avx2) AVX2=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
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
# Whether this process may use AMX: ask Linux for the tile state (arch_prctl
# ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) and run one tile instruction.
amx_usable() {
    local t; t="$(mktemp -d)"
    cat > "$t/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
    unsigned char cfg[64]; memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
    _tile_loadconfig(cfg); _tile_zero(0); _tile_release();
    return 0;
}
C
    cc -O1 -mamx-tile -o "$t/amx" "$t/amx.c" 2>/dev/null && ("$t/amx") >/dev/null 2>&1
    local rc=$?; rm -rf "$t"; return $rc
}

SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$DIR/build"
[ "$AVX2" = 1 ] && BUILD="$DIR/build-avx2"

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
# A CPU can list AMX in its flags while the kernel or hypervisor refuses its tile state (seen
# here: llama.cpp's AMX kernels die with SIGILL). Then build for the same CPU without AMX:
# GGML_NATIVE off, every other extension this CPU has switched on by name.
# --avx2: a fixed AVX2-only set, whatever this CPU has (no probe needed).
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [ "$AVX2" = 1 ]; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON)
elif grep -qw amx_int8 /proc/cpuinfo && ! amx_usable; then
    echo "this CPU lists AMX but cannot run it: building llama.cpp without AMX"
    ISA_FLAGS=(-DGGML_NATIVE=OFF)
    for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
             avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        grep -qw "${f%%:*}" /proc/cpuinfo && ISA_FLAGS+=("-DGGML_${f##*:}=ON")
    done
fi
if [ ! -f "$BUILD/CMakeCache.txt" ] || ! grep -q "GGML_NATIVE:BOOL=${ISA_FLAGS[0]##*=}" \
        "$BUILD/CMakeCache.txt"; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=OFF > "$BUILD.cmake.log"
fi
echo "building llama-server and llama-batched-bench (log: $BUILD.build.log)"
cmake --build "$BUILD" -j1 --target llama-server llama-batched-bench > "$BUILD.build.log"

"$BUILD/bin/llama-server" --version 2>&1 | tail -n 2
echo "llama-server: $BUILD/bin/llama-server"
echo "llama-batched-bench: $BUILD/bin/llama-batched-bench"
