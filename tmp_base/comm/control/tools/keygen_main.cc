// comm/control/tools/keygen_main.cc — troupe-keygen: generates a CURVE keypair (Z85) for
// the control plane.
//
//   troupe-keygen                 prints `public = "..."` and `secret = "..."` to stdout
//   troupe-keygen --out node1     writes node1.key (both halves, mode 0600) and node1.pub
//   troupe-keygen --check FILE    validates a key file and prints its public key
#include <cstdio>
#include <cstring>
#include <string>

#include "comm/control/curve.h"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: troupe-keygen [--out PREFIX | --check FILE]\n"
               "  (no option)    print a new keypair\n"
               "  --out PREFIX   write PREFIX.key (secret, mode 0600) and PREFIX.pub\n"
               "  --check FILE   validate a key file and print its public key\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace troupe::control;
  if (argc == 3 && std::strcmp(argv[1], "--check") == 0) {
    auto kp = read_curve_key_file(argv[2]);
    if (!kp.ok()) {
      std::fprintf(stderr, "troupe-keygen: %s\n", kp.status().to_string().c_str());
      return 1;
    }
    std::printf("public = \"%s\"\n", kp->public_key.c_str());
    return 0;
  }
  if (argc != 1 && !(argc == 3 && std::strcmp(argv[1], "--out") == 0)) return usage();
  auto kp = generate_curve_keypair();
  if (!kp.ok()) {
    std::fprintf(stderr, "troupe-keygen: %s\n", kp.status().to_string().c_str());
    return 1;
  }
  if (argc == 1) {
    std::printf("public = \"%s\"\nsecret = \"%s\"\n", kp->public_key.c_str(), kp->secret_key.c_str());
    return 0;
  }
  troupe::Status st = write_curve_key_files(argv[2], *kp);
  if (!st.ok()) {
    std::fprintf(stderr, "troupe-keygen: %s\n", st.to_string().c_str());
    return 1;
  }
  std::printf("wrote %s.key and %s.pub\npublic = \"%s\"\n", argv[2], argv[2], kp->public_key.c_str());
  return 0;
}
