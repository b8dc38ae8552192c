// comm/control/host_addr.h — defines host_addr(): the address this process binds its
// endpoints to and advertises to peers (actor control plane, Gloo, bulk transport). A
// troupe-agent started with --host-addr/--iface hands it to the processes it spawns as
// TROUPE_HOST_ADDR; without it everything stays on 127.0.0.1 (one machine).
// Also job_curve_from_env(): the job's CURVE key pair the scheduler hands to each of a
// job's processes (TROUPE_JOB_PUBLIC_KEY / TROUPE_JOB_SECRET_KEY), which its processes use
// for their own control planes (server: that pair, allow-list: its public key).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "comm/control/curve.h"

namespace troupe::control {

inline constexpr const char* kHostAddrEnv = "TROUPE_HOST_ADDR";
inline constexpr const char* kJobPublicKeyEnv = "TROUPE_JOB_PUBLIC_KEY";
inline constexpr const char* kJobSecretKeyEnv = "TROUPE_JOB_SECRET_KEY";

// $TROUPE_HOST_ADDR, else "127.0.0.1".
inline std::string host_addr() {
  const char* v = std::getenv(kHostAddrEnv);
  return v && *v ? std::string(v) : std::string("127.0.0.1");
}

// "tcp://<host_addr()>:*": a free port on this process's address.
inline std::string host_bind_endpoint() {
  return "tcp://" + host_addr() + ":*";
}

// The job's key pair when the scheduler gave one (both variables set), else nullopt.
inline std::optional<CurveKeyPair> job_curve_from_env() {
  const char* pub = std::getenv(kJobPublicKeyEnv);
  const char* sec = std::getenv(kJobSecretKeyEnv);
  if (!pub || !*pub || !sec || !*sec) return std::nullopt;
  return CurveKeyPair{pub, sec};
}

}  // namespace troupe::control
