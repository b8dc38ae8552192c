// scheduler/daemons/secrets.h — defines what keeps a job's secrets off disk in the clear:
//   make_private_dir: a directory only its owner may enter (0700), tightened when it exists
//     (a shared, sticky directory such as /tmp is refused, never tightened);
//   EnvSealer: the values of a job's environment (`troupe submit --env K=V`: API tokens,
//     passwords) as the scheduler stores them — sealed (XSalsa20-Poly1305, libsodium's
//     crypto_secretbox) under a key derived from the scheduler's own secret key, or kept in
//     <state-dir>/env.key (0600) when it runs without one; the database, its WAL and the
//     events hold only the sealed form, and the value is unsealed when a process is spawned;
//   write_private_file: a 0600 file (the job's CURVE secret key an agent hands a process:
//     TROUPE_JOB_SECRET_KEY_FILE, never the key itself in the environment).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"
#include "scheduler/client/transport.h"

namespace troupe::sched {

// Creates `dir` (and its parents) and makes it 0700; an existing one readable or
// enterable by others is tightened (logged). `what` names it in errors.
Status make_private_dir(const std::string& dir, const char* what);

// Writes `bytes` to `path` with mode 0600 (created, or truncated and tightened).
Status write_private_file(const std::string& path, std::string_view bytes);

class EnvSealer {
 public:
  // The key: derived from `server_keys` (the scheduler's CURVE key pair) when given, else
  // <state_dir>/env.key (32 random bytes, created 0600 on first use).
  static Result<EnvSealer> create(const std::optional<CurveKeyPair>& server_keys,
                                  const std::string& state_dir);

  // "troupe-sealed:v1:<base64 of nonce + ciphertext>"; a fresh nonce each time.
  std::string seal(std::string_view value) const;
  // The value of a sealed string; DataLoss when it was sealed under another key or altered.
  Result<std::string> unseal(std::string_view sealed) const;
  static bool is_sealed(std::string_view v);

 private:
  std::array<unsigned char, 32> key_{};
};

}  // namespace troupe::sched
