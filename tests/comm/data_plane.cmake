# Data-plane tests (comm_*): rendezvous store, process groups, Gloo communicator, compression;
# NCCL tests carry the gpu label.
troupe_add_test(comm_gloo_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_gloo_test.cc LIBS troupe_comm TIMEOUT 120)
troupe_add_test(comm_rendezvous_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_rendezvous_test.cc LIBS troupe_comm TIMEOUT 60)
troupe_add_test(comm_process_groups_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_process_groups_test.cc LIBS troupe_comm TIMEOUT 60)
troupe_add_test(comm_compression_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_compression_test.cc LIBS troupe_comm troupe_kernels TIMEOUT 120)
if(TARGET troupe_comm_nccl)
  troupe_add_test(comm_nccl_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_nccl_test.cc LIBS troupe_comm_nccl GPU NO_MAIN TIMEOUT 400)
endif()
