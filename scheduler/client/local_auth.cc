// scheduler/client/local_auth.cc — the user's credential: location, first-use creation, checks.
#include "scheduler/client/local_auth.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "comm/control/transport.h"
#include "core/env.h"

namespace troupe::sched {

std::string troupe_config_dir() {
  if (std::optional<std::string> d = env::get("TROUPE_CONFIG_DIR")) return *d;
  if (std::optional<std::string> x = env::get("XDG_CONFIG_HOME")) return *x + "/troupe";
  std::string home = env::get_or("HOME");
  if (home.empty()) {
    if (const passwd* pw = getpwuid(getuid()); pw && pw->pw_dir) home = pw->pw_dir;
  }
  if (home.empty()) home = "/tmp";
  return home + "/.config/troupe";
}

std::string credential_path() {
  return troupe_config_dir() + "/credential.key";
}

namespace {

Status check_private(const std::string& path, bool dir) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return io_error("cannot stat {}: {}", path, std::strerror(errno));
  if (st.st_uid != getuid()) {
    return permission_denied(
        "{} belongs to uid {}, not to this user (uid {}): a credential must be the user's own", path,
        st.st_uid, getuid());
  }
  if ((st.st_mode & (dir ? 0022 : 0077)) != 0) {
    return permission_denied("{} has mode {:o}: others could {} it; chmod {} {}", path, st.st_mode & 0777,
                             dir ? "replace files in" : "read", dir ? "700" : "600", path);
  }
  return ok_status();
}

}  // namespace

Result<CurveKeyPair> load_or_create_credential() {
  namespace fs = std::filesystem;
  const std::string dir = troupe_config_dir();
  const std::string path = credential_path();
  std::error_code ec;
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) {
    return permission_denied(
        "cannot read the Troupe credential {}: {} (it must be this user's own; set "
        "$TROUPE_CONFIG_DIR or $HOME to use another)",
        path, std::strerror(errno));
  }
  if (!exists) {
    if (!fs::is_directory(dir, ec)) {
      fs::create_directories(dir, ec);
      if (ec) return io_error("cannot create the Troupe config directory {}: {}", dir, ec.message());
      ::chmod(dir.c_str(), 0700);
    }
    // Written under a unique name, then linked into place: link() fails if another
    // process got there first, and then its key is the one everybody reads.
    TROUPE_ASSIGN_OR_RETURN(CurveKeyPair kp, generate_curve_keypair());
    const std::string tmp_prefix = fmt::format("{}/.credential-{}-{}", dir, getpid(), std::random_device{}());
    TROUPE_RETURN_IF_ERROR(write_key_files(tmp_prefix, kp));
    if (::link((tmp_prefix + ".key").c_str(), path.c_str()) != 0 && errno != EEXIST) {
      const int err = errno;
      fs::remove(tmp_prefix + ".key", ec);
      fs::remove(tmp_prefix + ".pub", ec);
      return io_error("cannot create the credential {}: {}", path, std::strerror(err));
    }
    fs::remove(tmp_prefix + ".key", ec);
    fs::remove(tmp_prefix + ".pub", ec);
  }
  if (::access(path.c_str(), R_OK) != 0) {
    return permission_denied(
        "cannot read the Troupe credential {}: {} (it must be this user's own; set "
        "$TROUPE_CONFIG_DIR or $HOME to use another)",
        path, std::strerror(errno));
  }
  TROUPE_RETURN_IF_ERROR(check_private(path, false));
  auto kp = read_key_file(path);
  if (!kp.ok()) return kp.status().with_context("reading the Troupe credential");
  if (kp->secret_key.empty()) return invalid_argument("the Troupe credential {} holds no secret key", path);
  return kp;
}

Result<ClientSecurity> local_client_security() {
  TROUPE_ASSIGN_OR_RETURN(CurveKeyPair kp, load_or_create_credential());
  ClientSecurity sec;
  sec.server_public_key = kp.public_key;
  sec.client_keys = kp;
  return sec;
}

bool is_local_endpoint(const std::string& endpoint) {
  return control::is_loopback_endpoint(endpoint);
}

}  // namespace troupe::sched
