// interop/hf_checkpoint.h — defines HfCheckpoint, a Hugging Face model directory opened
// for import (config.json + model.safetensors, or model.safetensors.index.json and its
// shards), which hands out any box of any Troupe tensor by reading only the bytes of that
// box (the files are memory-mapped: a rank touches the pages of its own slices), and
// export_hf, which writes such a directory from a Troupe checkpoint of any layout.
//
// Export streams: each stored slice of the checkpoint (one rank's part of one tensor) is
// read once, turned into the HF tensors' bytes it covers (transposed where the layouts
// differ, rounded to bf16 when asked) and written at their offsets with pwrite; the
// files' headers are planned first, so no process ever holds more than one stored slice
// and its HF image per thread, whatever the model's size.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/reader.h"
#include "interop/hf_model.h"
#include "interop/safetensors.h"
#include "layers/model.h"

namespace troupe::interop {

class HfCheckpoint {
 public:
  // Opens `dir`: parses config.json (refusing what Troupe cannot express) and the
  // safetensors headers. Nothing else is read.
  static Result<std::unique_ptr<HfCheckpoint>> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const HfModelConfig& config() const { return config_; }
  // Whether the experts are stored fused (gate_up_proj / down_proj) rather than per expert.
  bool fused_experts() const { return fused_; }

  // Checks, from the headers only, that `m` (the training run's model) is the checkpoint's
  // architecture and that the files hold every tensor it needs with the expected shape and
  // a weights dtype (F32, BF16, F16), and nothing Troupe's model would drop (a bias, an
  // extra norm): each problem is named.
  Status validate(const layers::ModelConfig& m) const;

  // Fills `dst` (host, contiguous, f32, shape slice_shape(box)) with the elements `box` of
  // Troupe's global tensor `name` (global shape `global`), converted from the file's dtype.
  Status read(const std::string& name, const Shape& global, const checkpoint::Slice& box, Tensor& dst) const;
  // Bytes of the files read so far (every element copied counts its stored size).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  HfCheckpoint() = default;
  struct Loc {
    const SafetensorsFile* file = nullptr;
    const StTensorInfo* info = nullptr;
  };
  Result<Loc> find(const std::string& hf_name) const;

  std::string dir_;
  HfModelConfig config_;
  bool fused_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Loc> tensors_;
  mutable std::atomic<uint64_t> bytes_read_{0};
};

// Reads every parameter of `model` (a host model whose config is the checkpoint's
// architecture) from `ckpt`: one process holding the whole model (evaluation, tests).
Status load_hf_weights(const HfCheckpoint& ckpt, layers::Model& model);

// True when every architecture key of the two configs is equal; else the first that
// differs, named, in `why`.
bool same_architecture(const layers::ModelConfig& a, const layers::ModelConfig& b, std::string* why);

struct ExportOptions {
  HfFamily family = HfFamily::kMixtral;
  DType dtype = DType::kBF16;                            // of the weights written: bf16 or f32
  uint64_t max_shard_bytes = 5ull * 1000 * 1000 * 1000;  // per model-0000k-of-0000n file
  int threads = 2;                                       // stored slices converted at a time
  int64_t max_position_embeddings = 0;                   // config.json's; 0: 4096
  std::optional<int64_t> bos_token_id, eos_token_id;
  // Called after each stored slice is written: bytes of weights written, of all.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct ExportSummary {
  int64_t tensors = 0;  // HF tensors written
  int64_t files = 0;    // safetensors files
  uint64_t bytes = 0;   // weights bytes
};

// Writes `out_dir` (created; files of an earlier export there are replaced): config.json,
// generation_config.json, model-0000k-of-0000n.safetensors and
// model.safetensors.index.json, from checkpoint `reader` of a model of config `m`. The
// weights files are written under a temporary name and renamed when complete, config.json
// last. The caller adds the tokenizer files.
Result<ExportSummary> export_hf(const checkpoint::CheckpointReader& reader, const layers::ModelConfig& m,
                                const std::string& out_dir, const ExportOptions& o);

}  // namespace troupe::interop
