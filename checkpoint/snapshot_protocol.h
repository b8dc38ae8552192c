// checkpoint/snapshot_protocol.h — defines the messages of the snapshot keeper's protocols
// (a worker with the keeper of its node; one keeper with another), as plain structs, and
// their Cap'n Proto codec (checkpoint/snapshot.capnp, encoded in snapshot_codec.cc).
// Decoding never throws: malformed, truncated or oversized input is a DataLoss status
// naming the message.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/status.h"

namespace troupe::checkpoint {

struct SnapAttach {
  std::string job;
  int32_t rank = 0;
  uint64_t bytes = 0;
};
struct SnapBegin {
  std::string job;
  int32_t rank = 0;
  uint32_t gen = 0;
  int64_t step = 0;
};
struct SnapLanded {
  std::string job;
  int32_t rank = 0;
  uint32_t gen = 0;
  int64_t step = 0;
};
struct SnapCommit {
  std::string job;
  int32_t rank = 0;
  int64_t step = 0;
  std::string replicate_to;  // another keeper's endpoint; empty: no copy
};
struct SnapFetch {
  std::string job;
  int32_t rank = 0;
  int64_t step = 0;
  std::vector<std::string> sources;  // other keepers' endpoints, tried in order
};
struct SnapQuery {
  std::string job;  // empty: every job
};
struct SnapRelease {
  std::string job;
  int32_t rank = -1;  // -1: every rank of the job
};
struct SnapPut {
  std::string job;
  int32_t rank = 0;
  int64_t step = 0;
  uint64_t bytes = 0;
  std::string from_node;
};
struct SnapGet {
  std::string job;
  int32_t rank = 0;
  int64_t step = 0;
};
using SnapRequest = std::variant<SnapAttach, SnapBegin, SnapLanded, SnapCommit, SnapFetch, SnapQuery,
                                 SnapRelease, SnapPut, SnapGet>;

struct SnapGen {
  int64_t step = -1;
  uint32_t state = 0;  // SegmentState (snapshot_segment.h)
};
struct SnapHeld {
  std::string job;
  int32_t rank = 0;
  int64_t step = -1;
  uint64_t bytes = 0;
  bool replica = false;
  std::string from_node;
  bool committed = false;
  std::string replicated_to;
  int64_t replicated_step = -1;
};
struct SnapReply {
  uint16_t code = 0;  // StatusCode
  std::string text;
  std::string node, endpoint;
  std::vector<SnapGen> gens;
  std::vector<SnapHeld> held;
  uint64_t bytes = 0;

  static SnapReply of(const Status& st) {
    SnapReply r;
    r.code = static_cast<uint16_t>(st.code());
    r.text = st.message();
    return r;
  }
  Status status() const { return code == 0 ? ok_status() : Status(static_cast<StatusCode>(code), text); }
};

std::string encode_snap_request(const SnapRequest& m);
Result<SnapRequest> decode_snap_request(std::string_view bytes);
std::string encode_snap_reply(const SnapReply& m);
Result<SnapReply> decode_snap_reply(std::string_view bytes);

}  // namespace troupe::checkpoint
