# cmake/TroupeInstall.cmake — what `cmake --install` puts under the prefix, so that an app
# builds against an installed Troupe instead of Troupe's source tree:
#   lib/troupe/*.a                  the libraries an app links (Troupe::app and below)
#   include/troupe/<folder>/*.h     their headers, at the paths the sources include
#   lib/cmake/Troupe/               the CMake package: find_package(Troupe) -> Troupe::app
#   bin/                            troupe, troupe-scheduler, troupe-agent, troupe-ckpt,
#                                   troupe-prepare, train_moe and the examples
# An app's CMakeLists.txt: find_package(Troupe REQUIRED) and
# target_link_libraries(my_app PRIVATE Troupe::app) (apps/examples/parallel_lm).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TROUPE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Troupe)

# Every library Troupe::app needs, with the names the package gives them (Troupe::core, ...).
set(troupe_export_libs
    troupe_warnings troupe_core troupe_kernels troupe_comm_base troupe_comm troupe_control_codec
    troupe_control troupe_actors troupe_layers troupe_data troupe_snapshot_codec troupe_checkpoint troupe_interop troupe_training_codec
    troupe_training
    troupe_observe troupe_sched_codec troupe_sched_client troupe_app)
foreach(t troupe_core_cuda troupe_comm_nccl)
  if(TARGET ${t})
    list(APPEND troupe_export_libs ${t})
  endif()
endforeach()
foreach(t ${troupe_export_libs})
  string(REPLACE "troupe_" "" short ${t})
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${short})
endforeach()
# Component Development: what building an app needs (cmake --install build --component
# Development); Runtime: the tools.
install(TARGETS ${troupe_export_libs} EXPORT TroupeTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}/troupe COMPONENT Development
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/troupe COMPONENT Development
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/troupe)
install(EXPORT TroupeTargets NAMESPACE Troupe:: DESTINATION ${TROUPE_INSTALL_CMAKEDIR} COMPONENT Development)

install(DIRECTORY core kernels comm layers data actors checkpoint interop observe scheduler training
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/troupe COMPONENT Development
        FILES_MATCHING PATTERN "*.h")

set(troupe_tools troupe troupe-scheduler troupe-agent troupe-ckpt troupe-prepare train_moe dense_lm
                 parallel_lm)
install(TARGETS ${troupe_tools} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT Runtime)
install(FILES apps/train_moe/plot.py DESTINATION ${CMAKE_INSTALL_BINDIR} RENAME train_moe_plot.py
        COMPONENT Runtime)

# The package: the same dependency lookups as this build (cmake/TroupeDependencies.cmake),
# CUDA and NCCL where this build had them, then the exported targets.
get_filename_component(TROUPE_NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
configure_package_config_file(cmake/TroupeConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/TroupeConfig.cmake
                              INSTALL_DESTINATION ${TROUPE_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/TroupeConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/TroupeConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/TroupeConfigVersion.cmake
              cmake/TroupeDependencies.cmake
        DESTINATION ${TROUPE_INSTALL_CMAKEDIR} COMPONENT Development)
