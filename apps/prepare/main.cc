// apps/prepare/main.cc — troupe-prepare: makes the token data a training app reads
// (data.dir) from text files, without building any app:
//   troupe-prepare --input corpus/ --ext .txt .md --out runs/data/demo --vocab 1024
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "apps/prepare/prepare.h"

int main(int argc, char** argv) {
  CLI::App cli{
      "troupe-prepare: tokenize a text corpus into the train/val token shards and tokenizer of a data.dir"};
  troupe::prepare::PrepareOptions o;
  troupe::prepare::add_prepare_options(cli, o);
  CLI11_PARSE(cli, argc, argv);
  const troupe::Status st = troupe::prepare::prepare_corpus(o);
  if (!st.ok()) {
    fmt::print(stderr, "troupe-prepare: error: {}\n", st.to_string());
    return 1;
  }
  return 0;
}
