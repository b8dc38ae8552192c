// apps/prepare/prepare.h — defines prepare_corpus: a corpus (text files, JSON lines, plain
// or compressed; apps/prepare/corpus.h) -> its tokens in train and validation shards
// (data/token_data.h) with a Hugging Face tokenizer.json or a byte-level BPE trained on
// it, and that tokenizer.json beside them: the data.dir every training app reads. The
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
  std::vector<std::string> inputs;  // files or directories: text, or JSON lines (.jsonl[.gz|.zst])
  std::string out;                  // output directory
  // A Hugging Face tokenizer.json to tokenize with; empty: train Troupe's own of `vocab`.
  std::string tokenizer;
  std::string eot_token;  // with `tokenizer`: the token ending each document (default: its eos)
  int64_t vocab = 1024;
  int64_t max_bytes = 8'000'000;  // corpus cap (stop after the document passing it; 0: none)
  double val_fraction = 0.05;
  // For directory walks (name endings).
  std::vector<std::string> extensions = {".py", ".txt", ".md", ".rst", ".jsonl", ".jsonl.gz", ".jsonl.zst"};
  std::string text_key = "text";  // JSON lines: the field holding a record's text
  bool strict = false;            // JSON lines: a malformed record is an error (default: skipped, counted)
  int64_t shard_tokens = 16'000'000;
};

// --input, --out, --tokenizer, --eot-token, --vocab, --text-key, --strict, --max-bytes,
// --val-fraction, --ext, --shard-tokens.
void add_prepare_options(CLI::App& cli, PrepareOptions& o);

Status prepare_corpus(const PrepareOptions& o);

}  // namespace troupe::prepare
