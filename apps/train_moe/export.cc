// apps/train_moe/export.cc — `train_moe export --format hf`: a run's newest valid
// checkpoint (any layout) as a Hugging Face model directory that transformers and serving
// engines load: config.json, generation_config.json, model-0000k-of-0000n.safetensors,
// model.safetensors.index.json, tokenizer.json and tokenizer_config.json. The weights are
// streamed (interop::export_hf): one stored slice at a time per thread, never the model.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/prepare/corpus.h"
#include "apps/train_moe/commands.h"
#include "apps/train_moe/model_state.h"
#include "checkpoint/file_io.h"
#include "data/tokenizer.h"
#include "interop/hf_checkpoint.h"
#include "training/checkpointing/checkpointing.h"

namespace troupe::train_moe {

using prepare::ProgressLine;  // the progress line troupe-prepare prints

namespace fs = std::filesystem;

namespace {

// "5GB", "500MB", "2GiB", "123456" -> bytes.
Result<uint64_t> parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    return invalid_argument("export: --max-shard-size '{}' is not a size (e.g. 5GB)", s);
  }
  const std::string unit = s.substr(used);
  double mult = 1;
  if (unit == "" || unit == "B") {
    mult = 1;
  } else if (unit == "KB") {
    mult = 1e3;
  } else if (unit == "MB") {
    mult = 1e6;
  } else if (unit == "GB") {
    mult = 1e9;
  } else if (unit == "KiB") {
    mult = 1024.0;
  } else if (unit == "MiB") {
    mult = 1024.0 * 1024;
  } else if (unit == "GiB") {
    mult = 1024.0 * 1024 * 1024;
  } else {
    return invalid_argument("export: --max-shard-size '{}': unknown unit '{}' (B, KB, MB, GB, KiB, MiB, GiB)",
                            s, unit);
  }
  if (!(v > 0)) return invalid_argument("export: --max-shard-size must be positive");
  return static_cast<uint64_t>(v * mult);
}

}  // namespace

Status run_export(const ExportOptions& o) {
  if (o.format != "hf") return invalid_argument("export: --format '{}' is not supported (hf)", o.format);
  if (o.out.empty()) return invalid_argument("export: --out is required");
  if (o.run.empty() && o.checkpoint.empty())
    return invalid_argument("export: give --run <run dir> or --checkpoint <dir>");
  TROUPE_ASSIGN_OR_RETURN(interop::HfFamily family, interop::parse_family(o.family));
  DType dtype = DType::kBF16;
  if (o.dtype == "f32" || o.dtype == "float32") {
    dtype = DType::kF32;
  } else if (o.dtype != "bf16" && o.dtype != "bfloat16") {
    return invalid_argument("export: --dtype must be bf16 or f32 (got '{}')", o.dtype);
  }
  TROUPE_ASSIGN_OR_RETURN(uint64_t shard, parse_size(o.max_shard_size));
  if (o.threads < 1) return invalid_argument("export: --threads must be >= 1");

  const std::string from = o.checkpoint.empty() ? o.run : o.checkpoint;
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                          training::open_resume_checkpoint(from, "export"));
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, checkpoint_train_config(*reader));
  // Refused here, before anything is written, when the family cannot express the model.
  TROUPE_RETURN_IF_ERROR(interop::hf_config_for(tc.model, family, dtype).status());
  if (tc.model.moe.capacity_factor > 0) {
    fmt::print("export: note: the run dropped tokens beyond capacity factor {}; {} routes without drops\n",
               tc.model.moe.capacity_factor, interop::family_name(family));
  }
  if (fs::exists(o.out) && !fs::is_directory(o.out))
    return invalid_argument("export: {} is not a directory", o.out);
  TROUPE_RETURN_IF_ERROR(checkpoint::make_dirs(o.out));

  // The tokenizer the run trained with (the checkpoint's checked copy, already in the
  // Hugging Face format), and the end-of-text id config.json names as eos.
  std::optional<int64_t> eos;
  std::string eos_text;
  if (reader->manifest().tokenizer) {
    const std::string tok_path = o.out + "/tokenizer.json";
    TROUPE_RETURN_IF_ERROR(reader->extract_tokenizer(tok_path));
    Result<layers::Tokenizer> tok = layers::Tokenizer::load(tok_path);
    if (tok.ok() && tok->eot()) {
      eos = *tok->eot();
      eos_text = tok->token_bytes(*tok->eot());
    } else if (!tok.ok()) {
      fmt::print("export: note: the run's tokenizer is not a Hugging Face one ({}); copied as it is\n",
                 tok.status().to_string());
    }
    nlohmann::json tc_json{{"tokenizer_class", "PreTrainedTokenizerFast"},
                           {"model_max_length", tc.train.seq_len},
                           {"clean_up_tokenization_spaces", false}};
    if (!eos_text.empty()) tc_json["eos_token"] = eos_text;
    TROUPE_RETURN_IF_ERROR(
        checkpoint::write_file_durably(o.out + "/tokenizer_config.json", tc_json.dump(2) + "\n"));
  } else {
    fmt::print("export: note: checkpoint {} holds no tokenizer; add tokenizer.json yourself\n",
               reader->path());
  }

  interop::ExportOptions eo;
  eo.family = family;
  eo.dtype = dtype;
  eo.max_shard_bytes = shard;
  eo.threads = o.threads;
  // At least the trained length (RoPE runs longer; a server reads this as its context limit).
  eo.max_position_embeddings = std::max<int64_t>(tc.train.seq_len, 4096);
  eo.eos_token_id = eos;
  fmt::print("export: {} (step {}, saved with layout {}) -> {} as {} in {}\n", reader->path(), reader->step(),
             reader->layout().to_string(), o.out, interop::family_name(family), dtype_name(dtype));
  std::fflush(stdout);
  ProgressLine bar("export", 0);
  bool sized = false;
  eo.progress = [&](uint64_t done, uint64_t total) {
    if (!sized) {
      bar = ProgressLine("export", total);
      sized = true;
    }
    bar.update(done, -1);
  };
  TROUPE_ASSIGN_OR_RETURN(interop::ExportSummary s, interop::export_hf(*reader, tc.model, o.out, eo));
  bar.finish(s.bytes, -1);
  fmt::print(
      "export: wrote {} tensors ({:.2f} MB of {}) in {} file(s), config.json ({}), tokenizer{} to {}\n",
      s.tensors, static_cast<double>(s.bytes) / 1e6, dtype_name(dtype), s.files, interop::family_name(family),
      reader->manifest().tokenizer ? "" : " (none)", o.out);
  return ok_status();
}

}  // namespace troupe::train_moe
