# Finds every dependency with find_package; all come from Debian 12 packages
# (third_party/install-deps.sh installs the missing ones). LibTorch 2.x with CUDA is used
# instead of Debian's 1.13 CPU build when CMAKE_PREFIX_PATH points at it.
find_package(Torch REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(ZLIB REQUIRED)
find_package(Threads REQUIRED)
# Boost.DLL is header-only; with BOOST_DLL_USE_STD_FS no Boost library is linked.
find_package(Boost 1.70 REQUIRED)
# image_folder decodes PNG/JPEG with stb_image and resizes with stb_image_resize: header-only,
# from Debian's libstb-dev (compiled into libfrugal, static, in data_image_folder.cpp).
find_path(FRUGAL_STB_INCLUDE_DIR stb/stb_image.h stb/stb_image_resize.h)
if(NOT FRUGAL_STB_INCLUDE_DIR)
  message(FATAL_ERROR "stb_image.h not found: install Debian's libstb-dev (third_party/install-deps.sh)")
endif()
# Subword tokenizers (data/tokenizer.cpp): SentencePiece trains and reads .model files; ICU's
# character classes split text as GPT-2's byte-level BPE does (\p{L}, \p{N}).
find_package(PkgConfig REQUIRED)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)
find_package(ICU REQUIRED COMPONENTS uc)
if(FRUGAL_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# CUDA-only code is compiled only when this LibTorch has CUDA.
find_library(FRUGAL_C10_CUDA c10_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
if(FRUGAL_C10_CUDA)
  set(FRUGAL_WITH_CUDA ON)
else()
  set(FRUGAL_WITH_CUDA OFF)
endif()
message(STATUS "frugal: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}, CUDA: ${FRUGAL_WITH_CUDA}")

# Debian's libtorch-dev exports imported targets without the C++ ABI flag set by pip wheels;
# TORCH_CXX_FLAGS carries it (-D_GLIBCXX_USE_CXX11_ABI=...).
separate_arguments(FRUGAL_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
