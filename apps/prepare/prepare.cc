// apps/prepare/prepare.cc — prepare_corpus (troupe-prepare, `train_moe prepare`): stream
// the corpus (text files and JSON-lines, plain or compressed; apps/prepare/corpus.h), tokenize every document
// into train/validation shards with a Hugging Face tokenizer.json (--tokenizer) or one trained here on the
// training documents (a first pass), and write tokenizer.json and meta.json beside the shards. Memory stays
// constant in the corpus size: documents are read, tokenized and appended one at a time.
#include "apps/prepare/prepare.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/prepare/corpus.h"
#include "data/token_data.h"
#include "data/tokenizer.h"

namespace troupe::prepare {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void report_malformed(const CorpusStats& st) {
  if (st.malformed == 0) return;
  fmt::print("prepare: skipped {} malformed JSON-lines record(s) (--strict makes them an error), e.g.:\n",
             st.malformed);
  for (const auto& e : st.malformed_examples) fmt::print("  {}\n", e);
}

}  // namespace

void add_prepare_options(CLI::App& cli, PrepareOptions& o) {
  cli.add_option(
         "--input", o.inputs,
         "files or directories (repeatable): text files, or JSON lines (.jsonl, .jsonl.gz, .jsonl.zst)")
      ->required();
  cli.add_option("--out", o.out, "output directory")->required();
  cli.add_option(
      "--tokenizer", o.tokenizer,
      "a Hugging Face tokenizer.json (byte-level BPE: GPT-2, Llama 3, Qwen) instead of training one");
  cli.add_option("--eot-token", o.eot_token,
                 "with --tokenizer: the token ending each document (default: its eos_token)");
  cli.add_option("--vocab", o.vocab, "vocabulary size of a trained tokenizer (bytes + end-of-text + merges)");
  cli.add_option("--text-key", o.text_key, "JSON lines: the field holding each record's text");
  cli.add_flag("--strict", o.strict, "JSON lines: stop at a malformed record (default: skip and count it)");
  cli.add_option("--max-bytes", o.max_bytes, "stop after this many bytes of text (0: read everything)");
  cli.add_option("--val-fraction", o.val_fraction, "fraction of documents for validation");
  cli.add_option("--ext", o.extensions,
                 "file name endings taken from directories (e.g. .py .txt .jsonl.zst)");
  cli.add_option("--shard-tokens", o.shard_tokens, "tokens per shard file");
}

Status prepare_corpus(const PrepareOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.inputs.empty()) return invalid_argument("prepare: give at least one --input");
  if (o.out.empty()) return invalid_argument("prepare: --out is required");
  if (o.tokenizer.empty() && (o.vocab < 257 || o.vocab > (1 << 24))) {
    return invalid_argument("prepare: --vocab must be in [257, {}] (got {})", 1 << 24, o.vocab);
  }
  if (o.val_fraction < 0 || o.val_fraction >= 1) {
    return invalid_argument("prepare: --val-fraction must be in [0, 1) (got {})", o.val_fraction);
  }
  if (o.max_bytes < 0) return invalid_argument("prepare: --max-bytes must be >= 0 (0: no cap)");
  if (o.text_key.empty()) return invalid_argument("prepare: --text-key must not be empty");
  CorpusOptions co;
  co.inputs = o.inputs;
  co.extensions = o.extensions;
  co.text_key = o.text_key;
  co.strict = o.strict;
  co.max_bytes = o.max_bytes;
  TROUPE_ASSIGN_OR_RETURN(Corpus corpus, Corpus::open(co));
  fmt::print("prepare: {} input file(s), {:.2f} MB stored{}\n", corpus.files().size(),
             static_cast<double>(corpus.stored_bytes()) / 1e6,
             o.max_bytes > 0
                 ? fmt::format(" (reading at most {:.2f} MB of text: --max-bytes)", o.max_bytes / 1e6)
                 : "");

  // Every k-th document goes to validation (with a single document, its tail).
  const int64_t k = o.val_fraction > 0 ? std::max<int64_t>(2, std::llround(1.0 / o.val_fraction)) : 0;
  const auto is_val = [k](int64_t i) { return k > 0 && i % k == k - 1; };

  // ---- the tokenizer: given, or trained on the training documents (a first pass) --------
  layers::Tokenizer tok;
  if (!o.tokenizer.empty()) {
    TROUPE_ASSIGN_OR_RETURN(tok, layers::Tokenizer::load(o.tokenizer, o.eot_token));
    if (!tok.eot()) {
      return invalid_argument(
          "prepare: {} names no end-of-text token to separate documents with; give --eot-token "
          "(e.g. \"<|endoftext|>\")",
          o.tokenizer);
    }
    fmt::print("tokenizer: {} ({} tokens; documents end with '{}', id {})\n", o.tokenizer, tok.vocab_size(),
               tok.token_bytes(*tok.eot()), *tok.eot());
  } else {
    if (!o.eot_token.empty()) return invalid_argument("prepare: --eot-token goes with --tokenizer");
    layers::BpeTrainer trainer;
    ProgressLine bar("tokenizer: reading", corpus.stored_bytes());
    int64_t i = 0;
    TROUPE_ASSIGN_OR_RETURN(CorpusStats st,
                            corpus.for_each(
                                [&](std::string_view text) {
                                  if (!is_val(i++)) trainer.add_text(text);
                                  return ok_status();
                                },
                                [&](uint64_t done, int64_t docs) { bar.update(done, docs); }));
    bar.finish(corpus.stored_bytes(), st.documents);
    if (st.documents == 0) return not_found("prepare: no documents in {}", fmt::join(o.inputs, ", "));
    fmt::print("tokenizer: {} distinct pieces in {} documents; learning up to {} merges\n",
               trainer.unique_chunks(), st.documents, o.vocab - 257);
    std::fflush(stdout);
    int64_t last_print = 0;
    TROUPE_ASSIGN_OR_RETURN(tok, trainer.train(o.vocab, [&](int64_t done, int64_t total) {
      if (done - last_print >= 256 || done == total) {
        fmt::print("tokenizer: {}/{} tokens learned [{:.1f}s]\n", done, total, seconds_since(t0));
        std::fflush(stdout);
        last_print = done;
      }
    }));
    if (tok.vocab_size() < o.vocab) {
      fmt::print("tokenizer: the corpus supports only {} tokens (asked {})\n", tok.vocab_size(), o.vocab);
    }
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
  if (!o.tokenizer.empty()) {
    // Its eos_token and chat template travel with it (an export hands them on).
    const fs::path cfg = fs::path(o.tokenizer).parent_path() / "tokenizer_config.json";
    if (fs::exists(cfg))
      fs::copy_file(cfg, o.out + "/tokenizer_config.json", fs::copy_options::overwrite_existing, ec);
  }

  // ---- tokenize: one pass, one document at a time ------------------------------------
  const int32_t eot = *tok.eot();
  const int token_bytes = tok.vocab_size() <= 65536 ? 2 : 4;
  layers::ShardWriter train(o.out, "train", token_bytes, o.shard_tokens);
  layers::ShardWriter val(o.out, "val", token_bytes, o.shard_tokens);
  ProgressLine bar("tokenize", corpus.stored_bytes());
  int64_t i = 0;
  std::vector<int32_t> first;  // the first document's ids, held until a second one shows
  bool held = false;
  const auto append = [&](int64_t index, const std::vector<int32_t>& ids) {
    return (is_val(index) ? val : train).append(ids);
  };
  TROUPE_ASSIGN_OR_RETURN(CorpusStats st, corpus.for_each(
                                              [&](std::string_view text) -> Status {
                                                std::vector<int32_t> ids =
                                                    tok.encode(text, /*add_special_tokens=*/true);
                                                if (ids.empty() || ids.back() != eot) ids.push_back(eot);
                                                const int64_t index = i++;
                                                if (index == 0) {
                                                  first = std::move(ids);
                                                  held = true;
                                                  return ok_status();
                                                }
                                                if (held) {
                                                  TROUPE_RETURN_IF_ERROR(append(0, first));
                                                  held = false;
                                                  first.clear();
                                                }
                                                return append(index, ids);
                                              },
                                              [&](uint64_t done, int64_t docs) { bar.update(done, docs); }));
  bar.finish(corpus.stored_bytes(), st.documents);
  if (held) {  // the whole corpus is one document: its tail is the validation split
    const size_t cut =
        k > 0 ? first.size() - static_cast<size_t>(static_cast<double>(first.size()) * o.val_fraction)
              : first.size();
    TROUPE_RETURN_IF_ERROR(
        train.append(std::vector<int32_t>(first.begin(), first.begin() + static_cast<long>(cut))));
    TROUPE_RETURN_IF_ERROR(
        val.append(std::vector<int32_t>(first.begin() + static_cast<long>(cut), first.end())));
  }
  if (st.documents == 0) return not_found("prepare: no documents in {}", fmt::join(o.inputs, ", "));
  TROUPE_RETURN_IF_ERROR(train.finish());
  TROUPE_RETURN_IF_ERROR(val.finish());
  report_malformed(st);
  if (st.skipped_files > 0)
    fmt::print("prepare: skipped {} unreadable or binary file(s)\n", st.skipped_files);
  if (o.max_bytes > 0 && st.bytes >= o.max_bytes) {
    fmt::print("prepare: stopped at --max-bytes {} (0 reads everything)\n", o.max_bytes);
  }

  nlohmann::json meta;
  meta["vocab_size"] = tok.vocab_size();
  meta["token_bytes"] = token_bytes;
  meta["eot_id"] = eot;
  meta["tokenizer"] = o.tokenizer.empty() ? "trained" : o.tokenizer;
  meta["documents"] = st.documents;
  meta["bytes"] = st.bytes;
  meta["malformed_records"] = st.malformed;
  meta["skipped_files"] = st.skipped_files;
  meta["train_tokens"] = train.tokens();
  meta["val_tokens"] = val.tokens();
  meta["inputs"] = o.inputs;
  std::ofstream(o.out + "/meta.json") << meta.dump(2) << "\n";
  fmt::print(
      "prepare: wrote {} (vocab {}, {} documents, {} train tokens in {} shard(s), {} val tokens, {:.2f} "
      "bytes/token) [{:.1f}s]\n",
      o.out, tok.vocab_size(), st.documents, train.tokens(), train.files().size(), val.tokens(),
      static_cast<double>(st.bytes) /
          static_cast<double>(std::max<int64_t>(1, train.tokens() + val.tokens())),
      seconds_since(t0));
  if (val.tokens() == 0) fmt::print("prepare: warning: no validation tokens (--val-fraction 0)\n");
  return ok_status();
}

}  // namespace troupe::prepare
