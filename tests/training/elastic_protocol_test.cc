// tests/training/elastic_protocol_test.cc — the pure parts of the elastic protocol
// (training/worker/elastic.h) through the Cap'n Proto codec: the plan's snapshot fields,
// the step reply's queue, device and snapshot fields.
#include <gtest/gtest.h>

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
