// tests/actors/fuzz_decoder.cc — libFuzzer target over the control-plane decoder: any
// byte string must decode to an Envelope or to a Status, never crash, hang or throw, and
// whatever decodes must re-encode and decode to the same Envelope.
//
// Built only with clang and -DTROUPE_BUILD_FUZZERS=ON:
//   CXX=clang++ CC=clang cmake -S . -B build-fuzz -G Ninja -DTROUPE_BUILD_FUZZERS=ON -DTROUPE_WITH_CUDA=OFF
//   ninja -C build-fuzz control_fuzz_decoder
//   mkdir corpus && TROUPE_FUZZ_SEED_DIR=corpus build/tests/comm/control/control_codec_test
//   build-fuzz/tests/actors/control_fuzz_decoder -max_total_time=60 corpus
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/control/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  troupe::control::DecodeLimits limits;
  limits.max_message_bytes = 1 << 16;
  // Also exercise the misaligned path: decode from an odd offset of a copy.
  std::vector<uint8_t> shifted(size + 1);
  if (size > 0) std::memcpy(shifted.data() + 1, data, size);
  auto a = troupe::control::decode_envelope(data, size, limits);
  auto b = troupe::control::decode_envelope(shifted.data() + 1, size, limits);
  if (a.ok() != b.ok()) std::abort();
  if (a.ok()) {
    auto bytes = troupe::control::encode_envelope(*a);
    if (!bytes.ok()) std::abort();
    auto again = troupe::control::decode_envelope(bytes->data(), bytes->size());
    if (!again.ok() || !(*again == *a)) std::abort();
  }
  return 0;
}
