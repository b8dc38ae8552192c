// tests/core/capnp_codecs_test.cc — the three Cap'n Proto codecs driven by core/capnp_fields.h
// (training/messages_codec.cc, checkpoint/snapshot_codec.cc, scheduler/client/codec.cc): every
// message, every field set, encodes to the bytes the hand-written codecs produced (pinned as
// size + FNV-1a 64 below, so a field missing from a table, or a reordered one, fails here) and
// decodes back to the same bytes; unknown enum values and union members are refused by name.
//
// A deliberate schema change alters some of these bytes: update the pinned line the failure
// prints, after checking that the change is the one intended.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/snapshot_protocol.h"
#include "scheduler/client/protocol.h"
#include "training/messages.h"

namespace troupe {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

struct Encoded {
  std::string name;
  std::string bytes;
  Status roundtrip;  // decode, then encode again: the same bytes
};

template <class M, class Enc, class Dec>
Encoded encoded(std::string name, const M& m, Enc enc, Dec dec) {
  Encoded e{std::move(name), enc(m), Status()};
  auto back = dec(e.bytes);
  if (!back.ok()) {
    e.roundtrip = back.status();
  } else if (enc(*back) != e.bytes) {
    e.roundtrip = data_loss("{}: decoding and encoding again changed the bytes", e.name);
  }
  return e;
}

std::vector<Encoded> every_message() {
  std::vector<Encoded> out;
  {
    using namespace training;
    out.push_back(encoded("ActorStatusQuery", ActorStatusQuery{"req"}, encode_actor_status_query,
                          decode_actor_status_query));
    out.push_back(encoded("ActorStatus",
                          ActorStatus{"id1", "role", 3, 4, 5, "state", 6, 7.5, 8, "dev", "host", 9},
                          encode_actor_status, decode_actor_status));
    ElasticPlan p;
    p.epoch = 2, p.dp = 2, p.grad_accum = 3, p.slots = {1, 2}, p.has_state = {true, false};
    p.step_done = 7, p.seq = 8, p.reason = "r", p.checkpoint = "ck", p.ckpt_every = 9, p.ckpt_dir = "dir";
    p.snapshot_step = 10, p.snapshot_dp = 2,
    p.snapshot_parts = {PartSource{{"e1", "e2"}, 11}, PartSource{{}, 12}};
    p.snapshot_every = 13, p.snapshot_committed = 14, p.snapshot_start = 2;
    out.push_back(encoded("ElasticPlan", p, encode_elastic_plan, decode_elastic_plan));
    out.push_back(
        encoded("StepCommand", StepCommand{1, 2, 3, 4, 1}, encode_step_command, decode_step_command));
    StepReply r;
    r.seq = 1, r.epoch = 2, r.rank = 3, r.slot = 4, r.kind = 1, r.step = 5, r.loss = 1.5, r.lm_loss = 2.5;
    r.aux_loss = 3.5, r.grad_norm = 4.5, r.lr = 5.5, r.step_tokens = 6, r.expert_load = {{1, 2}, {3}};
    r.step_ms = 7.5, r.comm_ms = 8.5, r.compute_ms = 9.5, r.comm_ms_mean = 10.5;
    r.comm_by_kind_ms = {{"a", 1.0}, {"b", 2.0}}, r.peak_bytes = 11, r.val_loss = 12.5, r.ckpt_started = 13;
    r.ckpt_blocked_ms = 14.5, r.ckpt_bytes = 15, r.durable = {16, 17}, r.ckpt_errors = {{18, "e18"}};
    r.snapshot = 19, r.snapshot_ms = 20.5, r.snapshot_wait_ms = 21.5, r.snapshot_replicated = 22;
    r.snapshot_errors = {{23, "e23"}, {24, "e24"}}, r.host_syncs = 25, r.rss_peak_bytes = 26;
    r.upload_waits = 27, r.activation_bytes = 28, r.device_ms = 29.5, r.device_gap_ms = 30.5;
    r.launched_ahead = true, r.next_queued = true, r.command_wait_ms = 31.5;
    out.push_back(encoded("StepReply", r, encode_step_reply, decode_step_reply));
    out.push_back(encoded("WorkerFailure", WorkerFailure{1, 2, 3, 4, "actor", "text", 5, 6},
                          encode_worker_failure, decode_worker_failure));
    out.push_back(encoded("SnapshotLanded", SnapshotLanded{1, 2, 3, 4, 5, 6, "node", "ep", "err"},
                          encode_snapshot_landed, decode_snapshot_landed));
    out.push_back(encoded("SnapshotCommitted",
                          SnapshotCommitted{1, 2, {{"n1", "e1"}, {"n2", "e2"}}, true, true},
                          encode_snapshot_committed, decode_snapshot_committed));
  }
  {
    using namespace checkpoint;
    const std::vector<SnapRequest> requests{SnapAttach{"j", 1, 2},
                                            SnapBegin{"j", 1, 2, 3},
                                            SnapLanded{"j", 1, 2, 3},
                                            SnapCommit{"j", 1, 2, "rep"},
                                            SnapFetch{"j", 1, 2, {"s1", "s2"}},
                                            SnapQuery{"j"},
                                            SnapRelease{"j", 4},
                                            SnapPut{"j", 1, 2, 3, "from"},
                                            SnapGet{"j", 1, 2}};
    for (const SnapRequest& q : requests) {
      out.push_back(
          encoded("SnapRequest#" + std::to_string(q.index()), q, encode_snap_request, decode_snap_request));
    }
    SnapReply sr;
    sr.code = 3, sr.text = "t", sr.node = "n", sr.endpoint = "e", sr.gens = {{1, 2}, {3, 4}};
    sr.held = {SnapHeld{"j", 1, 2, 3, true, "fn", true, "rt", 4}}, sr.bytes = 99;
    out.push_back(encoded("SnapReply", sr, encode_snap_reply, decode_snap_reply));
  }
  {
    using namespace sched;
    const ProcStatus ps{"job", "name", 1, 2, true, 3, 4, "err", 5};
    const std::vector<Payload> payloads{
        RegisterAgent{"a", "h", 1, 2, {ps, ps}},
        RegisterAck{1, 2},
        AgentHeartbeat{"a", 1, 2, 3, 4, 5},
        Reregister{},
        SpawnRequest{"j", "n", 1, {"a1", "a2"}, {{"k", "v"}, {"k2", "v2"}}, "wd", "secret"},
        KillRequest{"j", "n", 9, 10},
        ProcStarted{ps},
        ProcExited{ps},
        ExitAck{"j", "n", 1, 2},
        ProcBeat{"j", "n", 1, 2, true, "an", "ep", 3},
        StoreRequest{StoreOp::kWait, "j", 1, {"k1", "k2"}, std::string("v\0x", 3), 4},
        SubmitJob{"{}"},
        StatusQuery{"j"},
        CancelJob{"j"},
        LogsQuery{{"j", "n", 1, 2}},
        Reply{StatusCode::kNotFound, "m", "b", std::string("d\0", 2), 7},
        AgentLogsQuery{{"j", "n", 3, 4}},
        PlaceActors{"j", 1, {{"a", "p"}, {"b", "q"}}, "dp2"},
        RelayedMessage{"s/inbox", std::string(16, 'x')},
        HealthReport{"j", "n", 1, 2, 3, {{"m", 1.5}, {"n", 2.5}}}};
    auto enc = [](const Message& m) { return encode_message(m); };
    auto dec = [](const std::string& b) { return decode_message(b.data(), b.size()); };
    for (const Payload& p : payloads) out.push_back(encoded(payload_name(p), Message{77, p}, enc, dec));
  }
  return out;
}

struct Pinned {
  const char* name;
  size_t size;
  uint64_t fnv1a;
};

// What the hand-written codecs encoded every_message() as.
const Pinned kPinned[] = {
    {"ActorStatusQuery", 32, 0x49efa3051fc6fc4cull},
    {"ActorStatus", 144, 0x4abe9230129d9e07ull},
    {"ElasticPlan", 280, 0x676320f8cce224c5ull},
    {"StepCommand", 48, 0x8fb5d02171f9f91bull},
    {"StepReply", 536, 0x83ed97a9ac2724b6ull},
    {"WorkerFailure", 88, 0xfafd58032c096333ull},
    {"SnapshotLanded", 104, 0x0a8faa7272fdc893ull},
    {"SnapshotCommitted", 120, 0xb5595e188683d92dull},
    {"SnapRequest#0", 64, 0xa04c66f97148963bull},
    {"SnapRequest#1", 64, 0x955f2be7a4d5cec9ull},
    {"SnapRequest#2", 64, 0xee72662cb5d58f1aull},
    {"SnapRequest#3", 80, 0x01051ee27254cb3bull},
    {"SnapRequest#4", 104, 0x0f9a7ca04813f699ull},
    {"SnapRequest#5", 48, 0x2bca62a5949498cdull},
    {"SnapRequest#6", 56, 0xcbf12436f74e42c8ull},
    {"SnapRequest#7", 88, 0x0e63a427b49ef21full},
    {"SnapRequest#8", 64, 0x52915356bf0cbc03ull},
    {"SnapReply", 224, 0x32bf613a0bee25dcull},
    {"registerAgent", 256, 0x74b6c43d53871c24ull},
    {"registerAck", 56, 0x149b3baac6a39d8cull},
    {"agentHeartbeat", 88, 0x98f183f9871f6fa4ull},
    {"reregister", 40, 0x3aa0b36e17d9c55dull},
    {"spawn", 232, 0xd7a2fdfdee6f25b9ull},
    {"kill", 80, 0x3de1b05f32a5a072ull},
    {"procStarted", 120, 0x5960b9e4467c187dull},
    {"procExited", 120, 0x1192d72821cdbd20ull},
    {"exitAck", 88, 0xed4fa32170886ba7ull},
    {"procBeat", 128, 0x1704e4377dcbdb54ull},
    {"store", 128, 0x5d78b9e10ab9ff77ull},
    {"submit", 48, 0xdf0de2cedf27a1fbull},
    {"status", 48, 0xc0eb91e4ed810262ull},
    {"cancel", 48, 0x7b28d4218a92d6fbull},
    {"logs", 88, 0x6d2627eef5612451ull},
    {"reply", 104, 0x2b1d9c4778fd05b5ull},
    {"logsForAgent", 88, 0x231fd32d9175e54bull},
    {"placeActors", 160, 0x179c2e880809cad9ull},
    {"relay", 80, 0xdf1245981f389951ull},
    {"health", 160, 0x3d007d59c810bf46ull},
};

TEST(CapnpCodecs, EveryMessageKeepsItsBytesAndRoundTrips) {
  const std::vector<Encoded> all = every_message();
  ASSERT_EQ(all.size(), std::size(kPinned));
  for (size_t i = 0; i < all.size(); ++i) {
    const Encoded& e = all[i];
    EXPECT_EQ(e.name, kPinned[i].name);
    EXPECT_TRUE(e.bytes.size() == kPinned[i].size && fnv1a(e.bytes) == kPinned[i].fnv1a)
        << "now: {\"" << e.name << "\", " << e.bytes.size() << ", 0x" << std::hex << fnv1a(e.bytes) << "ull}";
    EXPECT_TRUE(e.roundtrip.ok()) << e.name << ": " << e.roundtrip.to_string();
  }
}

TEST(CapnpCodecs, UnknownEnumValuesAreRefusedNamingTheField) {
  using namespace sched;
  const std::string reply = encode_message(Message{1, Reply{static_cast<StatusCode>(200), "m", "", "", 0}});
  auto r = decode_message(reply.data(), reply.size());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown Code 200"), std::string::npos) << r.status().to_string();

  const std::string store =
      encode_message(Message{1, StoreRequest{static_cast<StoreOp>(9), "j", 1, {"k"}, "", 0}});
  auto s = decode_message(store.data(), store.size());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("unknown Op 9"), std::string::npos) << s.status().to_string();
}

// `a` with every byte where it differs from `b` (the same message but for its union
// member) set to 0xff: a union member this build does not know.
std::string unknown_member(std::string a, const std::string& b) {
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) a[i] = static_cast<char>(0xff);
  }
  return a;
}

TEST(CapnpCodecs, UnknownUnionMembersAreRefused) {
  const std::string msg = unknown_member(sched::encode_message(sched::Message{5, sched::StatusQuery{"j"}}),
                                         sched::encode_message(sched::Message{5, sched::CancelJob{"j"}}));
  auto m = sched::decode_message(msg.data(), msg.size());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("unknown union member"), std::string::npos) << m.status().to_string();

  const std::string req =
      unknown_member(checkpoint::encode_snap_request(checkpoint::SnapGet{"j", 1, 2}),
                     checkpoint::encode_snap_request(checkpoint::SnapBegin{"j", 1, 0, 2}));
  auto q = checkpoint::decode_snap_request(req);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("SnapRequest: unknown union member"), std::string::npos)
      << q.status().to_string();
}

}  // namespace
}  // namespace troupe
