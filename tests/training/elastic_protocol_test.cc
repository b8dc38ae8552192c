// tests/training/elastic_protocol_test.cc — the pure parts of the elastic protocol
// (training/worker/elastic.h) through the Cap'n Proto codec: the plan's snapshot fields,
// the step command's snapshot order, the step reply's queue, device and snapshot fields;
// and the Trainer's one channel of operator requests (trainer_requests.h) over a store.
#include <gtest/gtest.h>

#include "comm/rendezvous_store.h"
#include "training/control.h"
#include "training/driver/trainer_requests.h"
#include "training/messages.h"
#include "training/worker/elastic.h"

namespace {

using namespace troupe;
using namespace troupe::training;

TEST(ElasticPlanCodec, SnapshotFieldsRoundTrip) {
  ElasticPlan p;
  p.epoch = 3;
  p.dp = 2;
  p.grad_accum = 1;
  p.slots = {0, 4};
  p.has_state = {false, false};
  p.step_done = 6;
  p.seq = 17;
  p.snapshot_step = 6;
  p.snapshot_every = 2;
  p.snapshot_dp = 2;
  p.snapshot_committed = 6;
  p.snapshot_parts = {PartSource{{"ipc:///a", "tcp://10.0.0.2:7"}, 0x1234}, PartSource{{"ipc:///b"}, 0x99}};
  const Result<ElasticPlan> d = decode_elastic_plan(encode_elastic_plan(p));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->snapshot_step, 6);
  EXPECT_EQ(d->snapshot_every, 2);
  EXPECT_EQ(d->snapshot_dp, 2);
  EXPECT_EQ(d->snapshot_committed, 6);
  ASSERT_EQ(d->snapshot_parts.size(), 2u);
  EXPECT_EQ(d->snapshot_parts[0].endpoints[1], "tcp://10.0.0.2:7");
  EXPECT_EQ(d->snapshot_parts[1].xxh64, 0x99u);
  // A plan that restores no snapshot.
  const Result<ElasticPlan> none = decode_elastic_plan(encode_elastic_plan(ElasticPlan{}));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->snapshot_step, -1);
  EXPECT_EQ(none->snapshot_committed, -1);
}

TEST(ElasticPlanCodec, IsTheStoreRecordAndRefusesGarbage) {
  ElasticPlan p;
  p.slots = {0};
  p.has_state = {false};
  p.snapshot_start = static_cast<uint8_t>(SnapshotOrder::kCheckpoint);
  const Result<ElasticPlan> d = decode_elastic_plan(encode_elastic_plan(p));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->snapshot_start, static_cast<uint8_t>(SnapshotOrder::kCheckpoint));
  // What an older driver wrote as the store record (JSON) is not a plan: a clear error.
  const Result<ElasticPlan> text = decode_elastic_plan(R"({"epoch": 1, "dp": 1})");
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().to_string().find("ElasticPlan"), std::string::npos) << text.status().to_string();
  // A plan with an order no worker knows.
  p.snapshot_start = 9;
  const Result<ElasticPlan> bad = decode_elastic_plan(encode_elastic_plan(p));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().to_string().find("snapshot order"), std::string::npos) << bad.status().to_string();
}

TEST(StepCommandCodec, CarriesTheDriversSnapshotOrder) {
  for (const SnapshotOrder o : {SnapshotOrder::kNone, SnapshotOrder::kSnapshot, SnapshotOrder::kCheckpoint}) {
    const StepCommand c{7, static_cast<uint8_t>(Command::Kind::kStep), 12, 3, static_cast<uint8_t>(o)};
    const Result<StepCommand> d = decode_step_command(encode_step_command(c));
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(d->seq, 7);
    EXPECT_EQ(d->step, 12);
    EXPECT_EQ(d->snapshot, static_cast<uint8_t>(o));
  }
  const Result<StepCommand> bad = decode_step_command(encode_step_command(StepCommand{0, 0, 1, 0, 3}));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().to_string().find("snapshot order 3"), std::string::npos) << bad.status().to_string();
}

// The requests of `store` under job "j", as the Trainer polls them.
OperatorRequests requests_of(comm::RendezvousStore& store, bool& out, const std::string& scale_at) {
  return OperatorRequests(
      OperatorRequests::Store{
          .key = [](const std::string& rest) { return elastic_key("j", rest); },
          .contains = [&store](const std::string& k) { return store.contains(k); },
          .get =
              [&store](const std::string& k) {
                return store.get(k, comm::deadline_in(std::chrono::seconds(1)));
              },
          .set = [&store](const std::string& k, const std::string& v) { return store.set(k, v); },
          .out = [&out] { return out; }},
      scale_at);
}

TEST(OperatorRequests, OneChannelInOrderEachAnsweredOnce) {
  comm::MemoryStore store;
  bool out = false;
  OperatorRequests r = requests_of(store, out, "4:1");
  EXPECT_FALSE(r.waiting(3));
  EXPECT_TRUE(r.waiting(4));  // scripted (test.scale_at)
  EXPECT_TRUE(r.scripted_after(4));
  ASSERT_TRUE(store.set("j/elastic/request/0", R"({"op": "replace", "slot": 2, "avoid": "node1"})").ok());
  ASSERT_TRUE(store.set("j/elastic/request/1", "not json").ok());
  EXPECT_TRUE(r.waiting(3));
  // The store's first request, then (this boundary's) nothing more: its answer is not sent.
  std::optional<OperatorRequest> q = r.take(3);
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->op, OperatorRequest::Op::kReplace);
  EXPECT_EQ(q->text, "2");
  EXPECT_EQ(q->avoid, "node1");
  r.answer({{"event", "replaced"}, {"slot", 2}});
  EXPECT_FALSE(r.take(3).has_value());
  // While the store is out the answer waits for the next boundary.
  out = true;
  r.send_answer();
  EXPECT_FALSE(store.contains("j/elastic/answer/0").value());
  out = false;
  r.send_answer();
  EXPECT_EQ(store.get("j/elastic/answer/0", comm::deadline_in(std::chrono::seconds(1))).value(),
            R"({"event":"replaced","slot":2})");
  // A malformed request is answered as such; the scripted request of the boundary still
  // comes, once.
  q = r.take(4);
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->op, OperatorRequest::Op::kScale);
  EXPECT_EQ(q->text, "1");
  r.answer({{"event", "scaled"}});  // scripted: answered to nobody
  EXPECT_FALSE(r.take(4).has_value());
  r.send_answer();
  const std::string malformed =
      store.get("j/elastic/answer/1", comm::deadline_in(std::chrono::seconds(1))).value();
  EXPECT_NE(malformed.find("request_refused"), std::string::npos) << malformed;
  EXPECT_NE(malformed.find("malformed request"), std::string::npos) << malformed;
  EXPECT_FALSE(store.contains("j/elastic/answer/2").value());
  // The next request number.
  ASSERT_TRUE(store.set("j/elastic/request/2", R"({"op": "scale", "dp": 3})").ok());
  q = r.take(5);
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->op, OperatorRequest::Op::kScale);
  EXPECT_EQ(q->text, "3");
}

TEST(StepReplyCodec, QueueAndDeviceFieldsRoundTrip) {
  StepReply m;
  m.seq = 41;
  m.epoch = 2;
  m.rank = 1;
  m.kind = 0;
  m.step = 9;
  m.upload_waits = 3;
  m.activation_bytes = 1 << 20;
  m.device_ms = 12.5;
  m.device_gap_ms = 0.02;
  m.launched_ahead = true;
  m.next_queued = true;
  m.command_wait_ms = 0.004;
  const Result<StepReply> d = decode_step_reply(encode_step_reply(m));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->upload_waits, 3);
  EXPECT_EQ(d->activation_bytes, 1 << 20);
  EXPECT_EQ(d->device_ms, 12.5);
  EXPECT_EQ(d->device_gap_ms, 0.02);
  EXPECT_TRUE(d->launched_ahead);
  EXPECT_TRUE(d->next_queued);
  EXPECT_EQ(d->command_wait_ms, 0.004);
  EXPECT_EQ(d->snapshot, -1);
  // The CPU defaults: nothing measured on a device.
  const Result<StepReply> cpu = decode_step_reply(encode_step_reply(StepReply{}));
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->upload_waits, -1);
  EXPECT_EQ(cpu->device_ms, -1);
  EXPECT_FALSE(cpu->next_queued);
  EXPECT_EQ(cpu->snapshot, -1);
  EXPECT_EQ(cpu->snapshot_wait_ms, -1);
  EXPECT_EQ(cpu->snapshot_replicated, -1);
}

TEST(StepReplyCodec, SnapshotFieldsRoundTrip) {
  StepReply m;
  m.step = 8;
  m.snapshot = 8;
  m.snapshot_ms = 1.5;
  m.snapshot_wait_ms = 0.25;
  m.snapshot_replicated = 6;
  m.snapshot_errors = {{4, "skipped: no generation was free"}};
  m.rss_peak_bytes = 12345;
  const Result<StepReply> d = decode_step_reply(encode_step_reply(m));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->snapshot, 8);
  EXPECT_EQ(d->snapshot_ms, 1.5);
  EXPECT_EQ(d->snapshot_wait_ms, 0.25);
  EXPECT_EQ(d->snapshot_replicated, 6);
  ASSERT_EQ(d->snapshot_errors.size(), 1u);
  EXPECT_EQ(d->snapshot_errors[0].first, 4);
  EXPECT_EQ(d->rss_peak_bytes, 12345);
}

}  // namespace
