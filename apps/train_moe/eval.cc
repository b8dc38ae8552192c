// apps/train_moe/eval.cc — `train_moe eval`: the model of a checkpoint (any layout) or of a
// Hugging Face directory, run on given token rows in one process on the CPU: prints the
// loss of predicting each next token (transformers' labels = input_ids) and writes the
// logits of every position. The rows and the logits are NumPy .npy files, so a script can
// compare them with another implementation's (tests/interop/check_transformers.py).
#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "apps/train_moe/commands.h"
#include "apps/train_moe/model_state.h"
#include "interop/hf_checkpoint.h"
#include "layers/model.h"
#include "training/checkpointing/checkpointing.h"

namespace troupe::train_moe {

namespace {

// A 2-d integer .npy file (little-endian int32 or int64, C order) as i32 rows.
Result<std::vector<int32_t>> read_npy_ints(const std::string& path, int64_t& rows, int64_t& cols) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("eval: cannot open {}", path);
  char magic[8];
  f.read(magic, 8);
  if (!f || std::memcmp(magic, "\x93NUMPY", 6) != 0) return data_loss("eval: {} is not a .npy file", path);
  uint32_t hlen = 0;
  if (magic[6] == 1) {
    uint16_t h = 0;
    f.read(reinterpret_cast<char*>(&h), 2);
    hlen = h;
  } else {
    f.read(reinterpret_cast<char*>(&hlen), 4);
  }
  std::string header(hlen, '\0');
  f.read(header.data(), hlen);
  if (!f) return data_loss("eval: {}: truncated header", path);
  const bool i8 = header.find("'<i8'") != std::string::npos, i4 = header.find("'<i4'") != std::string::npos;
  if ((!i8 && !i4) || header.find("'fortran_order': False") == std::string::npos) {
    return invalid_argument("eval: {}: tokens must be a C-order int32 or int64 array (header {})", path,
                            header);
  }
  const size_t lp = header.find("'shape': (");
  if (lp == std::string::npos) return data_loss("eval: {}: no shape in the header", path);
  if (std::sscanf(header.c_str() + lp, "'shape': (%ld, %ld)", &rows, &cols) != 2 || rows < 1 || cols < 2) {
    return invalid_argument("eval: {}: tokens must be a 2-d array [rows, positions >= 2] ({})", path, header);
  }
  std::vector<int32_t> out(static_cast<size_t>(rows * cols));
  for (auto& v : out) {
    if (i8) {
      int64_t x = 0;
      f.read(reinterpret_cast<char*>(&x), 8);
      v = static_cast<int32_t>(x);
    } else {
      f.read(reinterpret_cast<char*>(&v), 4);
    }
  }
  if (!f) return data_loss("eval: {}: fewer values than its shape", path);
  return out;
}

Status write_npy_f32(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i)
    dims += fmt::format("{}{}", shape[i], shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}", dims);
  header.append(63 - (10 + header.size()) % 64, ' ');  // the data starts 64-byte aligned
  header += '\n';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return io_error("eval: cannot write {}", path);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t n = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&n), 2);
  f << header;
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(count * 4));
  if (!f) return io_error("eval: cannot write {}", path);
  return ok_status();
}

}  // namespace

Status run_eval(const EvalOptions& o) {
  if (o.tokens.empty()) return invalid_argument("eval: --tokens <rows.npy> is required");
  if (o.checkpoint.empty() == o.init_from.empty()) {
    return invalid_argument(
        "eval: give one of --checkpoint <run or checkpoint dir> and --init-from <HF directory>");
  }
  std::unique_ptr<layers::Model> model;
  std::string source;
  if (!o.checkpoint.empty()) {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                            training::open_resume_checkpoint(o.checkpoint, "eval"));
    TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, checkpoint_train_config(*reader));
    model = std::make_unique<layers::Model>(tc.model, 0);
    TROUPE_RETURN_IF_ERROR(load_model_weights(*reader, *model).with_context("eval"));
    source = fmt::format("checkpoint {} (step {}, layout {})", reader->path(), reader->step(),
                         reader->layout().to_string());
  } else {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<interop::HfCheckpoint> hf,
                            interop::HfCheckpoint::open(o.init_from));
    model = std::make_unique<layers::Model>(hf->config().model, 0);
    TROUPE_RETURN_IF_ERROR(interop::load_hf_weights(*hf, *model).with_context("eval"));
    source = fmt::format("{} ({})", o.init_from, interop::family_name(hf->config().family));
  }
  int64_t rows = 0, cols = 0;
  TROUPE_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, read_npy_ints(o.tokens, rows, cols));
  const int64_t vocab = model->config().vocab_size;
  for (int32_t t : tokens) {
    if (t < 0 || t >= vocab)
      return invalid_argument("eval: token {} is outside the model's vocabulary [0, {})", t, vocab);
  }
  const layers::Ctx c = layers::Ctx::cpu();

  // The loss: position t predicts token t + 1.
  std::vector<int32_t> ids, targets;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t + 1 < cols; ++t) {
      ids.push_back(tokens[static_cast<size_t>(r * cols + t)]);
      targets.push_back(tokens[static_cast<size_t>(r * cols + t + 1)]);
    }
  }
  int64_t n = 0;
  const double sum = model->eval_loss_sum(c, Tensor::from_ints({rows, cols - 1}, ids),
                                          Tensor::from_ints({rows, cols - 1}, targets), n);
  fmt::print("eval: {} rows of {} tokens, {} predictions: loss {:.7f} (model from {})\n", rows, cols, n,
             sum / static_cast<double>(n), source);
  if (!o.logits.empty()) {
    // Every position's logits: the blocks over the whole rows, then the head.
    const Tensor all = Tensor::from_ints({rows * cols}, tokens);
    Tensor x = model->embedding.forward(c, all);
    for (auto& b : model->blocks) {
      layers::Block::Saved saved;
      x = b->forward(c, x, rows, cols, saved, nullptr);
    }
    const Tensor lg = model->head->logits(c, x).contiguous();
    TROUPE_RETURN_IF_ERROR(write_npy_f32(o.logits, {rows, cols, vocab}, lg.data<float>()));
    fmt::print("eval: logits [{}, {}, {}] written to {}\n", rows, cols, vocab, o.logits);
  }
  return ok_status();
}

}  // namespace troupe::train_moe
