// apps/train_moe/sample.cc — `train_moe sample`: rebuild the model from a run's weights
// and tokenizer, then generate with temperature and top-k sampling (no KV cache: each new
// token re-runs the window of the last seq_len tokens, fine at demo sizes).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "apps/train_moe/commands.h"
#include "apps/train_moe/weights_io.h"
#include "layers/model.h"
#include "layers/tokenizer.h"

namespace troupe::train_moe {

Status run_sample(const SampleOptions& o) {
  if (o.run.empty()) return invalid_argument("sample: --run is required");
  if (!std::filesystem::is_directory(o.run)) return not_found("sample: run directory {} does not exist", o.run);
  if (o.temperature < 0) return invalid_argument("sample: --temperature must be >= 0");
  if (o.tokens < 0) return invalid_argument("sample: --tokens must be >= 0");
  TROUPE_ASSIGN_OR_RETURN(layers::Tokenizer tok, layers::Tokenizer::load(o.run + "/tokenizer.json"));
  TROUPE_ASSIGN_OR_RETURN(WeightsInfo info, read_weights_info(o.run + "/model.bin"));
  layers::Model model(info.model, 0);
  TROUPE_RETURN_IF_ERROR(load_weights(o.run + "/model.bin", model));

  std::vector<int32_t> ids = tok.encode(o.prompt);
  if (ids.empty()) ids.push_back(layers::Tokenizer::kEot);  // start of a document
  const size_t prompt_len = ids.size();
  std::mt19937_64 rng(o.seed);
  const layers::Ctx c = layers::Ctx::cpu();
  const int64_t window = std::max<int64_t>(1, info.seq_len);
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
    if (next == layers::Tokenizer::kEot) break;
    ids.push_back(next);
  }
  fmt::print("{}\n", tok.decode(ids));
  fmt::print("[sample: {} prompt tokens, {} generated, temperature {}, top-k {}]\n", prompt_len,
             ids.size() - prompt_len, o.temperature, o.top_k);
  return ok_status();
}

}  // namespace troupe::train_moe
