// actors/training/messages.h — defines the typed messages of the training actors (each
// worker's "stage.<rank>", "attention.<rank>" and "experts.<rank>", placed on its slot):
// ActorStatusQuery and its reply ActorStatus. They travel as Cap'n Proto structs
// (actors/training/messages.capnp, encoded in messages_codec.cc); decoding never throws —
// malformed, truncated or oversized input is a DataLoss status naming the message.
//
// Type ids: the training layer's prefix 0x7A1E (actors/message.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace troupe::training {

struct ActorStatusQuery {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0101ull;
  std::string requester;
};

struct ActorStatus {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0102ull;
  std::string id, role;
  int32_t rank = -1, slot = -1;
  uint64_t epoch = 0;
  std::string state;
  int64_t steps_done = 0;
  double last_step_ms = 0;
  int64_t params = 0;
  std::string device, host;
  int32_t pid = 0;
};

std::string encode_actor_status_query(const ActorStatusQuery& m);
Result<ActorStatusQuery> decode_actor_status_query(std::string_view bytes);
std::string encode_actor_status(const ActorStatus& m);
Result<ActorStatus> decode_actor_status(std::string_view bytes);

}  // namespace troupe::training
