// apps/train_moe/sample.cc — `train_moe sample`: rebuild the model from a run's weights
// and tokenizer, then generate with temperature and top-k sampling (no KV cache: each new
// token re-runs the window of the last seq_len tokens, fine at demo sizes).
//
// The weights are a checkpoint's (every training run saves its last step:
// checkpoint.final): --run <run dir> or --checkpoint <run dir | checkpoints dir | step_<N>
// dir> takes the newest checkpoint whose checksums verify (as --resume picks it; a damaged
// one is named and skipped), resharded from its layout into the one-process model. The
// model config comes from the checkpoint's manifest (config text + overrides); the
// tokenizer from the checkpoint's verified copy, else <run>/tokenizer.json.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>

#include "apps/train_moe/commands.h"
#include "apps/train_moe/model_state.h"
#include "core/config.h"
#include "data/tokenizer.h"
#include "layers/model.h"
#include "training/checkpointing/checkpointing.h"
#include "training/run_config.h"

namespace troupe::train_moe {

namespace {

namespace fs = std::filesystem;

struct SampleModel {
  std::unique_ptr<layers::Model> model;
  layers::Tokenizer tok;
  int64_t seq_len = 0;
  std::string source;  // "checkpoint <dir> (step N, layout ...)"
};

// The tokenizer a checkpoint holds (checksum verified), through a temporary file.
Result<layers::Tokenizer> checkpoint_tokenizer(const checkpoint::CheckpointReader& reader) {
  std::string tmp = (fs::temp_directory_path() / "troupe-sample-tokenizer-XXXXXX").string();
  const int fd = mkstemp(tmp.data());
  if (fd < 0) return io_error("sample: cannot create a temporary file in {}", fs::temp_directory_path().string());
  close(fd);
  Status st = reader.extract_tokenizer(tmp);
  Result<layers::Tokenizer> tok = st.ok() ? layers::Tokenizer::load(tmp) : Result<layers::Tokenizer>(st);
  std::error_code ec;
  fs::remove(tmp, ec);
  return tok;
}

Result<SampleModel> from_checkpoint(const std::string& path, const std::string& run) {
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                          training::open_resume_checkpoint(path, "sample"));
  const checkpoint::Manifest& m = reader->manifest();
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, checkpoint_train_config(*reader));
  SampleModel s;
  if (m.tokenizer) {
    TROUPE_ASSIGN_OR_RETURN(s.tok, checkpoint_tokenizer(*reader));
  } else if (!run.empty() && fs::exists(run + "/tokenizer.json")) {
    TROUPE_ASSIGN_OR_RETURN(s.tok, layers::Tokenizer::load(run + "/tokenizer.json"));
  } else {
    return not_found("sample: checkpoint {} holds no tokenizer and no run directory with tokenizer.json was given",
                     reader->path());
  }
  s.model = std::make_unique<layers::Model>(tc.model, 0);
  TROUPE_RETURN_IF_ERROR(load_model_weights(*reader, *s.model).with_context("sample"));
  s.seq_len = tc.train.seq_len;
  s.source = fmt::format("checkpoint {} (step {}, saved with layout {})", reader->path(), reader->step(),
                         reader->layout().to_string());
  return s;
}

Result<SampleModel> load_sample_model(const SampleOptions& o) {
  if (!o.checkpoint.empty()) return from_checkpoint(o.checkpoint, o.run);
  if (o.run.empty()) return invalid_argument("sample: give --run <run dir> or --checkpoint <dir>");
  if (!fs::is_directory(o.run)) return not_found("sample: run directory {} does not exist", o.run);
  std::error_code ec;
  const fs::path p(o.run);
  const bool has_ckpt = fs::is_directory(p / "checkpoints", ec) ||
                        fs::exists(p / checkpoint::kManifestFile, ec) ||
                        !checkpoint::list_checkpoints(o.run).empty();
  if (!has_ckpt) {
    return not_found(
        "sample: {} holds no checkpoint (looked for {}/checkpoints/step_<N> and {}/step_<N>; a run "
        "saves its last step unless checkpoint.final = false); give --checkpoint <dir> when the run "
        "saved its checkpoints elsewhere",
        o.run, o.run, o.run);
  }
  Result<SampleModel> r = from_checkpoint(o.run, o.run);
  if (!r.ok()) return r.status().with_context(fmt::format("sample: {} has no usable checkpoint", o.run));
  return r;
}

}  // namespace

Status run_sample(const SampleOptions& o) {
  if (o.temperature < 0) return invalid_argument("sample: --temperature must be >= 0");
  if (o.tokens < 0) return invalid_argument("sample: --tokens must be >= 0");
  TROUPE_ASSIGN_OR_RETURN(SampleModel sm, load_sample_model(o));
  layers::Model& model = *sm.model;
  layers::Tokenizer& tok = sm.tok;

  // As prepare encoded documents: with the tokenizer's template (e.g. a BOS token).
  std::vector<int32_t> ids = tok.encode(o.prompt, /*add_special_tokens=*/true);
  if (ids.empty() && tok.eot()) ids.push_back(*tok.eot());  // the start of a document
  const size_t prompt_len = ids.size();
  std::mt19937_64 rng(o.seed);
  const layers::Ctx c = layers::Ctx::cpu();
  const int64_t window = std::max<int64_t>(1, sm.seq_len);
  for (int64_t n = 0; n < o.tokens; ++n) {
    const int64_t len = std::min<int64_t>(window, static_cast<int64_t>(ids.size()));
    std::vector<int32_t> ctx(ids.end() - len, ids.end());
    std::vector<float> logits = model.last_logits(c, Tensor::from_ints({1, len}, ctx));
    logits.resize(static_cast<size_t>(tok.vocab_size()));  // rows beyond the tokenizer are never sampled
    int32_t next = 0;
    if (o.temperature == 0) {
      next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      std::vector<int32_t> order(logits.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
      const size_t k = o.top_k > 0 ? std::min<size_t>(static_cast<size_t>(o.top_k), order.size()) : order.size();
      std::partial_sort(order.begin(), order.begin() + static_cast<long>(k), order.end(),
                        [&](int32_t a, int32_t b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
      std::vector<double> w(k);
      const double mx = logits[static_cast<size_t>(order[0])];
      for (size_t i = 0; i < k; ++i) w[i] = std::exp((logits[static_cast<size_t>(order[i])] - mx) / o.temperature);
      std::discrete_distribution<size_t> pick(w.begin(), w.end());
      next = order[pick(rng)];
    }
    if (tok.eot() && next == *tok.eot()) break;
    ids.push_back(next);
  }
  fmt::print("{}\n", tok.decode(ids));
  fmt::print("[sample: {} prompt tokens, {} generated, temperature {}, top-k {}, weights from {}]\n", prompt_len,
             ids.size() - prompt_len, o.temperature, o.top_k, sm.source);
  return ok_status();
}

}  // namespace troupe::train_moe
