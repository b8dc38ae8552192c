// apps/prepare/prepare.h — defines prepare_corpus: a text corpus (files or directories) ->
// a byte-level BPE tokenizer trained on it (tokenizer.json) and its tokens in train and
// validation shards (layers/token_data.h), the data.dir every training app reads. The
// troupe-prepare tool (main.cc) and `train_moe prepare` are this function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace CLI {
class App;
}

namespace troupe::prepare {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or directories
  std::string out;                  // output directory
  int64_t vocab = 1024;
  int64_t max_bytes = 8'000'000;  // corpus cap (whole files, in path order)
  double val_fraction = 0.05;
  std::vector<std::string> extensions = {".py", ".txt", ".md", ".rst"};  // for directory walks
  int64_t shard_tokens = 16'000'000;
};

// --input, --out, --vocab, --max-bytes, --val-fraction, --ext, --shard-tokens.
void add_prepare_options(CLI::App& cli, PrepareOptions& o);

Status prepare_corpus(const PrepareOptions& o);

}  // namespace troupe::prepare
