// tests/observe/tensorboard_test.cc — TensorBoard event files read back byte by byte:
// CRC-32C against known values, the TFRecord framing (length, masked CRCs of length and
// data), the Event/Summary protobuf of scalars and histograms, corrupt and truncated files
// refused, and a training run's records (RunMetrics) turned into the tags TensorBoard shows.
#include "observe/tensorboard.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "training/driver/run_metrics.h"

namespace troupe::observe {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path temp_dir() {
  std::string t = (fs::temp_directory_path() / "troupe-tb-XXXXXX").string();
  EXPECT_NE(mkdtemp(t.data()), nullptr);
  return t;
}

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(crc32c(""), 0x00000000u);
  EXPECT_EQ(crc32c("123456789"), 0xe3069283u);              // the Castagnoli check value
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8a9136aau);    // RFC 3720 B.4: 32 bytes of zeros
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62a8ab43u);  // ... of ones
  // masked = rotate right by 15, plus 0xa282ead8
  const uint32_t c = crc32c("123456789");
  EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfRecord, FramesAndReadsBack) {
  const std::string rec = frame_record("hello");
  ASSERT_EQ(rec.size(), 8u + 4 + 5 + 4);
  uint64_t len;
  std::memcpy(&len, rec.data(), 8);
  EXPECT_EQ(len, 5u);
  uint32_t lc, dc;
  std::memcpy(&lc, rec.data() + 8, 4);
  std::memcpy(&dc, rec.data() + 17, 4);
  EXPECT_EQ(lc, masked_crc32c(rec.substr(0, 8)));
  EXPECT_EQ(dc, masked_crc32c("hello"));
  auto back = read_records(rec + frame_record("") + frame_record("world"));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, (std::vector<std::string>{"hello", "", "world"}));
}

TEST(TfRecord, CorruptOrTruncatedIsRefused) {
  std::string rec = frame_record("some data");
  std::string bad = rec;
  bad[13] ^= 1;  // a data byte
  EXPECT_NE(read_records(bad).status().message().find("data's CRC"), std::string::npos);
  bad = rec;
  bad[2] ^= 1;  // a length byte
  EXPECT_NE(read_records(bad).status().message().find("length's CRC"), std::string::npos);
  EXPECT_FALSE(read_records(rec.substr(0, rec.size() - 1)).ok());
  EXPECT_FALSE(read_records(rec.substr(0, 10)).ok());
}

TEST(Event, ScalarAndHistogramRoundTrip) {
  auto s = decode_event(encode_scalar_event(1.5e9, 42, "train/loss", 2.25f));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_DOUBLE_EQ(s->wall_time, 1.5e9);
  EXPECT_EQ(s->step, 42);
  EXPECT_FLOAT_EQ(s->scalars.at("train/loss"), 2.25f);
  const Histogram h = Histogram::of({1, 2, 2, 3, 10}, 3);
  EXPECT_EQ(h.num, 5);
  EXPECT_EQ(h.min, 1);
  EXPECT_EQ(h.max, 10);
  EXPECT_EQ(h.sum, 18);
  EXPECT_EQ(h.sum_squares, 1 + 4 + 4 + 9 + 100);
  EXPECT_EQ(h.bucket, (std::vector<double>{4, 0, 1}));  // (.., 4], (4, 7], (7, 10]
  auto e = decode_event(encode_histogram_event(2e9, 7, "moe/expert_load/layer_1", h));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const Histogram& d = e->histograms.at("moe/expert_load/layer_1");
  EXPECT_EQ(d.bucket_limit, h.bucket_limit);
  EXPECT_EQ(d.bucket, h.bucket);
  EXPECT_EQ(d.sum_squares, h.sum_squares);
  auto v = decode_event(encode_file_version_event(3.0));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->file_version, "brain.Event:2");
  EXPECT_FALSE(decode_event(std::string("\x29\x01", 2)).ok());  // a fixed64 cut short
}

TEST(TensorBoardWriter, WritesAFileTensorBoardReads) {
  const fs::path dir = temp_dir();
  {
    auto w = TensorBoardWriter::open((dir / "tb").string());
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_NE((*w)->path().find("events.out.tfevents."), std::string::npos);
    ASSERT_TRUE((*w)->scalar(1, "a", 0.5, 10).ok());
    ASSERT_TRUE((*w)->histogram(1, "h", Histogram::of({1, 2, 3}), 10).ok());
    ASSERT_TRUE((*w)->flush().ok());
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir / "tb")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  auto recs = read_records(slurp(files[0]));
  ASSERT_TRUE(recs.ok()) << recs.status().to_string();
  ASSERT_EQ(recs->size(), 3u);
  EXPECT_EQ(decode_event((*recs)[0])->file_version, "brain.Event:2");
  EXPECT_FLOAT_EQ(decode_event((*recs)[1])->scalars.at("a"), 0.5f);
  EXPECT_EQ(decode_event((*recs)[2])->histograms.at("h").num, 3);
  fs::remove_all(dir);
}

TEST(RunMetrics, TrainingRecordsBecomeTags) {
  const fs::path dir = temp_dir();
  {
    layers::ObserveOptions o;
    auto m = training::RunMetrics::open(o, dir.string());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    (*m)->on_step(nlohmann::json{{"step", 3},
                                 {"loss", 4.5},
                                 {"tokens_per_s", 1000.0},
                                 {"comm_by_kind_ms", {{"all_to_all", 2.0}}},
                                 {"expert_load", {{10, 30, 20, 20}, {5, 5, 5, 45}}}});
    (*m)->on_event(nlohmann::json{{"event", "recovered"}, {"steps_lost", 2}, {"recovery_s", 1.5}});
  }
  std::map<std::string, float> scalars;
  std::map<std::string, Histogram> hists;
  for (const auto& e : fs::directory_iterator(dir / "tensorboard")) {
    auto recs = read_records(slurp(e.path()));
    ASSERT_TRUE(recs.ok());
    for (const auto& r : *recs) {
      auto ev = decode_event(r);
      ASSERT_TRUE(ev.ok());
      for (auto& [k, v] : ev->scalars) scalars[k] = v;
      for (auto& [k, v] : ev->histograms) hists[k] = v;
    }
  }
  EXPECT_FLOAT_EQ(scalars.at("train/loss"), 4.5f);
  EXPECT_FLOAT_EQ(scalars.at("train/tokens_per_s"), 1000.0f);
  EXPECT_FLOAT_EQ(scalars.at("train/comm_by_kind_ms/all_to_all"), 2.0f);
  EXPECT_FLOAT_EQ(scalars.at("moe/load_max_over_mean/layer_0"), 30.0f / 20.0f);
  EXPECT_FLOAT_EQ(scalars.at("moe/load_max_over_mean/layer_1"), 45.0f / 15.0f);
  EXPECT_EQ(hists.at("moe/expert_load/layer_1").num, 4);
  EXPECT_EQ(hists.at("moe/expert_load/layer_1").max, 45);
  EXPECT_FLOAT_EQ(scalars.at("elastic/steps_lost"), 2.0f);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace troupe::observe
