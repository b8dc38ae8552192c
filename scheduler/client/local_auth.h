// scheduler/client/local_auth.h — defines local authentication: a user's Troupe credential, a
// CURVE key pair in <config dir>/credential.key (mode 0600 inside a 0700 directory,
// created on first use), and how the scheduler, agents, job processes and the CLI use it
// on loopback, where no key flags are given:
//   - troupe-scheduler on a loopback address serves CURVE with the credential of the user
//     who started it and accepts only that key (plus any --allow-keys);
//   - troupe-agent and every troupe command connect with the same credential, taking the
//     scheduler's public key to be the credential's own;
//   - a client of another user holds another credential (or cannot read this one) and is
//     refused: it can neither submit, cancel, scale nor read logs.
// The config dir is $TROUPE_CONFIG_DIR, else $XDG_CONFIG_HOME/troupe, else
// $HOME/.config/troupe (the passwd entry's home when $HOME is unset).
#pragma once

#include <string>

#include "core/status.h"
#include "scheduler/client/transport.h"

namespace troupe::sched {

std::string troupe_config_dir();
std::string credential_path();  // <config dir>/credential.key

// Reads this user's credential, creating it (and the directory, 0700) when it does not
// exist yet; the file is created atomically, so concurrent first uses agree on one key.
// Refuses a credential file that others may read or that another user owns.
Result<CurveKeyPair> load_or_create_credential();

// ClientSecurity of a client of a loopback scheduler started without keys: this user's
// credential on both ends.
Result<ClientSecurity> local_client_security();

// True for tcp:// addresses on 127.0.0.0/8, localhost or ::1, and for ipc:// / inproc://.
bool is_local_endpoint(const std::string& endpoint);

}  // namespace troupe::sched
