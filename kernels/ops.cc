// kernels/ops.cc — the dispatcher of kernels/ops.h: checks every op's shapes, dtypes and
// devices (aborting with a message naming the op and all its tensors), picks the backend
// for ex.device and calls its entry. matmul_backward is composed here from matmul calls,
// so every backend gets it from its matmul.
#include "kernels/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/check.h"
#include "kernels/backend.h"

namespace troupe::kernels {
namespace {

// One op's argument checks. Holds the op's named tensors so that a failure message lists
// them all ("matmul: inner dimensions differ (4 vs 5); a f32[2, 4] cpu, b f32[5, 3] cpu, ...").
class OpCheck {
 public:
  using Named = std::pair<const char*, const Tensor*>;

  OpCheck(const char* op, const Exec& ex, std::initializer_list<Named> tensors) : op_(op), ex_(ex) {
    TROUPE_CHECK(tensors.size() <= kMaxTensors);
    for (const Named& n : tensors) tensors_[num_tensors_++] = n;
    if (ex.device.is_cuda() && cuda_backend() == nullptr) {
      detail::check_failed(
          __FILE__, __LINE__, "backend",
          fmt::format("op {} is not available on {} (this build has no CUDA backend)", op_, ex_.device));
    }
    for (size_t i = 0; i < num_tensors_; ++i) {
      const Named& n = tensors_[i];
      if (n.second == nullptr) continue;  // optional tensor not given
      const Tensor& t = *n.second;
      require(t.defined(), __LINE__, "{} is undefined", n.first);
      require(t.device() == ex.device, __LINE__, "{} is on {} but the op runs on {}", n.first, t.device(),
              ex.device);
      require(t.is_contiguous(), __LINE__, "{} is not contiguous", n.first);
    }
  }

  template <typename... Args>
  void require(bool cond, int line, fmt::format_string<Args...> f, Args&&... args) const {
    if (__builtin_expect(cond, 1)) return;
    std::string msg = fmt::format("op {}: {}", op_, fmt::format(f, std::forward<Args>(args)...));
    const char* sep = "; ";
    for (size_t i = 0; i < num_tensors_; ++i) {
      const Named& n = tensors_[i];
      msg += fmt::format("{}{} {}", sep, n.first, n.second != nullptr ? n.second->describe() : "none");
      sep = ", ";
    }
    detail::check_failed(__FILE__, line, "argument check", msg);
  }

  void is_float(const char* name, const Tensor& t, int line) const {
    require(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16, line, "{} must be f32 or bf16, not {}",
            name, dtype_name(t.dtype()));
  }
  void is_dtype(const char* name, const Tensor& t, DType want, int line) const {
    require(t.dtype() == want, line, "{} must be {}, not {}", name, dtype_name(want), dtype_name(t.dtype()));
  }
  void is_shape(const char* name, const Tensor& t, const Shape& want, int line) const {
    require(t.shape() == want, line, "{} has shape {}, expected {}", name, shape_to_string(t.shape()),
            shape_to_string(want));
  }
  void is_rank(const char* name, const Tensor& t, int64_t rank, int line) const {
    require(t.dim() == rank, line, "{} must have {} dimensions, has shape {}", name, rank,
            shape_to_string(t.shape()));
  }

  // Calls the backend entry `member` for ex.device with `args`.
  template <typename Fn, typename... Args>
  auto call(Fn Backend::*member, Args&&... args) const {
    return entry(member)(std::forward<Args>(args)...);
  }

 private:
  // The backend entry for ex.device; aborts when that backend or entry does not exist.
  template <typename Fn>
  Fn entry(Fn Backend::*member) const {
    const Backend* b = ex_.device.is_cpu() ? &cpu_backend() : cuda_backend();
    if (b == nullptr || b->*member == nullptr) {
      detail::check_failed(__FILE__, __LINE__, "backend entry",
                           fmt::format("op {} is not available on {}", op_, ex_.device));
    }
    if (ex_.device.is_cuda()) {
      require(ex_.cuda != nullptr, __LINE__, "Exec for {} has no CudaContext", ex_.device);
    }
    return b->*member;
  }

  static constexpr size_t kMaxTensors = 10;
  const char* op_;
  const Exec& ex_;
  std::array<Named, kMaxTensors> tensors_{};  // fixed: no allocation per op call
  size_t num_tensors_ = 0;
};

#define OP_REQUIRE(c, cond, ...) (c).require((cond), __LINE__, __VA_ARGS__)
#define OP_FLOAT(c, t) (c).is_float(#t, (t), __LINE__)
#define OP_DTYPE(c, t, dt) (c).is_dtype(#t, (t), (dt), __LINE__)
#define OP_SHAPE(c, t, ...) (c).is_shape(#t, (t), Shape(__VA_ARGS__), __LINE__)
#define OP_RANK(c, t, r) (c).is_rank(#t, (t), (r), __LINE__)

}  // namespace

// ---- memory and elementwise ----------------------------------------------------------

void fill(const Exec& ex, Tensor& out, float value) {
  OpCheck c("fill", ex, {{"out", &out}});
  c.call(&Backend::fill, ex, out, value);
}

void cast(const Exec& ex, const Tensor& src, Tensor& dst) {
  OpCheck c("cast", ex, {{"src", &src}, {"dst", &dst}});
  OP_SHAPE(c, dst, src.shape());
  c.call(&Backend::cast, ex, src, dst);
}

void add(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out) {
  OpCheck c("add", ex, {{"a", &a}, {"b", &b}, {"out", &out}});
  OP_FLOAT(c, a);
  OP_FLOAT(c, b);
  OP_FLOAT(c, out);
  OP_SHAPE(c, b, a.shape());
  OP_SHAPE(c, out, a.shape());
  c.call(&Backend::add, ex, a, b, out);
}

void axpby(const Exec& ex, float alpha, const Tensor& x, float beta, Tensor& y) {
  OpCheck c("axpby", ex, {{"x", &x}, {"y", &y}});
  OP_FLOAT(c, x);
  OP_FLOAT(c, y);
  OP_SHAPE(c, y, x.shape());
  c.call(&Backend::axpby, ex, alpha, x, beta, y);
}

void scale(const Exec& ex, Tensor& x, float alpha) {
  OpCheck c("scale", ex, {{"x", &x}});
  OP_FLOAT(c, x);
  c.call(&Backend::scale, ex, x, alpha);
}

double sum(const Exec& ex, const Tensor& x) {
  OpCheck c("sum", ex, {{"x", &x}});
  OP_FLOAT(c, x);
  return c.call(&Backend::sum, ex, x);
}

double sum_squares(const Exec& ex, const Tensor& x) {
  OpCheck c("sum_squares", ex, {{"x", &x}});
  OP_FLOAT(c, x);
  return c.call(&Backend::sum_squares, ex, x);
}

void sum_rows(const Exec& ex, const Tensor& x, Tensor& out, bool accumulate) {
  OpCheck c("sum_rows", ex, {{"x", &x}, {"out", &out}});
  OP_FLOAT(c, x);
  OP_FLOAT(c, out);
  OP_RANK(c, x, 2);
  OP_SHAPE(c, out, {x.size(1)});
  c.call(&Backend::sum_rows, ex, x, out, accumulate);
}

// ---- matrix products -----------------------------------------------------------------

namespace {

// Checks matmul's operands and returns out's expected shape.
Shape check_matmul(const OpCheck& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  OP_FLOAT(c, a);
  OP_FLOAT(c, b);
  OP_REQUIRE(c, a.dim() == 2 || a.dim() == 3, "a must be 2-D or batched 3-D");
  OP_REQUIRE(c, b.dim() == 2 || b.dim() == 3, "b must be 2-D or batched 3-D");
  const int64_t m = trans_a ? a.size(-1) : a.size(-2);
  const int64_t ka = trans_a ? a.size(-2) : a.size(-1);
  const int64_t kb = trans_b ? b.size(-1) : b.size(-2);
  const int64_t n = trans_b ? b.size(-2) : b.size(-1);
  OP_REQUIRE(c, ka == kb, "inner dimensions differ ({} vs {}) with trans_a={} trans_b={}", ka, kb, trans_a,
             trans_b);
  if (a.dim() == 3) {
    if (b.dim() == 3)
      OP_REQUIRE(c, a.size(0) == b.size(0), "batch sizes differ ({} vs {})", a.size(0), b.size(0));
    return {a.size(0), m, n};
  }
  if (b.dim() == 3) return {b.size(0), m, n};  // a shared by every batch
  return {m, n};
}

}  // namespace

void matmul(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b,
            float alpha, float beta) {
  OpCheck c("matmul", ex, {{"a", &a}, {"b", &b}, {"out", &out}});
  const Shape want = check_matmul(c, a, b, trans_a, trans_b);
  OP_FLOAT(c, out);
  OP_SHAPE(c, out, want);
  c.call(&Backend::matmul, ex, a, b, out, trans_a, trans_b, alpha, beta);
}

// With out = op(a) @ op(b):
//   d op(a) = dout @ op(b)^T  -> da = dout @ op(b)^T, or its transpose op(b) @ dout^T when trans_a;
//   d op(b) = op(a)^T @ dout  -> db = op(a)^T @ dout, or its transpose dout^T @ op(a) when trans_b.
// op(x)^T is x with the flag flipped, so each case is one matmul with the right flags.
// A 2-D b shared by a batched a is handled batch by batch (its gradient sums over batches);
// a 2-D a shared by a batched b likewise for da, while db is one batched product.
void matmul_backward(const Exec& ex, const Tensor& a, const Tensor& b, const Tensor& dout, Tensor* da,
                     Tensor* db, bool trans_a, bool trans_b, bool accumulate) {
  OpCheck c("matmul_backward", ex, {{"a", &a}, {"b", &b}, {"dout", &dout}, {"da", da}, {"db", db}});
  const Shape want = check_matmul(c, a, b, trans_a, trans_b);
  OP_FLOAT(c, dout);
  OP_SHAPE(c, dout, want);
  if (da != nullptr) {
    OP_FLOAT(c, *da);
    c.is_shape("da", *da, a.shape(), __LINE__);
  }
  if (db != nullptr) {
    OP_FLOAT(c, *db);
    c.is_shape("db", *db, b.shape(), __LINE__);
  }
  const float beta = accumulate ? 1.0f : 0.0f;
  auto grad_a = [&](const Tensor& b_, const Tensor& d_, Tensor& da_, float beta_) {
    if (!trans_a) {
      matmul(ex, d_, b_, da_, false, !trans_b, 1.0f, beta_);
    } else {
      matmul(ex, b_, d_, da_, trans_b, true, 1.0f, beta_);
    }
  };
  auto grad_b = [&](const Tensor& a_, const Tensor& d_, Tensor& db_, float beta_) {
    if (!trans_b) {
      matmul(ex, a_, d_, db_, !trans_a, false, 1.0f, beta_);
    } else {
      matmul(ex, d_, a_, db_, true, trans_a, 1.0f, beta_);
    }
  };
  if (a.dim() == b.dim()) {
    if (da != nullptr) grad_a(b, dout, *da, beta);
    if (db != nullptr) grad_b(a, dout, *db, beta);
    return;
  }
  if (a.dim() == 2) {  // shared 2-D a, batched b
    if (db != nullptr) grad_b(a, dout, *db, beta);
    if (da != nullptr) {
      for (int64_t i = 0; i < b.size(0); ++i)
        grad_a(b.select(0, i), dout.select(0, i), *da, i == 0 ? beta : 1.0f);
    }
    return;
  }
  // Batched a, shared 2-D b.
  const int64_t batches = a.size(0);
  if (!trans_a) {
    // Rows of all batches stack into one 2-D product.
    const Tensor a2 = a.view({-1, a.size(2)});
    const Tensor d2 = dout.view({-1, dout.size(2)});
    if (da != nullptr) {
      Tensor da2 = da->view({-1, da->size(2)});
      grad_a(b, d2, da2, beta);
    }
    if (db != nullptr) grad_b(a2, d2, *db, beta);
    return;
  }
  for (int64_t i = 0; i < batches; ++i) {
    const Tensor ai = a.select(0, i);
    const Tensor di = dout.select(0, i);
    if (da != nullptr) {
      Tensor dai = da->select(0, i);
      grad_a(b, di, dai, beta);
    }
    if (db != nullptr) grad_b(ai, di, *db, i == 0 ? beta : 1.0f);
  }
}

// Checks shared by grouped_matmul and its backward: x [T,K], w [E,K,N] (or [E,N,K] with
// trans_w), offsets i32 [E+1], and `y` (out or dout) [T,N].
static void check_grouped_matmul(OpCheck& c, const Tensor& x, const Tensor& w, const Tensor& offsets,
                                 const Tensor& y, bool trans_w) {
  OP_FLOAT(c, x);
  OP_FLOAT(c, w);
  OP_FLOAT(c, y);
  OP_DTYPE(c, offsets, DType::kI32);
  OP_RANK(c, x, 2);
  OP_RANK(c, w, 3);
  const int64_t k = trans_w ? w.size(2) : w.size(1);
  const int64_t n = trans_w ? w.size(1) : w.size(2);
  OP_REQUIRE(c, x.size(1) == k, "x has {} columns but the experts' matrices take {} (trans_w={})", x.size(1),
             k, trans_w);
  OP_SHAPE(c, offsets, {w.size(0) + 1});
  OP_SHAPE(c, y, {x.size(0), n});
}

void grouped_matmul(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out,
                    bool trans_w) {
  OpCheck c("grouped_matmul", ex, {{"x", &x}, {"w", &w}, {"offsets", &offsets}, {"out", &out}});
  check_grouped_matmul(c, x, w, offsets, out, trans_w);
  c.call(&Backend::grouped_matmul, ex, x, w, offsets, out, trans_w);
}

void grouped_matmul_backward(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets,
                             const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w, bool accumulate_dw,
                             Tensor* dw_sum_squares) {
  OpCheck c("grouped_matmul_backward", ex,
            {{"x", &x},
             {"w", &w},
             {"offsets", &offsets},
             {"dout", &dout},
             {"dx", dx},
             {"dw", dw},
             {"dw_sum_squares", dw_sum_squares}});
  check_grouped_matmul(c, x, w, offsets, dout, trans_w);
  if (dx != nullptr) {
    OP_FLOAT(c, *dx);
    c.is_shape("dx", *dx, x.shape(), __LINE__);
  }
  if (dw != nullptr) {
    OP_FLOAT(c, *dw);
    c.is_shape("dw", *dw, w.shape(), __LINE__);
  }
  if (dw_sum_squares != nullptr) {
    OP_REQUIRE(c, dw != nullptr, "dw_sum_squares needs dw");
    OP_REQUIRE(c, !accumulate_dw,
               "dw_sum_squares needs a written dW (accumulate_dw = false): the sum of squares of an "
               "accumulated dW is not that of the product");
    c.is_dtype("dw_sum_squares", *dw_sum_squares, DType::kF32, __LINE__);
    c.is_shape("dw_sum_squares", *dw_sum_squares,
               {grouped_matmul_dw_sum_squares_slots(w.size(0), w.size(1), w.size(2))}, __LINE__);
  }
  c.call(&Backend::grouped_matmul_backward, ex, x, w, offsets, dout, dx, dw, trans_w, accumulate_dw,
         dw_sum_squares);
}

int64_t grouped_matmul_dw_sum_squares_slots(int64_t experts, int64_t k, int64_t n) {
  // The CUDA Hopper dW kernel's slots (kernels/cuda/grouped_matmul.cu, which checks that it
  // gets enough): 128 x 256 output tiles of the [P, Q] matrix ([k, n], or [n, k] with
  // trans_w), 2 consumer warpgroups of 4 warps each, one slot per warp and tile.
  TROUPE_CHECK(experts >= 0 && k >= 0 && n >= 0, "grouped_matmul_dw_sum_squares_slots({}, {}, {})", experts,
               k, n);
  auto tiles = [](int64_t p, int64_t q) { return (p + 127) / 128 * ((q + 255) / 256); };
  return std::max<int64_t>(1, 8 * experts * std::max(tiles(k, n), tiles(n, k)));
}

// ---- embedding -----------------------------------------------------------------------

void embedding_forward(const Exec& ex, const Tensor& ids, const Tensor& table, Tensor& out) {
  OpCheck c("embedding_forward", ex, {{"ids", &ids}, {"table", &table}, {"out", &out}});
  OP_DTYPE(c, ids, DType::kI32);
  OP_RANK(c, ids, 1);
  OP_FLOAT(c, table);
  OP_FLOAT(c, out);
  OP_RANK(c, table, 2);
  OP_SHAPE(c, out, {ids.size(0), table.size(1)});
  c.call(&Backend::embedding_forward, ex, ids, table, out);
}

void embedding_backward(const Exec& ex, const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  OpCheck c("embedding_backward", ex, {{"ids", &ids}, {"dout", &dout}, {"dtable", &dtable}});
  OP_DTYPE(c, ids, DType::kI32);
  OP_RANK(c, ids, 1);
  OP_FLOAT(c, dout);
  OP_FLOAT(c, dtable);
  OP_RANK(c, dtable, 2);
  OP_SHAPE(c, dout, {ids.size(0), dtable.size(1)});
  c.call(&Backend::embedding_backward, ex, ids, dout, dtable);
}

// ---- RMSNorm -------------------------------------------------------------------------

// Checks shared by rmsnorm_forward and rmsnorm_add_forward (x being the normalised input).
static void check_rmsnorm_forward(OpCheck& c, const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                  const Tensor& rstd) {
  OP_FLOAT(c, x);
  OP_FLOAT(c, w);
  OP_FLOAT(c, y);
  OP_DTYPE(c, rstd, DType::kF32);
  OP_RANK(c, x, 2);
  OP_SHAPE(c, w, {x.size(1)});
  OP_SHAPE(c, y, x.shape());
  OP_SHAPE(c, rstd, {x.size(0)});
  OP_REQUIRE(c, eps >= 0.0f, "eps = {} is negative", eps);
}

void rmsnorm_forward(const Exec& ex, const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  OpCheck c("rmsnorm_forward", ex, {{"x", &x}, {"w", &w}, {"y", &y}, {"rstd", &rstd}});
  check_rmsnorm_forward(c, x, w, eps, y, rstd);
  c.call(&Backend::rmsnorm_forward, ex, x, nullptr, w, eps, nullptr, y, rstd);
}

void rmsnorm_add_forward(const Exec& ex, const Tensor& x, const Tensor& r, const Tensor& w, float eps,
                         Tensor& h, Tensor& y, Tensor& rstd) {
  OpCheck c("rmsnorm_add_forward", ex,
            {{"x", &x}, {"r", &r}, {"w", &w}, {"h", &h}, {"y", &y}, {"rstd", &rstd}});
  check_rmsnorm_forward(c, x, w, eps, y, rstd);
  OP_DTYPE(c, r, x.dtype());
  OP_DTYPE(c, h, x.dtype());
  OP_SHAPE(c, r, x.shape());
  OP_SHAPE(c, h, x.shape());
  c.call(&Backend::rmsnorm_forward, ex, x, &r, w, eps, &h, y, rstd);
}

void rmsnorm_backward(const Exec& ex, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dw, const Tensor* dres) {
  OpCheck c("rmsnorm_backward", ex,
            {{"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dx", &dx}, {"dw", &dw}});
  OP_FLOAT(c, dy);
  OP_FLOAT(c, x);
  OP_FLOAT(c, w);
  OP_FLOAT(c, dx);
  OP_FLOAT(c, dw);
  OP_DTYPE(c, rstd, DType::kF32);
  OP_RANK(c, x, 2);
  OP_SHAPE(c, dy, x.shape());
  OP_SHAPE(c, dx, x.shape());
  OP_SHAPE(c, w, {x.size(1)});
  OP_SHAPE(c, dw, {x.size(1)});
  OP_SHAPE(c, rstd, {x.size(0)});
  if (dres != nullptr) {
    OpCheck cr("rmsnorm_backward", ex, {{"dres", dres}});
    OP_DTYPE(cr, *dres, dx.dtype());
    OP_SHAPE(cr, *dres, x.shape());
  }
  c.call(&Backend::rmsnorm_backward, ex, dy, x, w, rstd, dx, dw, accumulate_dw, dres);
}

// ---- rotary position embedding -------------------------------------------------------

namespace {
void check_rope(const OpCheck& c, const Tensor& x, const Tensor& pos, float theta, const Tensor& out) {
  OP_FLOAT(c, x);
  OP_FLOAT(c, out);
  OP_DTYPE(c, pos, DType::kI32);
  OP_RANK(c, x, 3);
  OP_REQUIRE(c, x.size(2) % 2 == 0, "head dimension {} is odd", x.size(2));
  OP_SHAPE(c, pos, {x.size(0)});
  OP_SHAPE(c, out, x.shape());
  OP_REQUIRE(c, theta > 0.0f, "theta = {} must be positive", theta);
}
}  // namespace

void rope_forward(const Exec& ex, const Tensor& x, const Tensor& pos, float theta, Tensor& out) {
  OpCheck c("rope_forward", ex, {{"x", &x}, {"pos", &pos}, {"out", &out}});
  check_rope(c, x, pos, theta, out);
  c.call(&Backend::rope_forward, ex, x, pos, theta, out);
}

void rope_backward(const Exec& ex, const Tensor& dout, const Tensor& pos, float theta, Tensor& dx) {
  OpCheck c("rope_backward", ex, {{"dout", &dout}, {"pos", &pos}, {"dx", &dx}});
  check_rope(c, dout, pos, theta, dx);
  c.call(&Backend::rope_backward, ex, dout, pos, theta, dx);
}

// ---- attention -----------------------------------------------------------------------

namespace {
void check_attention(const OpCheck& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse) {
  OP_FLOAT(c, q);
  OP_FLOAT(c, k);
  OP_FLOAT(c, v);
  OP_FLOAT(c, out);
  OP_DTYPE(c, lse, DType::kF32);
  OP_RANK(c, q, 4);
  OP_RANK(c, k, 4);
  OP_REQUIRE(c, k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
             "k must be [B, S, Hkv, Dh] with q's B, S and Dh");
  OP_REQUIRE(c, k.size(2) > 0 && q.size(2) % k.size(2) == 0,
             "query heads {} are not a multiple of kv heads {}", q.size(2), k.size(2));
  OP_SHAPE(c, v, k.shape());
  OP_SHAPE(c, out, q.shape());
  OP_SHAPE(c, lse, {q.size(0), q.size(2), q.size(1)});
}
}  // namespace

void attention_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                       Tensor& out, Tensor& lse) {
  OpCheck c("attention_forward", ex, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  check_attention(c, q, k, v, out, lse);
  c.call(&Backend::attention_forward, ex, q, k, v, scale, out, lse);
}

void attention_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk,
                        Tensor& dv, const RopeArgs* rope) {
  OpCheck c("attention_backward", ex,
            {{"q", &q},
             {"k", &k},
             {"v", &v},
             {"out", &out},
             {"lse", &lse},
             {"dout", &dout},
             {"dq", &dq},
             {"dk", &dk},
             {"dv", &dv},
             {"rope_pos", rope != nullptr ? rope->pos : nullptr}});
  check_attention(c, q, k, v, out, lse);
  OP_FLOAT(c, dout);
  OP_FLOAT(c, dq);
  OP_FLOAT(c, dk);
  OP_FLOAT(c, dv);
  OP_SHAPE(c, dout, q.shape());
  OP_SHAPE(c, dq, q.shape());
  OP_SHAPE(c, dk, k.shape());
  OP_SHAPE(c, dv, k.shape());
  if (rope != nullptr) {
    OP_REQUIRE(c, rope->pos != nullptr, "rope has no positions");
    const Tensor& rope_pos = *rope->pos;
    OP_DTYPE(c, rope_pos, DType::kI32);
    OP_SHAPE(c, rope_pos, {q.size(0) * q.size(1)});
    OP_REQUIRE(c, q.size(3) % 2 == 0, "rope needs an even head dim, not {}", q.size(3));
    OP_REQUIRE(c, rope->theta > 0.0f, "rope theta must be positive, not {}", rope->theta);
  }
  c.call(&Backend::attention_backward, ex, q, k, v, out, lse, dout, scale, dq, dk, dv, rope);
}

// ---- softmax -------------------------------------------------------------------------

void softmax_forward(const Exec& ex, const Tensor& x, Tensor& y) {
  OpCheck c("softmax_forward", ex, {{"x", &x}, {"y", &y}});
  OP_FLOAT(c, x);
  OP_FLOAT(c, y);
  OP_RANK(c, x, 2);
  OP_SHAPE(c, y, x.shape());
  c.call(&Backend::softmax_forward, ex, x, y);
}

void softmax_backward(const Exec& ex, const Tensor& y, const Tensor& dy, Tensor& dx) {
  OpCheck c("softmax_backward", ex, {{"y", &y}, {"dy", &dy}, {"dx", &dx}});
  OP_FLOAT(c, y);
  OP_FLOAT(c, dy);
  OP_FLOAT(c, dx);
  OP_RANK(c, y, 2);
  OP_SHAPE(c, dy, y.shape());
  OP_SHAPE(c, dx, y.shape());
  c.call(&Backend::softmax_backward, ex, y, dy, dx);
}

// ---- MoE router ----------------------------------------------------------------------

void router_forward(const Exec& ex, const Tensor& logits, const Tensor* bias, const RouterConfig& cfg,
                    Tensor& scores, Tensor& topk_idx, Tensor& gates, const RouterStats* stats) {
  OpCheck c(
      "router_forward", ex,
      {{"logits", &logits}, {"bias", bias}, {"scores", &scores}, {"topk_idx", &topk_idx}, {"gates", &gates}});
  OP_FLOAT(c, logits);
  OP_RANK(c, logits, 2);
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  OP_REQUIRE(c, cfg.top_k >= 1 && cfg.top_k <= experts, "top_k = {} outside [1, {}]", cfg.top_k, experts);
  if (bias != nullptr) {
    OP_DTYPE(c, *bias, DType::kF32);
    c.is_shape("bias", *bias, {experts}, __LINE__);
  }
  OP_DTYPE(c, scores, DType::kF32);
  OP_DTYPE(c, topk_idx, DType::kI32);
  OP_DTYPE(c, gates, DType::kF32);
  OP_SHAPE(c, scores, {tokens, experts});
  OP_SHAPE(c, topk_idx, {tokens, static_cast<int64_t>(cfg.top_k)});
  OP_SHAPE(c, gates, {tokens, static_cast<int64_t>(cfg.top_k)});
  if (stats != nullptr) {
    OpCheck cs("router_forward", ex,
               {{"stats.counts", stats->counts},
                {"stats.score_sums", stats->score_sums},
                {"stats.acc", stats->acc}});
    OP_REQUIRE(cs, stats->counts != nullptr, "stats without counts");
    OP_DTYPE(cs, *stats->counts, DType::kF32);
    cs.is_shape("stats.counts", *stats->counts, {experts}, __LINE__);
    if (stats->score_sums != nullptr) {
      OP_DTYPE(cs, *stats->score_sums, DType::kF32);
      cs.is_shape("stats.score_sums", *stats->score_sums, {experts}, __LINE__);
    }
    if (stats->acc != nullptr) {
      OP_DTYPE(cs, *stats->acc, DType::kF32);
      cs.is_shape("stats.acc", *stats->acc, {experts + 1}, __LINE__);
    }
    OP_REQUIRE(cs, std::isfinite(stats->aux_scale), "stats.aux_scale = {} is not finite", stats->aux_scale);
  }
  c.call(&Backend::router_forward, ex, logits, bias, cfg, scores, topk_idx, gates, stats);
}

void router_backward(const Exec& ex, const Tensor& scores, const Tensor& topk_idx, const Tensor& dgates,
                     const Tensor* dscores, const RouterConfig& cfg, Tensor& dlogits, float dscores_scale) {
  OpCheck c("router_backward", ex,
            {{"scores", &scores},
             {"topk_idx", &topk_idx},
             {"dgates", &dgates},
             {"dscores", dscores},
             {"dlogits", &dlogits}});
  OP_DTYPE(c, scores, DType::kF32);
  OP_RANK(c, scores, 2);
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  OP_REQUIRE(c, cfg.top_k >= 1 && cfg.top_k <= experts, "top_k = {} outside [1, {}]", cfg.top_k, experts);
  OP_DTYPE(c, topk_idx, DType::kI32);
  OP_FLOAT(c, dgates);
  OP_FLOAT(c, dlogits);
  OP_SHAPE(c, topk_idx, {tokens, static_cast<int64_t>(cfg.top_k)});
  OP_SHAPE(c, dgates, {tokens, static_cast<int64_t>(cfg.top_k)});
  if (dscores != nullptr) {
    OP_FLOAT(c, *dscores);
    if (dscores->dim() == 1) {
      c.is_shape("dscores", *dscores, {experts}, __LINE__);  // one row for every token
    } else {
      c.is_shape("dscores", *dscores, scores.shape(), __LINE__);
    }
  }
  OP_REQUIRE(c, std::isfinite(dscores_scale), "dscores_scale = {} is not finite", dscores_scale);
  OP_SHAPE(c, dlogits, scores.shape());
  c.call(&Backend::router_backward, ex, scores, topk_idx, dgates, dscores, cfg, dlogits, dscores_scale);
}

void logsumexp_forward(const Exec& ex, const Tensor& x, Tensor& lse) {
  OpCheck c("logsumexp_forward", ex, {{"x", &x}, {"lse", &lse}});
  OP_DTYPE(c, x, DType::kF32);
  OP_RANK(c, x, 2);
  OP_DTYPE(c, lse, DType::kF32);
  OP_SHAPE(c, lse, {x.size(0)});
  c.call(&Backend::logsumexp_forward, ex, x, lse);
}

void logsumexp_backward(const Exec& ex, const Tensor& x, const Tensor& lse, const Tensor& dlse, float scale,
                        Tensor& dx) {
  OpCheck c("logsumexp_backward", ex, {{"x", &x}, {"lse", &lse}, {"dlse", &dlse}, {"dx", &dx}});
  OP_DTYPE(c, x, DType::kF32);
  OP_RANK(c, x, 2);
  OP_DTYPE(c, lse, DType::kF32);
  OP_SHAPE(c, lse, {x.size(0)});
  OP_DTYPE(c, dlse, DType::kF32);
  OP_SHAPE(c, dlse, {x.size(0)});
  OP_DTYPE(c, dx, DType::kF32);
  OP_SHAPE(c, dx, x.shape());
  OP_REQUIRE(c, std::isfinite(scale), "scale = {} is not finite", scale);
  c.call(&Backend::logsumexp_backward, ex, x, lse, dlse, scale, dx);
}

// ---- token permutation by expert -----------------------------------------------------

void moe_dispatch_plan(const Exec& ex, const Tensor& topk_idx, int64_t num_experts, int64_t capacity,
                       Tensor& row_map, Tensor& expert_counts, Tensor& expert_offsets) {
  OpCheck c("moe_dispatch_plan", ex,
            {{"topk_idx", &topk_idx},
             {"row_map", &row_map},
             {"expert_counts", &expert_counts},
             {"expert_offsets", &expert_offsets}});
  OP_DTYPE(c, topk_idx, DType::kI32);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_DTYPE(c, expert_counts, DType::kI32);
  OP_DTYPE(c, expert_offsets, DType::kI32);
  OP_RANK(c, topk_idx, 2);
  OP_REQUIRE(c, num_experts >= 1, "num_experts = {} must be positive", num_experts);
  OP_SHAPE(c, row_map, {topk_idx.numel()});
  OP_SHAPE(c, expert_counts, {num_experts});
  OP_SHAPE(c, expert_offsets, {num_experts + 1});
  c.call(&Backend::moe_dispatch_plan, ex, topk_idx, num_experts, capacity, row_map, expert_counts,
         expert_offsets);
}

void moe_permute(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& xp) {
  OpCheck c("moe_permute", ex, {{"x", &x}, {"row_map", &row_map}, {"xp", &xp}});
  OP_FLOAT(c, x);
  OP_FLOAT(c, xp);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_RANK(c, x, 2);
  OP_RANK(c, xp, 2);
  OP_REQUIRE(c, top_k >= 1, "top_k = {} must be positive", top_k);
  OP_SHAPE(c, row_map, {x.size(0) * top_k});
  OP_REQUIRE(c, xp.size(1) == x.size(1), "xp has {} columns, x has {}", xp.size(1), x.size(1));
  c.call(&Backend::moe_permute, ex, x, row_map, top_k, xp);
}

void moe_permute_backward(const Exec& ex, const Tensor& dxp, const Tensor& row_map, int64_t top_k,
                          Tensor& dx) {
  OpCheck c("moe_permute_backward", ex, {{"dxp", &dxp}, {"row_map", &row_map}, {"dx", &dx}});
  OP_FLOAT(c, dxp);
  OP_FLOAT(c, dx);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_RANK(c, dx, 2);
  OP_RANK(c, dxp, 2);
  OP_REQUIRE(c, top_k >= 1, "top_k = {} must be positive", top_k);
  OP_SHAPE(c, row_map, {dx.size(0) * top_k});
  OP_REQUIRE(c, dxp.size(1) == dx.size(1), "dxp has {} columns, dx has {}", dxp.size(1), dx.size(1));
  c.call(&Backend::moe_permute_backward, ex, dxp, row_map, top_k, dx);
}

void moe_unpermute(const Exec& ex, const Tensor& yp, const Tensor& row_map, const Tensor& gates, Tensor& y,
                   const Tensor* residual) {
  OpCheck c("moe_unpermute", ex,
            {{"yp", &yp}, {"row_map", &row_map}, {"gates", &gates}, {"y", &y}, {"residual", residual}});
  OP_FLOAT(c, yp);
  OP_FLOAT(c, gates);
  OP_FLOAT(c, y);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_RANK(c, yp, 2);
  OP_RANK(c, y, 2);
  OP_RANK(c, gates, 2);
  OP_REQUIRE(c, gates.size(0) == y.size(0), "gates has {} rows, y has {}", gates.size(0), y.size(0));
  OP_SHAPE(c, row_map, {gates.numel()});
  OP_REQUIRE(c, yp.size(1) == y.size(1), "yp has {} columns, y has {}", yp.size(1), y.size(1));
  if (residual != nullptr) {
    c.is_dtype("residual", *residual, y.dtype(), __LINE__);
    c.is_shape("residual", *residual, y.shape(), __LINE__);
    OP_REQUIRE(c, residual->data_ptr() != y.data_ptr() || residual->numel() == 0, "residual must not be y");
  }
  c.call(&Backend::moe_unpermute, ex, yp, row_map, gates, y, residual);
}

void moe_unpermute_backward(const Exec& ex, const Tensor& dy, const Tensor& yp, const Tensor& row_map,
                            const Tensor& gates, Tensor& dyp, Tensor& dgates) {
  OpCheck c("moe_unpermute_backward", ex,
            {{"dy", &dy},
             {"yp", &yp},
             {"row_map", &row_map},
             {"gates", &gates},
             {"dyp", &dyp},
             {"dgates", &dgates}});
  OP_FLOAT(c, dy);
  OP_FLOAT(c, yp);
  OP_FLOAT(c, gates);
  OP_FLOAT(c, dyp);
  OP_FLOAT(c, dgates);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_RANK(c, yp, 2);
  OP_RANK(c, dy, 2);
  OP_RANK(c, gates, 2);
  OP_REQUIRE(c, gates.size(0) == dy.size(0), "gates has {} rows, dy has {}", gates.size(0), dy.size(0));
  OP_SHAPE(c, row_map, {gates.numel()});
  OP_REQUIRE(c, yp.size(1) == dy.size(1), "yp has {} columns, dy has {}", yp.size(1), dy.size(1));
  OP_SHAPE(c, dyp, yp.shape());
  OP_SHAPE(c, dgates, gates.shape());
  c.call(&Backend::moe_unpermute_backward, ex, dy, yp, row_map, gates, dyp, dgates);
}

// ---- SwiGLU --------------------------------------------------------------------------

void swiglu_forward(const Exec& ex, const Tensor& h, Tensor& out) {
  OpCheck c("swiglu_forward", ex, {{"h", &h}, {"out", &out}});
  OP_FLOAT(c, h);
  OP_FLOAT(c, out);
  OP_RANK(c, h, 2);
  OP_REQUIRE(c, h.size(1) % 2 == 0, "h has an odd number of columns ({})", h.size(1));
  OP_SHAPE(c, out, {h.size(0), h.size(1) / 2});
  c.call(&Backend::swiglu_forward, ex, h, out);
}

void swiglu_backward(const Exec& ex, const Tensor& h, const Tensor& dout, Tensor& dh) {
  OpCheck c("swiglu_backward", ex, {{"h", &h}, {"dout", &dout}, {"dh", &dh}});
  OP_FLOAT(c, h);
  OP_FLOAT(c, dout);
  OP_FLOAT(c, dh);
  OP_RANK(c, h, 2);
  OP_REQUIRE(c, h.size(1) % 2 == 0, "h has an odd number of columns ({})", h.size(1));
  OP_SHAPE(c, dout, {h.size(0), h.size(1) / 2});
  OP_SHAPE(c, dh, h.shape());
  c.call(&Backend::swiglu_backward, ex, h, dout, dh);
}

// ---- cross-entropy -------------------------------------------------------------------

void cross_entropy_forward(const Exec& ex, const Tensor& logits, const Tensor& targets, Tensor& losses,
                           Tensor& lse) {
  OpCheck c("cross_entropy_forward", ex,
            {{"logits", &logits}, {"targets", &targets}, {"losses", &losses}, {"lse", &lse}});
  OP_FLOAT(c, logits);
  OP_RANK(c, logits, 2);
  OP_DTYPE(c, targets, DType::kI32);
  OP_DTYPE(c, losses, DType::kF32);
  OP_DTYPE(c, lse, DType::kF32);
  OP_SHAPE(c, targets, {logits.size(0)});
  OP_SHAPE(c, losses, {logits.size(0)});
  OP_SHAPE(c, lse, {logits.size(0)});
  c.call(&Backend::cross_entropy_forward, ex, logits, targets, losses, lse);
}

void cross_entropy_backward(const Exec& ex, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float grad_scale, Tensor& dlogits) {
  OpCheck c("cross_entropy_backward", ex,
            {{"logits", &logits}, {"targets", &targets}, {"lse", &lse}, {"dlogits", &dlogits}});
  OP_FLOAT(c, logits);
  OP_FLOAT(c, dlogits);
  OP_RANK(c, logits, 2);
  OP_DTYPE(c, targets, DType::kI32);
  OP_DTYPE(c, lse, DType::kF32);
  OP_SHAPE(c, targets, {logits.size(0)});
  OP_SHAPE(c, lse, {logits.size(0)});
  OP_SHAPE(c, dlogits, logits.shape());
  c.call(&Backend::cross_entropy_backward, ex, logits, targets, lse, grad_scale, dlogits);
}

void cross_entropy_forward_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& losses, Tensor& lse, Tensor& dlogits) {
  OpCheck c("cross_entropy_forward_backward", ex,
            {{"logits", &logits},
             {"targets", &targets},
             {"losses", &losses},
             {"lse", &lse},
             {"dlogits", &dlogits}});
  OP_FLOAT(c, logits);
  OP_FLOAT(c, dlogits);
  OP_RANK(c, logits, 2);
  OP_DTYPE(c, targets, DType::kI32);
  OP_DTYPE(c, losses, DType::kF32);
  OP_DTYPE(c, lse, DType::kF32);
  OP_SHAPE(c, targets, {logits.size(0)});
  OP_SHAPE(c, losses, {logits.size(0)});
  OP_SHAPE(c, lse, {logits.size(0)});
  OP_SHAPE(c, dlogits, logits.shape());
  c.call(&Backend::cross_entropy_forward_backward, ex, logits, targets, grad_scale, losses, lse, dlogits);
}

// ---- optimizer -----------------------------------------------------------------------

void adamw_step(const Exec& ex, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const AdamWConfig& cfg) {
  OpCheck c("adamw_step", ex, {{"param", &param}, {"grad", &grad}, {"m", &m}, {"v", &v}});
  OP_DTYPE(c, param, DType::kF32);
  OP_FLOAT(c, grad);
  OP_DTYPE(c, m, DType::kF32);
  OP_DTYPE(c, v, DType::kF32);
  OP_SHAPE(c, grad, param.shape());
  OP_SHAPE(c, m, param.shape());
  OP_SHAPE(c, v, param.shape());
  OP_REQUIRE(c, cfg.step >= 1, "step = {} must be 1-based", cfg.step);
  OP_REQUIRE(c, cfg.beta1 >= 0.0f && cfg.beta1 < 1.0f && cfg.beta2 >= 0.0f && cfg.beta2 < 1.0f,
             "betas ({}, {}) must lie in [0, 1)", cfg.beta1, cfg.beta2);
  OP_REQUIRE(c, cfg.clip_sum_squares == nullptr, "clip_sum_squares is for adamw_step_multi only");
  c.call(&Backend::adamw_step, ex, param, grad, m, v, cfg);
}

void adamw_step_multi(const Exec& ex, std::span<const AdamWTensor> tensors, const AdamWConfig& cfg) {
  OpCheck c("adamw_step_multi", ex, {});
  OP_REQUIRE(c, cfg.step >= 1, "step = {} must be 1-based", cfg.step);
  OP_REQUIRE(c, cfg.beta1 >= 0.0f && cfg.beta1 < 1.0f && cfg.beta2 >= 0.0f && cfg.beta2 < 1.0f,
             "betas ({}, {}) must lie in [0, 1)", cfg.beta1, cfg.beta2);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    OP_REQUIRE(c, t.param != nullptr && t.grad != nullptr && t.m != nullptr && t.v != nullptr,
               "tensor {} of the list has a null param, grad, m or v", i);
    // The per-tensor checks of adamw_step, naming the tensor's place in the list.
    OpCheck ct("adamw_step_multi", ex, {{"param", t.param}, {"grad", t.grad}, {"m", t.m}, {"v", t.v}});
    const Tensor &param = *t.param, &grad = *t.grad, &m = *t.m, &v = *t.v;
    OP_REQUIRE(ct, param.dtype() == DType::kF32 && m.dtype() == DType::kF32 && v.dtype() == DType::kF32,
               "tensor {}: param, m and v must be f32", i);
    OP_FLOAT(ct, grad);
    OP_REQUIRE(ct, grad.shape() == param.shape() && m.shape() == param.shape() && v.shape() == param.shape(),
               "tensor {}: grad, m and v must have param's shape {}", i, shape_to_string(param.shape()));
    if (t.work != nullptr) {
      OpCheck cw("adamw_step_multi", ex, {{"work", t.work}});
      OP_REQUIRE(cw, t.work->dtype() == DType::kF32 || t.work->dtype() == DType::kBF16,
                 "tensor {}: work must be f32 or bf16, got {}", i, dtype_name(t.work->dtype()));
      OP_REQUIRE(cw, t.work->shape() == param.shape(), "tensor {}: work must have param's shape {}", i,
                 shape_to_string(param.shape()));
    }
    if (t.work_lo != nullptr) {
      OpCheck cl("adamw_step_multi", ex, {{"work_lo", t.work_lo}});
      OP_REQUIRE(cl, t.work != nullptr && t.work->dtype() == DType::kBF16,
                 "tensor {}: a split master (work_lo) needs a bf16 work", i);
      OP_REQUIRE(cl, t.work_lo->dtype() == DType::kI16, "tensor {}: work_lo must be i16, got {}", i,
                 dtype_name(t.work_lo->dtype()));
      OP_REQUIRE(cl, t.work_lo->shape() == param.shape(), "tensor {}: work_lo must have param's shape {}", i,
                 shape_to_string(param.shape()));
    }
  }
  if (cfg.clip_sum_squares != nullptr) {
    OpCheck cc("adamw_step_multi", ex, {{"clip_sum_squares", cfg.clip_sum_squares}});
    OP_DTYPE(cc, *cfg.clip_sum_squares, DType::kF32);
    OP_SHAPE(cc, *cfg.clip_sum_squares, {1});
  }
  if (cfg.device_schedule != nullptr) {
    OpCheck cs("adamw_step_multi", ex, {{"device_schedule", cfg.device_schedule}});
    OP_DTYPE(cs, *cfg.device_schedule, DType::kF32);
    OP_SHAPE(cs, *cfg.device_schedule, {3});
  }
  c.call(&Backend::adamw_step_multi, ex, tensors, cfg);
}

void master_split(const Exec& ex, const Tensor& value, Tensor& hi, Tensor& lo) {
  OpCheck c("master_split", ex, {{"value", &value}, {"hi", &hi}, {"lo", &lo}});
  OP_DTYPE(c, value, DType::kF32);
  OP_DTYPE(c, hi, DType::kBF16);
  OP_DTYPE(c, lo, DType::kI16);
  OP_SHAPE(c, hi, value.shape());
  OP_SHAPE(c, lo, value.shape());
  c.call(&Backend::master_split, ex, value, hi, lo);
}

void master_join(const Exec& ex, const Tensor& hi, const Tensor& lo, Tensor& value) {
  OpCheck c("master_join", ex, {{"hi", &hi}, {"lo", &lo}, {"value", &value}});
  OP_DTYPE(c, hi, DType::kBF16);
  OP_DTYPE(c, lo, DType::kI16);
  OP_DTYPE(c, value, DType::kF32);
  OP_SHAPE(c, lo, hi.shape());
  OP_SHAPE(c, value, hi.shape());
  c.call(&Backend::master_join, ex, hi, lo, value);
}

std::array<float, 3> adamw_schedule(const AdamWConfig& cfg) {
  TROUPE_CHECK(cfg.step >= 1, "adamw_schedule: step = {} must be 1-based", cfg.step);
  const double step = static_cast<double>(cfg.step);
  return {cfg.lr, static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta1), step)),
          static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta2), step))};
}

double sum_squares_multi(const Exec& ex, std::span<const Tensor* const> tensors) {
  OpCheck c("sum_squares_multi", ex, {});
  for (size_t i = 0; i < tensors.size(); ++i) {
    OP_REQUIRE(c, tensors[i] != nullptr, "tensor {} of the list is null", i);
    OpCheck ct("sum_squares_multi", ex, {{"x", tensors[i]}});
    OP_FLOAT(ct, *tensors[i]);
  }
  return c.call(&Backend::sum_squares_multi, ex, tensors);
}

// ---- device-resident step statistics ------------------------------------------

void sum_squares_into(const Exec& ex, std::span<const Tensor* const> tensors, Tensor& out, bool accumulate,
                      std::span<const Tensor* const> sums) {
  OpCheck c("sum_squares_into", ex, {{"out", &out}});
  OP_DTYPE(c, out, DType::kF32);
  OP_SHAPE(c, out, {1});
  for (size_t i = 0; i < tensors.size(); ++i) {
    OP_REQUIRE(c, tensors[i] != nullptr, "tensor {} of the list is null", i);
    OpCheck ct("sum_squares_into", ex, {{"x", tensors[i]}});
    OP_FLOAT(ct, *tensors[i]);
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    OP_REQUIRE(c, sums[i] != nullptr, "tensor {} of the sums is null", i);
    OpCheck ct("sum_squares_into", ex, {{"sums", sums[i]}});
    OP_FLOAT(ct, *sums[i]);
  }
  c.call(&Backend::sum_squares_into, ex, tensors, sums, out, accumulate);
}

// ---- quantization --------------------------------------------------------------------

namespace {
void check_fp8(const OpCheck& c, const Tensor& x, const Tensor& q, const Tensor& scales, int64_t block_size) {
  OP_FLOAT(c, x);
  OP_REQUIRE(c, q.dtype() == DType::kF8E4M3 || q.dtype() == DType::kF8E5M2,
             "q must be fp8e4m3 or fp8e5m2, not {}", dtype_name(q.dtype()));
  OP_DTYPE(c, scales, DType::kF32);
  OP_RANK(c, x, 2);
  OP_SHAPE(c, q, x.shape());
  OP_REQUIRE(c, block_size >= 0, "block_size = {} is negative", block_size);
  const int64_t nb = block_size == 0 ? 1 : (x.size(1) + block_size - 1) / block_size;
  OP_SHAPE(c, scales, {x.size(0), nb});
}
}  // namespace

void quantize_fp8(const Exec& ex, const Tensor& x, int64_t block_size, Tensor& q, Tensor& scales) {
  OpCheck c("quantize_fp8", ex, {{"x", &x}, {"q", &q}, {"scales", &scales}});
  check_fp8(c, x, q, scales, block_size);
  c.call(&Backend::quantize_fp8, ex, x, block_size, q, scales);
}

void dequantize_fp8(const Exec& ex, const Tensor& q, const Tensor& scales, int64_t block_size, Tensor& out) {
  OpCheck c("dequantize_fp8", ex, {{"q", &q}, {"scales", &scales}, {"out", &out}});
  check_fp8(c, out, q, scales, block_size);
  c.call(&Backend::dequantize_fp8, ex, q, scales, block_size, out);
}

// ---- communication codecs ----------------------------------------------------
void moe_permute_fp8(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& q,
                     Tensor& scales) {
  OpCheck c("moe_permute_fp8", ex, {{"x", &x}, {"row_map", &row_map}, {"q", &q}, {"scales", &scales}});
  OP_FLOAT(c, x);
  OP_DTYPE(c, row_map, DType::kI32);
  OP_DTYPE(c, q, DType::kF8E4M3);
  OP_DTYPE(c, scales, DType::kF32);
  OP_RANK(c, x, 2);
  OP_RANK(c, q, 2);
  OP_REQUIRE(c, top_k >= 1, "top_k = {} must be positive", top_k);
  OP_SHAPE(c, row_map, {x.size(0) * top_k});
  OP_REQUIRE(c, q.size(1) == x.size(1), "q has {} columns, x has {}", q.size(1), x.size(1));
  OP_SHAPE(c, scales, {q.size(0)});
  c.call(&Backend::moe_permute_fp8, ex, x, row_map, top_k, q, scales);
}

void sum_chunks(const Exec& ex, const Tensor& in, Tensor& out) {
  OpCheck c("sum_chunks", ex, {{"in", &in}, {"out", &out}});
  OP_FLOAT(c, in);
  OP_DTYPE(c, out, DType::kF32);
  OP_RANK(c, in, 2);
  OP_REQUIRE(c, in.size(0) >= 1, "in has no chunk");
  OP_SHAPE(c, out, {in.size(1)});
  c.call(&Backend::sum_chunks, ex, in, out);
}

}  // namespace troupe::kernels
