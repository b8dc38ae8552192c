# Every third-party dependency, all from Debian packages (scripts/install-deps.sh). Also
# installed with Troupe's CMake package (TroupeConfig.cmake includes it): an app built
# against an installed Troupe finds the same libraries.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog 1.10 REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(CLI11 QUIET)
find_package(nlohmann_json 3 REQUIRED)
find_package(SQLite3 REQUIRED)
find_package(cppzmq 4.9 REQUIRED)
find_package(CapnProto 0.9 REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(SODIUM REQUIRED IMPORTED_TARGET libsodium)
# Hugging Face interop: tokenizers' pre-tokenizer regexes (\p{L}, lookahead), their NFC
# normaliser, and compressed JSONL corpora.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
pkg_check_modules(ZLIB REQUIRED IMPORTED_TARGET zlib)

# prometheus-cpp's core (metric types, registry, text format) only: its CMake package
# also demands the pull/push libraries and their civetweb/curl dependencies, which Troupe
# does not use (observe/metrics_server.h says why), so the library is found directly.
if(NOT TARGET Prometheus::core)
  find_path(PROMETHEUS_CPP_INCLUDE_DIR prometheus/registry.h REQUIRED)
  find_library(PROMETHEUS_CPP_CORE_LIBRARY prometheus-cpp-core REQUIRED)
  add_library(Prometheus::core UNKNOWN IMPORTED)
  set_target_properties(Prometheus::core PROPERTIES IMPORTED_LOCATION ${PROMETHEUS_CPP_CORE_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${PROMETHEUS_CPP_INCLUDE_DIR})
endif()

# Gloo ships no CMake package on Debian: headers in /usr/include/gloo, libgloo.so.
if(NOT TARGET Gloo::gloo)
  find_path(GLOO_INCLUDE_DIR gloo/context.h REQUIRED)
  find_library(GLOO_LIBRARY gloo REQUIRED)
  add_library(Gloo::gloo UNKNOWN IMPORTED)
  set_target_properties(Gloo::gloo PROPERTIES IMPORTED_LOCATION ${GLOO_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${GLOO_INCLUDE_DIR})
endif()

# CLI11 on Debian is header-only and may lack a CMake package.
if(NOT TARGET CLI11::CLI11)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${CLI11_INCLUDE_DIR})
endif()

find_program(TROUPE_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
