// tests/training/elastic_protocol_test.cc — the pure parts of the elastic protocol with
// steps in flight (actors/training/elastic.h): the step a new epoch restores when its
// survivors had completed steps the Trainer had not seen reported (restore_step), and the
// step reply's queue and device fields through the Cap'n Proto codec.
#include <gtest/gtest.h>

#include "actors/training/elastic.h"
#include "actors/training/messages.h"

namespace {

using namespace troupe;
using namespace troupe::training;

TEST(RestoreStep, TheDriversStepWhenEverySurvivorHoldsIt) {
  // One step in flight, or the window drained: every survivor still holds step_done.
  EXPECT_EQ(restore_step(7, {{8, 7}, {7, 6}}).value(), 7);
  EXPECT_EQ(restore_step(7, {{7, 6}, {7, 6}, {7, 6}}).value(), 7);
  EXPECT_EQ(restore_step(7, {}).value(), 7);  // no survivor with state (replacements only)
}

TEST(RestoreStep, ALaterStepEverySurvivorCompletedWithTwoInFlight) {
  // The Trainer saw step 7 reported everywhere; steps 8 and 9 were in flight. One
  // survivor finished both (it holds 9 and 8, no longer 7); the others finished 8. The
  // ranks finish steps within one of each other, so 8 is held by all: restore 8.
  EXPECT_EQ(restore_step(7, {{9, 8}, {8, 7}, {9, 8}}).value(), 8);
  EXPECT_EQ(restore_step(7, {{9, 8}, {9, 8}}).value(), 8);  // the oldest common step
}

TEST(RestoreStep, NoCommonStepIsAnErrorNamingWhatEachHolds) {
  const Result<int64_t> r = restore_step(7, {{10, 9}, {8, 7}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("[10,9] [8,7]"), std::string::npos) << r.status().message();
  // Older than what the Trainer saw completed is never chosen.
  EXPECT_FALSE(restore_step(7, {{6, 5}}).ok());
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
  // The CPU defaults: nothing measured on a device.
  const Result<StepReply> cpu = decode_step_reply(encode_step_reply(StepReply{}));
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->upload_waits, -1);
  EXPECT_EQ(cpu->device_ms, -1);
  EXPECT_FALSE(cpu->next_queued);
}

}  // namespace
