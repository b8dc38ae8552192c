# Every third-party dependency, all from Debian packages (scripts/install-deps.sh).
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

# Gloo ships no CMake package on Debian: headers in /usr/include/gloo, libgloo.so.
find_path(GLOO_INCLUDE_DIR gloo/context.h REQUIRED)
find_library(GLOO_LIBRARY gloo REQUIRED)
add_library(Gloo::gloo UNKNOWN IMPORTED)
set_target_properties(Gloo::gloo PROPERTIES IMPORTED_LOCATION ${GLOO_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${GLOO_INCLUDE_DIR})

# CLI11 on Debian is header-only and may lack a CMake package.
if(NOT TARGET CLI11::CLI11)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${CLI11_INCLUDE_DIR})
endif()

find_program(TROUPE_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
