// apps/prepare/corpus.h — defines Corpus, the documents troupe-prepare (and `train_moe prepare`) reads, as a
// stream: text files (each file one document) and JSON-lines files (each line a record
// whose text is under a key, "text" by default), either kind plain, gzip (.gz) or
// Zstandard (.zst) compressed. Memory stays constant whatever the corpus size: files are
// decompressed and split into lines through fixed buffers, one document at a time.
//
// A JSON-lines record that is not a JSON object with a string under the key is skipped
// and counted, and the first few are named (file:line: reason); with `strict` the first
// one is an error instead. Text files holding NUL bytes (binaries) are skipped and
// counted.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace troupe::prepare {

struct CorpusOptions {
  std::vector<std::string> inputs;      // files or directories
  std::vector<std::string> extensions;  // taken from directories (name endings: ".txt", ".jsonl.zst")
  std::string text_key = "text";        // the field of a JSON-lines record holding its text
  bool strict = false;                  // a malformed record is an error, not skipped
  int64_t max_bytes = 0;                // stop after the document that passes this much text (0: no cap)
};

// What a pass over the corpus saw.
struct CorpusStats {
  int64_t documents = 0;
  int64_t bytes = 0;                            // of document text
  int64_t malformed = 0;                        // JSON-lines records skipped
  int64_t skipped_files = 0;                    // unreadable or binary files
  std::vector<std::string> malformed_examples;  // "file:line: reason", the first few
};

class Corpus {
 public:
  // Lists the input files (directories walked in name order, files as given); NotFound
  // naming an input that does not exist, or when nothing is left.
  static Result<Corpus> open(const CorpusOptions& o);

  const std::vector<std::string>& files() const { return files_; }
  // Bytes of the input files as stored (compressed where they are): progress's total.
  uint64_t stored_bytes() const { return stored_bytes_; }
  // Whether `path` is read as JSON lines (.jsonl / .ndjson, optionally .gz / .zst).
  static bool is_jsonl(const std::string& path);

  // Calls `doc` with each document's text, in order; `progress` (stored bytes consumed,
  // documents so far) after each file and every few MB. Stops at the first error (a
  // malformed record with strict, an I/O or decompression error, or `doc`'s own).
  Result<CorpusStats> for_each(const std::function<Status(std::string_view)>& doc,
                               const std::function<void(uint64_t, int64_t)>& progress = {}) const;

 private:
  CorpusOptions o_;
  std::vector<std::string> files_;
  uint64_t stored_bytes_ = 0;
};

// A progress line for long passes: on a terminal one line redrawn in place (a bar, the
// percentage, bytes, documents, rate and time left), elsewhere a line every 10 s.
class ProgressLine {
 public:
  ProgressLine(std::string what, uint64_t total);
  // documents < 0: not shown (a pass that is not over documents).
  void update(uint64_t done, int64_t documents);
  void finish(uint64_t done, int64_t documents);

 private:
  std::string what_;
  uint64_t total_;
  bool tty_;
  double start_, last_ = -1;
  uint64_t printed_ = UINT64_MAX;  // `done` of the last line printed
};

}  // namespace troupe::prepare
