// comm/control/host_addr.h — defines host_addr(): the address this process binds its
// endpoints to and advertises to peers (actor control plane, Gloo, bulk transport). A
// troupe-agent started with --host-addr/--iface hands it to the processes it spawns
// (job_env::kHostAddr); without it everything stays on 127.0.0.1 (one machine).
// Also job_curve_from_env(): the job's CURVE key pair the scheduler hands to each of a
// job's processes (job_env::kJobPublicKey, and job_env::kJobSecretKeyFile: a 0600 file the
// agent writes, so the secret is never in the environment), which its processes use for
// their own control planes (server: that pair, allow-list: its public key).
#pragma once

#include <fstream>
#include <optional>
#include <string>

#include "comm/control/curve.h"
#include "comm/control/transport.h"
#include "core/env.h"
#include "core/job_env.h"

namespace troupe::control {

// $TROUPE_HOST_ADDR, else "127.0.0.1".
inline std::string host_addr() {
  return env::get_or(job_env::kHostAddr, "127.0.0.1");
}

// "tcp://<host_addr()>:*": a free port on this process's address.
inline std::string host_bind_endpoint() {
  return "tcp://" + host_addr() + ":*";
}

// The job's key pair when the scheduler gave one (the public key and a readable key file,
// whose first 40 characters are the Z85 secret key), else nullopt.
inline std::optional<CurveKeyPair> job_curve_from_env() {
  const std::optional<std::string> pub = env::get(job_env::kJobPublicKey);
  const std::optional<std::string> file = env::get(job_env::kJobSecretKeyFile);
  if (!pub || !file) return std::nullopt;
  std::ifstream in(*file);
  std::string sec;
  if (!std::getline(in, sec) || sec.size() < 40) return std::nullopt;
  return CurveKeyPair{*pub, sec.substr(0, 40)};
}

// The control-plane options of a job process's own actor system, bound at
// `bind_endpoint` ("": connect-only): with the job's key pair, CURVE accepting only the
// job's own processes (which also permits a non-loopback address); without keys, a
// non-loopback address only when the agent runs --insecure (job_env::kInsecure = "1").
inline TransportOptions job_transport(std::string node_id, std::string bind_endpoint) {
  TransportOptions t;
  t.node_id = std::move(node_id);
  t.bind_endpoint = std::move(bind_endpoint);
  if (std::optional<CurveKeyPair> kp = job_curve_from_env()) {
    t.curve.own = *kp;
    t.curve.allowed_client_keys = {kp->public_key};
    t.allow_non_loopback = true;
  } else if (env::get_or(job_env::kInsecure) == "1") {
    t.allow_non_loopback = true;
  }
  return t;
}

// The public key a job process's actor system serves with ("" without CURVE): what a peer
// passes to ActorSystem::connect.
inline std::string job_server_key() {
  std::optional<CurveKeyPair> kp = job_curve_from_env();
  return kp ? kp->public_key : std::string();
}

}  // namespace troupe::control
