// apps/prepare/prepare.cc — prepare_corpus (troupe-prepare, `train_moe prepare`): walk
// the inputs, train the byte-level BPE on the training documents, tokenize every document
// into train/validation shards, and write tokenizer.json and meta.json beside them.
#include "apps/prepare/prepare.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "layers/token_data.h"
#include "layers/tokenizer.h"

namespace troupe::prepare {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Result<std::vector<std::string>> list_files(const PrepareOptions& o) {
  std::vector<std::string> files;
  for (const auto& in : o.inputs) {
    std::error_code ec;
    if (fs::is_regular_file(in, ec)) {
      files.push_back(in);
    } else if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(in, fs::directory_options::skip_permission_denied, ec);
           it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (ec) break;
        if (!it->is_regular_file(ec)) continue;
        const std::string ext = it->path().extension().string();
        if (std::find(o.extensions.begin(), o.extensions.end(), ext) != o.extensions.end()) {
          found.push_back(it->path().string());
        }
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      return not_found("prepare: input {} does not exist", in);
    }
  }
  return files;
}

}  // namespace

void add_prepare_options(CLI::App& cli, PrepareOptions& o) {
  cli.add_option("--input", o.inputs, "files or directories (repeatable)")->required();
  cli.add_option("--out", o.out, "output directory")->required();
  cli.add_option("--vocab", o.vocab, "vocabulary size (bytes + end-of-text + merges)");
  cli.add_option("--max-bytes", o.max_bytes, "stop reading files after this many bytes");
  cli.add_option("--val-fraction", o.val_fraction, "fraction of documents for validation");
  cli.add_option("--ext", o.extensions, "file extensions taken from directories (e.g. .py .txt)");
  cli.add_option("--shard-tokens", o.shard_tokens, "tokens per shard file");
}

Status prepare_corpus(const PrepareOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.inputs.empty()) return invalid_argument("prepare: give at least one --input");
  if (o.out.empty()) return invalid_argument("prepare: --out is required");
  if (o.vocab < layers::Tokenizer::kFirstMerge || o.vocab > (1 << 24)) {
    return invalid_argument("prepare: --vocab must be in [{}, {}] (got {})", layers::Tokenizer::kFirstMerge,
                            1 << 24, o.vocab);
  }
  if (o.val_fraction < 0 || o.val_fraction >= 1) {
    return invalid_argument("prepare: --val-fraction must be in [0, 1) (got {})", o.val_fraction);
  }
  TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> files, list_files(o));

  // Read whole files in path order up to the byte cap; skip binary files (NUL bytes).
  std::vector<std::string> docs;
  int64_t bytes = 0, skipped = 0;
  for (const auto& path : files) {
    if (bytes >= o.max_bytes) break;
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      ++skipped;
      continue;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    std::string text = ss.str();
    if (text.empty() || text.find('\0') != std::string::npos) {
      ++skipped;
      continue;
    }
    bytes += static_cast<int64_t>(text.size());
    docs.push_back(std::move(text));
  }
  if (docs.empty()) {
    return not_found("prepare: no readable text files under {} (extensions {})", fmt::join(o.inputs, ", "),
                     fmt::join(o.extensions, " "));
  }
  fmt::print("prepare: {} documents, {:.2f} MB ({} files listed, {} skipped) [{:.1f}s]\n", docs.size(),
             static_cast<double>(bytes) / 1e6, files.size(), skipped, seconds_since(t0));

  // Every k-th document goes to validation; with a single document its tail does.
  const int64_t k = o.val_fraction > 0 ? std::max<int64_t>(2, std::llround(1.0 / o.val_fraction)) : 0;
  auto is_val = [&](size_t i) { return k > 0 && docs.size() > 1 && static_cast<int64_t>(i % k) == k - 1; };

  layers::BpeTrainer trainer;
  for (size_t i = 0; i < docs.size(); ++i)
    if (!is_val(i)) trainer.add_text(docs[i]);
  fmt::print("tokenizer: {} distinct chunks; learning {} merges\n", trainer.unique_chunks(),
             o.vocab - layers::Tokenizer::kFirstMerge);
  std::fflush(stdout);
  int64_t last_print = 0;
  TROUPE_ASSIGN_OR_RETURN(layers::Tokenizer tok, trainer.train(o.vocab, [&](int64_t done, int64_t total) {
    if (done - last_print >= 128 || done == total) {
      fmt::print("tokenizer: {}/{} merges [{:.1f}s]\n", done, total, seconds_since(t0));
      std::fflush(stdout);
      last_print = done;
    }
  }));
  if (tok.vocab_size() < o.vocab) {
    fmt::print("tokenizer: the corpus supports only {} tokens (asked {})\n", tok.vocab_size(), o.vocab);
  }

  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) return io_error("prepare: cannot create {}: {}", o.out, ec.message());
  for (const auto& e : fs::directory_iterator(o.out, ec)) {  // stale shards of an earlier run
    const std::string name = e.path().filename().string();
    if ((name.rfind("train-", 0) == 0 || name.rfind("val-", 0) == 0) && e.path().extension() == ".bin") {
      fs::remove(e.path(), ec);
    }
  }
  TROUPE_RETURN_IF_ERROR(tok.save(o.out + "/tokenizer.json"));

  const int token_bytes = tok.vocab_size() <= 65536 ? 2 : 4;
  layers::ShardWriter train(o.out, "train", token_bytes, o.shard_tokens);
  layers::ShardWriter val(o.out, "val", token_bytes, o.shard_tokens);
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int32_t> ids = tok.encode(docs[i]);
    ids.push_back(layers::Tokenizer::kEot);
    if (docs.size() == 1 && k > 0) {
      const size_t cut = ids.size() - static_cast<size_t>(static_cast<double>(ids.size()) * o.val_fraction);
      TROUPE_RETURN_IF_ERROR(
          train.append(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<long>(cut))));
      TROUPE_RETURN_IF_ERROR(
          val.append(std::vector<int32_t>(ids.begin() + static_cast<long>(cut), ids.end())));
    } else {
      TROUPE_RETURN_IF_ERROR((is_val(i) ? val : train).append(ids));
    }
    if ((i + 1) % 100 == 0 || i + 1 == docs.size()) {
      fmt::print("tokenize: {}/{} documents, {} train + {} val tokens so far [{:.1f}s]\n", i + 1, docs.size(),
                 train.tokens(), val.tokens(), seconds_since(t0));
      std::fflush(stdout);
    }
  }
  TROUPE_RETURN_IF_ERROR(train.finish());
  TROUPE_RETURN_IF_ERROR(val.finish());

  nlohmann::json meta;
  meta["vocab_size"] = tok.vocab_size();
  meta["token_bytes"] = token_bytes;
  meta["documents"] = docs.size();
  meta["bytes"] = bytes;
  meta["train_tokens"] = train.tokens();
  meta["val_tokens"] = val.tokens();
  meta["inputs"] = o.inputs;
  std::ofstream(o.out + "/meta.json") << meta.dump(2) << "\n";
  fmt::print(
      "prepare: wrote {} (vocab {}, {} train tokens in {} shard(s), {} val tokens, {:.2f} bytes/token) "
      "[{:.1f}s]\n",
      o.out, tok.vocab_size(), train.tokens(), train.files().size(), val.tokens(),
      static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(1, train.tokens() + val.tokens())),
      seconds_since(t0));
  if (val.tokens() == 0) fmt::print("prepare: warning: no validation tokens (--val-fraction 0)\n");
  return ok_status();
}

}  // namespace troupe::prepare
