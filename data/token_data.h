// data/token_data.h — defines the token shard file format, ShardWriter, TokenShards (a
// read-only, memory-mapped view of one split's shards as one token stream) and
// DataLoader, which draws training sequences deterministically.
//
// Shard file "<split>-NNNNN.bin": a 24-byte header — magic "TRPTOKS1", u32 version (1),
// u32 bytes per token (2 or 4), u64 token count — then the tokens, little-endian.
// Documents are separated by the tokenizer's end-of-text token (Tokenizer::eot()).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace troupe::layers {

class ShardWriter {
 public:
  // Writes <dir>/<split>-00000.bin, -00001.bin, ... of at most shard_tokens tokens each.
  ShardWriter(std::string dir, std::string split, int token_bytes, int64_t shard_tokens);
  ~ShardWriter();
  Status append(const std::vector<int32_t>& tokens);
  Status finish();  // flushes the last shard
  int64_t tokens() const { return total_ + static_cast<int64_t>(buf_.size()); }
  const std::vector<std::string>& files() const { return files_; }

 private:
  Status flush();
  std::string dir_, split_;
  int token_bytes_;
  int64_t shard_tokens_, total_ = 0;
  std::vector<int32_t> buf_;
  std::vector<std::string> files_;
};

class TokenShards {
 public:
  // Opens every "<split>-*.bin" of dir in name order. NotFound when there is none.
  static Result<TokenShards> open(const std::string& dir, const std::string& split);
  TokenShards(TokenShards&&) noexcept;
  TokenShards& operator=(TokenShards&&) noexcept;
  ~TokenShards();

  int64_t size() const { return total_; }
  // Copies tokens [start, start + n) of the stream (across shards) to out.
  void read(int64_t start, int64_t n, int32_t* out) const;
  // Reads every token once: DataLoss naming the shard file, the position and the id when
  // one is not in [0, vocab) (the model's embedding has no row for it). A scan at memory
  // speed (about a second per 5 GB of 2-byte tokens): run it once, before work starts.
  Status check_token_ids(int64_t vocab) const;

 private:
  TokenShards() = default;
  struct Shard;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<int64_t> begin_;  // first stream index of each shard
  int64_t total_ = 0;
};

// Training batches. Sample `j` of step `s` (j in [0, global batch)) is the window of
// seq_len + 1 tokens (inputs and shifted targets) starting at
//     sequence_start(s, j) = mix64(seed ^ mix64(s * 0x9e3779b97f4a7c15 ^ mix64(j + 0x632be59bd9b4e019)))
//                            mod (N - seq_len)
// over the N tokens of the train split (mix64 = splitmix64, layers/parameter.h), whatever
// the parallel layout: data-parallel rank r, micro-batch m
// and row i of a layout with `grad_accum` micro-batches of `micro_batch` rows per rank
// read sample j = (r * grad_accum + m) * micro_batch + i. So a resumed run (same step)
// sees the same data, and a rescaled run with the same global batch sees the same
// samples in each step.
class DataLoader {
 public:
  DataLoader(const TokenShards& data, uint64_t seed, int64_t seq_len);
  int64_t sequence_start(int64_t step, int64_t sample) const;
  // ids and targets i32 [micro_batch, seq_len]; targets are ids shifted by one.
  void train_batch(int64_t step, int64_t dp_rank, int64_t micro, int64_t grad_accum, int64_t micro_batch,
                   Tensor& ids, Tensor& targets) const;
  // The k-th of `total` validation micro-batches: windows spread evenly over the stream,
  // the same in every run.
  void eval_batch(int64_t k, int64_t total, int64_t micro_batch, Tensor& ids, Tensor& targets) const;

 private:
  void window(int64_t start, int64_t row, Tensor& ids, Tensor& targets) const;
  const TokenShards& data_;
  uint64_t seed_;
  int64_t seq_len_;
};

}  // namespace troupe::layers
