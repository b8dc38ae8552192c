// observe/tensorboard.h — defines TensorBoard event files without TensorFlow: TFRecord
// framing (crc32c, masked_crc32c, frame_record / read_records), the few Event/Summary
// protobuf messages a training run needs, encoded by hand (encode_scalar_event,
// encode_histogram_event, decode_event), and TensorBoardWriter, which appends them to
// <dir>/events.out.tfevents.<unix time>.<host>.<pid>.troupe.
//
// The wire formats are TensorFlow's (tensorflow/core/util/event.proto, summary.proto and
// tsl's record_writer): a record is
//   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data |
//   uint32 masked_crc32c(data)
// and masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. Only the fields used here are
// written; field numbers are the protos'. tensorboard's EventAccumulator reads the files.
//
// Threading: a TensorBoardWriter is used from one thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace troupe::observe {

// CRC-32C (Castagnoli), as TFRecord uses it; crc32c("123456789") == 0xe3069283.
uint32_t crc32c(std::string_view data);
uint32_t masked_crc32c(std::string_view data);

// One record with its framing.
std::string frame_record(std::string_view data);
// Every record of a file's bytes, checking both CRCs of each; a truncated or corrupt
// record is an error naming its offset.
Result<std::vector<std::string>> read_records(std::string_view bytes);

// A histogram as HistogramProto holds it: bucket i counts values in
// (bucket_limit[i-1], bucket_limit[i]].
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;
  std::vector<double> bucket;
  // `buckets` equal-width buckets over [min, max] of `values` (one bucket when all equal).
  static Histogram of(const std::vector<double>& values, int buckets = 16);
};

std::string encode_file_version_event(double wall_time);
std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string encode_histogram_event(double wall_time, int64_t step, const std::string& tag,
                                   const Histogram& h);

// What decode_event understands of an Event (for tests and tools).
struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::map<std::string, float> scalars;         // tag -> simple_value
  std::map<std::string, Histogram> histograms;  // tag -> histo
};
Result<DecodedEvent> decode_event(std::string_view bytes);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it (never appends to an older one:
  // TensorBoard reads every file of the directory in name order).
  static Result<std::unique_ptr<TensorBoardWriter>> open(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  Status scalar(int64_t step, const std::string& tag, double value, double wall_time);
  Status histogram(int64_t step, const std::string& tag, const Histogram& h, double wall_time);
  // Hands what was written to the kernel (TensorBoard polls the file).
  Status flush();
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  Status write(const std::string& event);
  std::FILE* f_;
  std::string path_;
};

}  // namespace troupe::observe
