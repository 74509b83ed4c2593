#!/usr/bin/env bash
# Installs, from Debian 12's packages, whatever frugal needs that this machine lacks.
# Idempotent: when everything is present it only checks (a few seconds) and installs nothing.
# Usage: bash third_party/install-deps.sh [--no-data] [--bench]
#   --no-data  leaves out the examples' data (Fashion-MNIST, fortunes)
#   --bench    adds what examples/pytorch/side_by_side.py needs: PyTorch (python3-torch) and the
#              allocators its PyTorch side is also run with (libjemalloc2, libtcmalloc-minimal4)
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev            # LibTorch 1.13.1, CPU (any LibTorch 2.x also builds: CMAKE_PREFIX_PATH)
  libopenblas0-pthread    # without it Debian's torch falls back to reference BLAS (several times slower)
  libgloo-dev             # Gloo headers: c10d's ProcessGroupGloo (data-parallel training)
  libboost-dev            # Boost.DLL, header-only (BOOST_DLL_USE_STD_FS)
  libtomlplusplus-dev libspdlog-dev libcli11-dev nlohmann-json3-dev zlib1g-dev libgtest-dev
  libsentencepiece-dev libicu-dev  # subword tokenizers: SentencePiece, GPT-2's BPE (ICU's classes)
  python3-regex           # the tokenizer test's GPT-2 reference (Python's \p{L})
  libstb-dev              # stb_image and stb_image_resize, header-only: image_folder's PNG/JPEG
  gnuplot-nox             # plots in reports; optional at run time
  clang-14 libclang-rt-14-dev  # the asan preset: sanitizers with libFuzzer's coverage (fuzz/)
)
# Real data for the examples: Fashion-MNIST, and (text, for the gpt examples) about 2.6 MB of
# English in /usr/share/games/fortunes. The tests make their own data.
no_data=0 bench=0
for a in "$@"; do
  case "$a" in
    --no-data) no_data=1 ;;
    --bench) bench=1 ;;
  esac
done
[ "$no_data" = 1 ] || pkgs+=(dataset-fashion-mnist fortunes)
[ "$bench" = 0 ] || pkgs+=(python3-torch libjemalloc2 libtcmalloc-minimal4)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
