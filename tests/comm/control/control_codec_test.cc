// tests/comm/control/control_codec_test.cc — the envelope codec: round trips of every
// payload kind, misaligned input, and hostile input (truncation, size limit, garbage,
// unknown union members and enumerants, bad versions, reserved type ids).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "comm/control/bytes.h"
#include "comm/control/codec.h"
#include "tests/comm/control/control_test_util.h"

namespace troupe::control {
namespace {

Envelope make(Payload p) {
  Envelope e;
  e.sender = {"node-a", "alice"};
  e.receiver = {"node-b", "bob"};
  e.correlation_id = 42;
  e.deadline_unix_nanos = 1'700'000'000'123'456'789;
  e.payload = std::move(p);
  e.message_type_id = system_type_id(e.payload);
  return e;
}

std::vector<Payload> every_payload() {
  return {Heartbeat{7, 123456789},
          MonitorRequest{{"n1", "w"}, {"n2", "t"}},
          DemonitorRequest{{"n1", "w"}, {"n2", "t"}},
          LinkRequest{{"n1", "a"}, {"n2", "b"}},
          UnlinkRequest{{"n1", "a"}, {"n2", "b"}},
          Down{{"n2", "t"}, DownReason::kHeartbeatTimeout, "no heartbeat for 3000 ms"},
          ErrorReply{5, "deadline passed"},
          Ack{},
          UserPayload{0x0E5A000000000001ull, std::string("\0\1\2binary\xff", 10)}};
}

TEST(ControlCodec, RoundTripsEveryPayloadKind) {
  for (const Payload& p : every_payload()) {
    Envelope e = make(p);
    auto bytes = encode_envelope(e);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto back = decode_envelope(bytes->data(), bytes->size());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, e) << describe(e);
  }
}

// With TROUPE_FUZZ_SEED_DIR set, writes one encoded envelope per payload kind there: the
// seed corpus of tests/actors/fuzz_decoder.cc.
TEST(ControlCodec, WritesFuzzSeedsOnRequest) {
  const char* dir = std::getenv("TROUPE_FUZZ_SEED_DIR");
  if (dir == nullptr) GTEST_SKIP() << "TROUPE_FUZZ_SEED_DIR not set";
  int i = 0;
  for (const Payload& p : every_payload()) {
    auto bytes = encode_envelope(make(p));
    ASSERT_TRUE(bytes.ok());
    std::ofstream(fmt::format("{}/seed-{}", dir, i++), std::ios::binary) << *bytes;
  }
}

TEST(ControlCodec, DecodesMisalignedInput) {
  Envelope e = make(UserPayload{99, "payload"});
  auto bytes = encode_envelope(e);
  ASSERT_TRUE(bytes.ok());
  std::vector<char> buf(bytes->size() + 8);
  for (size_t shift = 1; shift < 8; ++shift) {
    std::memcpy(buf.data() + shift, bytes->data(), bytes->size());
    auto back = decode_envelope(buf.data() + shift, bytes->size());
    ASSERT_TRUE(back.ok()) << "shift " << shift << ": " << back.status();
    EXPECT_EQ(*back, e);
  }
}

TEST(ControlCodec, RejectsEveryTruncation) {
  auto bytes = encode_envelope(make(Down{{"n", "a"}, DownReason::kCrash, "boom"}));
  ASSERT_TRUE(bytes.ok());
  for (size_t n = 0; n < bytes->size(); ++n) {
    auto r = decode_envelope(bytes->data(), n);
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes decoded";
  }
}

TEST(ControlCodec, RejectsTrailingBytes) {
  auto bytes = encode_envelope(make(Ack{}));
  ASSERT_TRUE(bytes.ok());
  std::string padded = *bytes + std::string(8, '\0');
  auto r = decode_envelope(padded.data(), padded.size());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("trailing"), std::string::npos) << r.status();
}

TEST(ControlCodec, EnforcesSizeLimits) {
  Envelope e = make(UserPayload{77, std::string(4096, 'x')});
  auto big = encode_envelope(e, 1024);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  auto bytes = encode_envelope(e);
  ASSERT_TRUE(bytes.ok());
  DecodeLimits limits;
  limits.max_message_bytes = 1024;
  auto r = decode_envelope(bytes->data(), bytes->size(), limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  // A traversal limit below the message's size is hit and reported.
  limits = DecodeLimits{};
  limits.traversal_limit_words = 16;
  r = decode_envelope(bytes->data(), bytes->size(), limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
}

TEST(ControlCodec, RejectsGarbageWithoutThrowing) {
  std::mt19937_64 rng(1234);
  size_t rejected = 0;
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint64_t> words(1 + rng() % 32);
    for (auto& w : words) w = rng();
    if (i % 2 == 0) words[0] = 0;  // a plausible segment table: one segment
    if (i % 2 == 0 && words.size() > 1) words[0] = uint64_t(words.size() - 1) << 32;
    auto r = decode_envelope(words.data(), words.size() * 8);
    if (!r.ok()) ++rejected;
  }
  EXPECT_GT(rejected, 1900u);
  const char odd[13] = "not 8-byte-x";
  auto r = decode_envelope(odd, 12);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
}

// Finds the 16-bit field holding `value` by trying each candidate offset; returns the
// statuses of every mutated decode.
std::vector<Status> mutate_u16(const std::string& bytes, uint16_t value, uint16_t replacement) {
  std::vector<Status> out;
  for (size_t off = 8; off + 2 <= bytes.size(); off += 2) {
    uint16_t v;
    std::memcpy(&v, bytes.data() + off, 2);
    if (v != value) continue;
    std::string m = bytes;
    std::memcpy(m.data() + off, &replacement, 2);
    auto r = decode_envelope(m.data(), m.size());
    out.push_back(r.ok() ? ok_status() : r.status());
  }
  return out;
}

bool any_mentions(const std::vector<Status>& v, const std::string& text) {
  for (const Status& s : v) {
    if (!s.ok() && s.message().find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(ControlCodec, RejectsUnknownUnionMember) {
  auto bytes = encode_envelope(make(Ack{}));
  ASSERT_TRUE(bytes.ok());
  // `ack` is union member 7 of the payload union (discriminant value 7).
  auto results = mutate_u16(*bytes, 7, 200);
  EXPECT_TRUE(any_mentions(results, "unknown union member 200")) << results.size();
}

TEST(ControlCodec, RejectsUnknownEnumerant) {
  auto bytes = encode_envelope(make(Down{{"n", "a"}, DownReason::kKilled, ""}));
  ASSERT_TRUE(bytes.ok());
  auto results = mutate_u16(*bytes, 4, 77);
  EXPECT_TRUE(any_mentions(results, "unknown Reason 77")) << results.size();
}

TEST(ControlCodec, RejectsOtherProtocolVersions) {
  Envelope e = make(Ack{});
  e.protocol_version = 2;
  auto bytes = encode_envelope(e);
  ASSERT_TRUE(bytes.ok());
  auto r = decode_envelope(bytes->data(), bytes->size());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("protocol version 2"), std::string::npos);
}

TEST(ControlCodec, RejectsReservedTypeIdsAndLongNames) {
  EXPECT_FALSE(encode_envelope(make(UserPayload{0, "x"})).ok());
  EXPECT_FALSE(encode_envelope(make(UserPayload{kSystemTypeIdBase + 3, "x"})).ok());
  Envelope e = make(Ack{});
  e.sender.name = std::string(kMaxNameBytes + 1, 'n');
  auto r = encode_envelope(e);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(ByteCodec, RoundTripAndTruncation) {
  ByteWriter w;
  w.put(int64_t{-5}).put(3.5f).put_bytes("hello").put_vector(std::vector<uint32_t>{1, 2, 3});
  std::string bytes = w.bytes();
  ByteReader r(bytes);
  int64_t a = 0;
  float b = 0;
  std::string s;
  std::vector<uint32_t> v;
  ASSERT_TRUE(r.get(&a) && r.get(&b) && r.get_bytes(&s) && r.get_vector(&v));
  EXPECT_TRUE(r.finish("test").ok());
  EXPECT_EQ(a, -5);
  EXPECT_EQ(b, 3.5f);
  EXPECT_EQ(s, "hello");
  EXPECT_EQ(v, (std::vector<uint32_t>{1, 2, 3}));
  for (size_t n = 0; n < bytes.size(); ++n) {
    ByteReader t(std::string_view(bytes).substr(0, n));
    t.get(&a);
    t.get(&b);
    t.get_bytes(&s);
    t.get_vector(&v);
    EXPECT_FALSE(t.finish("truncated").ok()) << n;
  }
}

}  // namespace
}  // namespace troupe::control
