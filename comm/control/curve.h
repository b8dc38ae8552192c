// comm/control/curve.h — defines CURVE key handling for the control plane: CurveKeyPair
// (Z85 text, 40 characters each), generate_curve_keypair, key-file reading and writing
// (the format `troupe keygen` writes), CurveConfig (what a Transport needs to encrypt and
// authenticate), serve_zap_request (the ZAP handler enforcing the client allow-list) and
// serve_zap_request_same_uid (the one admitting local ipc peers of one user).
#pragma once

#include <set>
#include <string>
#include <string_view>

#include "core/status.h"

namespace zmq {
class socket_t;
}
namespace spdlog {
class logger;
}

namespace troupe::control {

inline constexpr size_t kZ85KeyChars = 40;  // a 32-byte key in Z85

struct CurveKeyPair {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85; empty when only the public half is known
};

// A fresh keypair from libsodium (through zmq_curve_keypair).
Result<CurveKeyPair> generate_curve_keypair();

// Ok when `key` is 40 valid Z85 characters; otherwise InvalidArgument naming `what`.
Status validate_z85_key(std::string_view key, std::string_view what);

// The public key belonging to a Z85 secret key.
Result<std::string> curve_public_key_of(std::string_view secret_key);

// Key files are two lines, `public = "<z85>"` and (secret files only) `secret = "<z85>"`.
// write_curve_key_files writes `<prefix>.key` (both, mode 0600) and `<prefix>.pub`.
Status write_curve_key_files(const std::string& prefix, const CurveKeyPair& kp);
// Reads either file kind; the secret is checked against the public key when present.
Result<CurveKeyPair> read_curve_key_file(const std::string& path);

// CURVE settings of one Transport. With `enabled()` false the transport runs unencrypted
// (NULL mechanism), which is acceptable only on loopback.
struct CurveConfig {
  CurveKeyPair own;                         // this node's keypair (both halves)
  std::set<std::string> allowed_client_keys;  // Z85 public keys our ROUTER accepts
  bool enabled() const { return !own.secret_key.empty(); }
  Status validate() const;  // keys well formed, own public matches own secret
};

// Handles one ZAP request waiting on `rep` (a REP socket bound to inproc://zeromq.zap.01):
// replies 200 when the mechanism is CURVE and the client key is in `allowed`, 400
// otherwise (and logs the refused key). Never throws on a malformed request. Returns false
// when no request was waiting (the caller drains with it: every CURVE handshake waits for
// its answer, so one answer per wake would hold thousands of connecting peers back).
bool serve_zap_request(zmq::socket_t& rep, const std::set<std::string>& allowed, spdlog::logger& log);

// The same for an ipc:// ROUTER without CURVE: replies 200 only to a NULL-mechanism peer
// whose uid is `uid`. ZeroMQ (4.3, built with SO_PEERCRED) gives ZAP the address of an ipc
// peer as "<address>:<uid>:<gid>:<pid>", taken from the kernel's SO_PEERCRED of the
// connection; a request without it (no credentials: e.g. a tcp peer) is refused.
bool serve_zap_request_same_uid(zmq::socket_t& rep, unsigned uid, spdlog::logger& log);

// The uid in a ZAP address of an ipc peer ("localhost:1000:1000:4242" -> 1000); -1 when
// the address carries no peer credentials.
long zap_address_uid(std::string_view address);

}  // namespace troupe::control
