// comm/control/curve.cc — CURVE keys, key files and the ZAP handler.
#include "comm/control/curve.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

namespace troupe::control {

Result<CurveKeyPair> generate_curve_keypair() {
  std::array<char, kZ85KeyChars + 1> pub{}, sec{};
  if (zmq_curve_keypair(pub.data(), sec.data()) != 0) {
    return unavailable("zmq_curve_keypair failed: {} (libzmq built without CURVE?)",
                       zmq_strerror(zmq_errno()));
  }
  return CurveKeyPair{std::string(pub.data()), std::string(sec.data())};
}

Status validate_z85_key(std::string_view key, std::string_view what) {
  if (key.size() != kZ85KeyChars) {
    return invalid_argument("{}: a CURVE key is {} Z85 characters, got {}", what, kZ85KeyChars,
                            key.size());
  }
  std::string z(key);
  std::array<uint8_t, 32> raw{};
  if (zmq_z85_decode(raw.data(), z.c_str()) == nullptr) {
    return invalid_argument("{}: not valid Z85 text", what);
  }
  return ok_status();
}

Result<std::string> curve_public_key_of(std::string_view secret_key) {
  TROUPE_RETURN_IF_ERROR(validate_z85_key(secret_key, "secret key"));
  std::string sec(secret_key);
  std::array<char, kZ85KeyChars + 1> pub{};
  if (zmq_curve_public(pub.data(), sec.c_str()) != 0) {
    return invalid_argument("cannot derive a public key: {}", zmq_strerror(zmq_errno()));
  }
  return std::string(pub.data());
}

Status CurveConfig::validate() const {
  if (!enabled()) return ok_status();
  TROUPE_RETURN_IF_ERROR(validate_z85_key(own.public_key, "own public key"));
  TROUPE_ASSIGN_OR_RETURN(std::string derived, curve_public_key_of(own.secret_key));
  if (derived != own.public_key) {
    return invalid_argument("own public key does not belong to own secret key");
  }
  for (const std::string& k : allowed_client_keys) {
    TROUPE_RETURN_IF_ERROR(validate_z85_key(k, "allowed client key"));
  }
  return ok_status();
}

Status write_curve_key_files(const std::string& prefix, const CurveKeyPair& kp) {
  TROUPE_RETURN_IF_ERROR(validate_z85_key(kp.public_key, "public key"));
  TROUPE_RETURN_IF_ERROR(validate_z85_key(kp.secret_key, "secret key"));
  const std::string secret_path = prefix + ".key";
  {
    // Create with 0600 before writing the secret so it is never world-readable.
    std::ofstream(secret_path, std::ios::trunc).close();
    if (::chmod(secret_path.c_str(), 0600) != 0) {
      return io_error("cannot create {} with mode 0600: {}", secret_path, std::strerror(errno));
    }
    std::ofstream f(secret_path, std::ios::trunc);
    f << "public = \"" << kp.public_key << "\"\nsecret = \"" << kp.secret_key << "\"\n";
    if (!f) return io_error("cannot write {}", secret_path);
  }
  std::ofstream f(prefix + ".pub", std::ios::trunc);
  f << "public = \"" << kp.public_key << "\"\n";
  if (!f) return io_error("cannot write {}.pub", prefix);
  return ok_status();
}

Result<CurveKeyPair> read_curve_key_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("cannot open key file {}", path);
  CurveKeyPair kp;
  std::string line;
  int line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    std::string key, eq, value;
    std::istringstream ss(line);
    ss >> key >> eq >> value;
    if (eq != "=" || value.size() < 2 || value.front() != '"' || value.back() != '"') {
      return invalid_argument("{}:{}: expected `public = \"<z85>\"` or `secret = \"<z85>\"`",
                              path, line_no);
    }
    value = value.substr(1, value.size() - 2);
    if (key == "public") {
      kp.public_key = value;
    } else if (key == "secret") {
      kp.secret_key = value;
    } else {
      return invalid_argument("{}:{}: unknown key `{}`", path, line_no, key);
    }
  }
  TROUPE_RETURN_IF_ERROR(validate_z85_key(kp.public_key, path + ": public"));
  if (!kp.secret_key.empty()) {
    TROUPE_ASSIGN_OR_RETURN(std::string derived, curve_public_key_of(kp.secret_key));
    if (derived != kp.public_key) {
      return invalid_argument("{}: public key does not belong to the secret key", path);
    }
  }
  return kp;
}

long zap_address_uid(std::string_view address) {
  // "<address>:<uid>:<gid>:<pid>": the uid is the third field from the end.
  size_t end = address.size();
  std::string_view fields[3];
  for (int i = 2; i >= 0; --i) {
    if (end == 0) return -1;
    const size_t colon = address.rfind(':', end - 1);
    if (colon == std::string_view::npos) return -1;
    fields[i] = address.substr(colon + 1, end - colon - 1);
    end = colon;
  }
  long uid = 0;
  for (const auto& f : fields) {
    if (f.empty() || f.size() > 10 || f.find_first_not_of("0123456789") != std::string_view::npos) return -1;
  }
  for (char c : fields[0]) uid = uid * 10 + (c - '0');
  return uid;
}

namespace {

void send_zap_reply(zmq::socket_t& rep, const std::string& request_id, const std::string& status,
                    const std::string& text, spdlog::logger& log) {
  std::array<zmq::const_buffer, 6> reply = {zmq::str_buffer("1.0"), zmq::buffer(request_id),
                                            zmq::buffer(status),    zmq::buffer(text),
                                            zmq::str_buffer(""),    zmq::str_buffer("")};
  try {
    zmq::send_multipart(rep, reply, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    log.warn("zap: reply failed: {}", e.what());
  }
}

// One waiting ZAP request into req; false when none is waiting (or the receive failed).
bool receive_zap_request(zmq::socket_t& rep, std::vector<zmq::message_t>& req, spdlog::logger& log) {
  try {
    return zmq::recv_multipart(rep, std::back_inserter(req), zmq::recv_flags::dontwait).has_value();
  } catch (const zmq::error_t& e) {
    log.warn("zap: receive failed: {}", e.what());
    return false;
  }
}

}  // namespace

bool serve_zap_request_same_uid(zmq::socket_t& rep, unsigned uid, spdlog::logger& log) {
  std::vector<zmq::message_t> req;
  if (!receive_zap_request(rep, req, log)) return false;
  std::string status = "400", text = "malformed ZAP request";
  if (req.size() >= 6 && req[0].to_string() == "1.0") {
    const std::string mechanism = req[5].to_string();
    const std::string address = req[3].to_string();
    const long peer_uid = zap_address_uid(address);
    if (mechanism != "NULL") {
      text = "only local NULL-mechanism peers are accepted";
      log.warn("zap: refused {} client from {}", mechanism, address);
    } else if (peer_uid < 0 || static_cast<unsigned long>(peer_uid) != uid) {
      text = "peer of another user";
      log.warn("zap: refused a local peer ({}): not of uid {}", address, uid);
    } else {
      status = "200";
      text = "OK";
    }
  } else {
    log.warn("zap: malformed request with {} frames", req.size());
  }
  send_zap_reply(rep, req.size() >= 2 ? req[1].to_string() : "", status, text, log);
  return true;
}

bool serve_zap_request(zmq::socket_t& rep, const std::set<std::string>& allowed, spdlog::logger& log) {
  std::vector<zmq::message_t> req;
  if (!receive_zap_request(rep, req, log)) return false;
  // ZAP 1.0 request: version, request id, domain, address, identity, mechanism, credentials.
  std::string status = "400", text = "malformed ZAP request";
  if (req.size() >= 6 && req[0].to_string() == "1.0") {
    const std::string mechanism = req[5].to_string();
    const std::string address = req[3].to_string();
    if (mechanism != "CURVE" || req.size() != 7 || req[6].size() != 32) {
      text = "only CURVE clients are accepted";
      log.warn("zap: refused {} client from {}", mechanism, address);
    } else {
      std::array<char, kZ85KeyChars + 1> z85{};
      zmq_z85_encode(z85.data(), static_cast<const uint8_t*>(req[6].data()), 32);
      if (allowed.count(z85.data()) != 0) {
        status = "200";
        text = "OK";
      } else {
        text = "client key not allowed";
        log.warn("zap: refused CURVE client key {} from {}", z85.data(), address);
      }
    }
  } else {
    log.warn("zap: malformed request with {} frames", req.size());
  }
  send_zap_reply(rep, req.size() >= 2 ? req[1].to_string() : "", status, text, log);
  return true;
}

}  // namespace troupe::control
