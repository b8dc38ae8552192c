// scheduler/daemons/secrets.cc — private directories and files, sealed environment values
// (secrets.h).
#include "scheduler/daemons/secrets.h"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/logging.h"

namespace troupe::sched {

namespace {

constexpr std::string_view kSealedPrefix = "troupe-sealed:v1:";

std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("sched");
  return l;
}

}  // namespace

Status make_private_dir(const std::string& dir, const char* what) {
  std::error_code ec;
  const bool created = std::filesystem::create_directories(dir, ec);
  if (ec) return io_error("cannot create {} {}: {}", what, dir, ec.message());
  if (created && ::chmod(dir.c_str(), 0700) != 0)
    return io_error("cannot make {} {} private (chmod 0700): {}", what, dir, std::strerror(errno));
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    return io_error("cannot stat {} {}: {}", what, dir, std::strerror(errno));
  if (st.st_uid != ::geteuid()) {
    return failed_precondition("{} {} belongs to uid {}, not to this user (uid {})", what, dir, st.st_uid,
                               ::geteuid());
  }
  if ((st.st_mode & S_ISVTX) != 0) {
    // A shared directory such as /tmp: tightening it would lock every other user out.
    return failed_precondition("{} {} is a shared directory (mode {:o}, sticky): name a directory of its own",
                               what, dir, st.st_mode & 07777);
  }
  if ((st.st_mode & 077) != 0) {
    if (::chmod(dir.c_str(), 0700) != 0) {
      return io_error("cannot make {} {} private (chmod 0700): {}", what, dir, std::strerror(errno));
    }
    log()->info("{} {} was mode {:o}: made 0700 (owner only)", what, dir, st.st_mode & 0777);
  }
  return ok_status();
}

Status write_private_file(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return io_error("cannot write {}: {}", path, std::strerror(errno));
  ::fchmod(fd, 0600);
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      return io_error("cannot write {}: {}", path, std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return io_error("cannot write {}: {}", path, std::strerror(errno));
  return ok_status();
}

Result<EnvSealer> EnvSealer::create(const std::optional<CurveKeyPair>& server_keys,
                                    const std::string& state_dir) {
  if (sodium_init() < 0) return internal_error("libsodium failed to initialise");
  EnvSealer s;
  if (server_keys && server_keys->secret_key.size() == 40) {
    uint8_t secret[32];
    if (zmq_z85_decode(secret, server_keys->secret_key.c_str()) == nullptr) {
      return invalid_argument("the scheduler's secret key is not valid Z85");
    }
    static constexpr char kContext[] = "troupe job environment at rest v1";
    crypto_generichash(s.key_.data(), s.key_.size(), reinterpret_cast<const uint8_t*>(kContext),
                       sizeof(kContext) - 1, secret, sizeof secret);
    sodium_memzero(secret, sizeof secret);
    return s;
  }
  // No key of its own (--insecure without CURVE): a random one beside the database.
  const std::string path = state_dir + "/env.key";
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() == s.key_.size()) {
    std::memcpy(s.key_.data(), bytes.data(), s.key_.size());
    return s;
  }
  if (!bytes.empty()) return data_loss("{} holds {} bytes, not a 32-byte key", path, bytes.size());
  randombytes_buf(s.key_.data(), s.key_.size());
  TROUPE_RETURN_IF_ERROR(write_private_file(
      path, std::string_view(reinterpret_cast<const char*>(s.key_.data()), s.key_.size())));
  return s;
}

bool EnvSealer::is_sealed(std::string_view v) {
  return v.substr(0, kSealedPrefix.size()) == kSealedPrefix;
}

std::string EnvSealer::seal(std::string_view value) const {
  std::vector<unsigned char> box(crypto_secretbox_NONCEBYTES + crypto_secretbox_MACBYTES + value.size());
  unsigned char* nonce = box.data();
  randombytes_buf(nonce, crypto_secretbox_NONCEBYTES);
  crypto_secretbox_easy(box.data() + crypto_secretbox_NONCEBYTES,
                        reinterpret_cast<const unsigned char*>(value.data()), value.size(), nonce,
                        key_.data());
  std::string b64(sodium_base64_ENCODED_LEN(box.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(b64.data(), b64.size(), box.data(), box.size(), sodium_base64_VARIANT_ORIGINAL);
  b64.resize(std::strlen(b64.c_str()));
  return std::string(kSealedPrefix) + b64;
}

Result<std::string> EnvSealer::unseal(std::string_view sealed) const {
  if (!is_sealed(sealed)) return invalid_argument("not a sealed value");
  const std::string_view b64 = sealed.substr(kSealedPrefix.size());
  std::vector<unsigned char> box(b64.size());
  size_t len = 0;
  if (sodium_base642bin(box.data(), box.size(), b64.data(), b64.size(), nullptr, &len, nullptr,
                        sodium_base64_VARIANT_ORIGINAL) != 0 ||
      len < crypto_secretbox_NONCEBYTES + crypto_secretbox_MACBYTES) {
    return data_loss("a sealed environment value is malformed");
  }
  std::string out(len - crypto_secretbox_NONCEBYTES - crypto_secretbox_MACBYTES, '\0');
  if (crypto_secretbox_open_easy(reinterpret_cast<unsigned char*>(out.data()),
                                 box.data() + crypto_secretbox_NONCEBYTES, len - crypto_secretbox_NONCEBYTES,
                                 box.data(), key_.data()) != 0) {
    return data_loss(
        "a sealed environment value does not open with this scheduler's key (was it sealed by a "
        "scheduler with another key?)");
  }
  return out;
}

}  // namespace troupe::sched
