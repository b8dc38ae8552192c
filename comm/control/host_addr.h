// comm/control/host_addr.h — defines host_addr(): the address this process binds its
// endpoints to and advertises to peers (actor control plane, Gloo, bulk transport). A
// troupe-agent started with --host-addr/--iface hands it to the processes it spawns as
// TROUPE_HOST_ADDR; without it everything stays on 127.0.0.1 (one machine).
// Also job_curve_from_env(): the job's CURVE key pair the scheduler hands to each of a
// job's processes (TROUPE_JOB_PUBLIC_KEY, and TROUPE_JOB_SECRET_KEY_FILE: a 0600 file the
// agent writes, so the secret is never in the environment), which its processes use for
// their own control planes (server: that pair, allow-list: its public key).
#pragma once

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "comm/control/curve.h"

namespace troupe::control {

inline constexpr const char* kHostAddrEnv = "TROUPE_HOST_ADDR";
inline constexpr const char* kJobPublicKeyEnv = "TROUPE_JOB_PUBLIC_KEY";
// The secret key as the scheduler sends it in a spawn request; the agent turns it into
// the file kJobSecretKeyFileEnv names before the process starts.
inline constexpr const char* kJobSecretKeyEnv = "TROUPE_JOB_SECRET_KEY";
inline constexpr const char* kJobSecretKeyFileEnv = "TROUPE_JOB_SECRET_KEY_FILE";

// $TROUPE_HOST_ADDR, else "127.0.0.1".
inline std::string host_addr() {
  const char* v = std::getenv(kHostAddrEnv);
  return v && *v ? std::string(v) : std::string("127.0.0.1");
}

// "tcp://<host_addr()>:*": a free port on this process's address.
inline std::string host_bind_endpoint() {
  return "tcp://" + host_addr() + ":*";
}

// The job's key pair when the scheduler gave one (the public key and a readable key file,
// whose first 40 characters are the Z85 secret key), else nullopt.
inline std::optional<CurveKeyPair> job_curve_from_env() {
  const char* pub = std::getenv(kJobPublicKeyEnv);
  const char* file = std::getenv(kJobSecretKeyFileEnv);
  if (!pub || !*pub || !file || !*file) return std::nullopt;
  std::ifstream in(file);
  std::string sec;
  if (!std::getline(in, sec) || sec.size() < 40) return std::nullopt;
  return CurveKeyPair{pub, sec.substr(0, 40)};
}

}  // namespace troupe::control
